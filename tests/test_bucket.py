"""Buckets: storages placed close together move in one op each way, where the predicted
step and peak stay as they were. The synthetic chunk is the planner tests' (ten 1 ms
nodes each way; ``a<i>`` made by forward node ``i``, read by ``i + 1`` and first read by
backward node ``10 - i``; copies at 1 GB/s)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import offload_pass
from offload_pass import ops
from offload_pass.bucket import _forward_runs, bucket_transfers
from offload_pass.planner import Request, plan_offloads
from offload_pass.simulate import MemoryTimeline
from tests import models
from tests.conftest import train_step
from tests.test_planner import MB, PROFILE, chunk, group, plan


def _positions(planned) -> dict[str, tuple[int, int, int, int]]:
    return {t.root: (t.offload_at, t.wait_at, t.reload_at, t.need_at) for t in planned.transfers}


def test_storages_whose_copies_still_end_in_time_share_one_op_each_way():
    # Eight 0.1 MB copies (0.1 ms each) beside an 8 MB activation that stays. Issued
    # together after node 7, all eight end 0.8 ms later, before node 8 ends, where a7's
    # wait was: one offload and one wait move them, and the 8 MB activation still makes
    # the peak. Backward reloads each pair once, before the first need of the two, as the
    # planner places one reload of 0.2 MB. The step and the peak stay as they were.
    small = [group(i, MB // 10) for i in range(8)]
    stays = group(9, 8 * MB)
    costs = chunk([*small, stays])
    shares = {g.root: ("", 1.0) for g in small} | {stays.root: ("", 0.0)}
    planned = plan_offloads([*small, stays], costs, Request(shares, 0, 0.0, None))
    assert _positions(planned)["a0"] == (0, 1, 9, 10)
    assert _positions(planned)["a7"] == (7, 8, 2, 3)

    bucketed = bucket_transfers(planned, costs, stall_tolerance=0.0)
    pairs = [(8, 9), (6, 7), (4, 5), (2, 3)]
    assert _positions(bucketed) == {f"a{i}": (7, 8, *pairs[i // 2]) for i in range(8)}
    assert bucketed.prediction.step_seconds == planned.prediction.step_seconds
    assert bucketed.prediction.peak_bytes == planned.prediction.peak_bytes
    assert bucketed.decisions == planned.decisions


def test_a_copy_that_would_end_late_in_a_bucket_keeps_its_own_op():
    # a0's 8 ms copy only just finishes in forward: copied with a1 after node 1, it would
    # end after forward, and forward would wait for it. a1 and a2 can share one.
    groups = [group(0, 8 * MB), group(1, MB // 10), group(2, MB // 10)]
    planned = plan(groups, share=1.0)
    bucketed = bucket_transfers(planned, chunk(groups), stall_tolerance=0.0)
    forward = {root: p[:2] for root, p in _positions(bucketed).items()}
    assert forward == {"a0": (0, 9), "a1": (2, 9), "a2": (2, 9)}
    assert bucketed.prediction.step_seconds == planned.prediction.step_seconds


def test_a_bucket_on_a_busy_queue_delays_no_copy_after_it():
    # The device-to-host queue is busy from a0's copy to a3's, each copy starting where
    # the one before ends. A run issued after its last member is made may start its
    # copies later than planned only where the queue would otherwise sit idle: it must
    # end before the next copy's planned start. Here a2 and a3 share an op (nothing is
    # queued after them); a1 and a2 may not, which would delay a3's copy by 0.5 ms.
    groups = [group(i, int(mb * MB)) for i, mb in enumerate([1.5, 1.2, 1.5, 1.0])]
    planned = plan(groups, share=1.0)
    bucketed = bucket_transfers(planned, chunk(groups), stall_tolerance=0.0)
    assert {root: p[0] for root, p in _positions(bucketed).items()} == {
        "a0": 0,
        "a1": 1,
        "a2": 3,
        "a3": 3,
    }
    planned_start = {c.root: c.offload_start for c in planned.prediction.copies}
    for copy in bucketed.prediction.copies:
        if copy.root in ("a0", "a1"):
            assert copy.offload_start == pytest.approx(planned_start[copy.root])
    assert bucketed.prediction.step_seconds == pytest.approx(planned.prediction.step_seconds)
    assert bucketed.prediction.peak_bytes == planned.prediction.peak_bytes


def test_a_storage_held_longer_must_leave_the_peak_where_it_is():
    # Only the moved storages are ever on the device, two at most at once: holding a0
    # until a1's wait would put three there, and so for each pair up to a5's wait. a6
    # held until a7's wait is not: by then a0 to a4 are back on the host.
    groups = [group(i, MB // 10) for i in range(8)]
    planned = plan(groups, share=1.0)
    costs = chunk(groups)
    runs = _forward_runs(planned, costs, MemoryTimeline(costs, planned.transfers))
    assert [[t.root for t in run] for run in runs] == [
        ["a0"],
        ["a1"],
        ["a2"],
        ["a3"],
        ["a4"],
        ["a5"],
        ["a6", "a7"],
    ]
    bucketed = bucket_transfers(planned, costs, stall_tolerance=0.0)
    assert bucketed.prediction.peak_bytes == planned.prediction.peak_bytes


def test_a_compiled_stack_moves_in_buckets_with_gradients_unchanged():
    torch.manual_seed(0)
    model = models.BlockStack(dim=64, heads=4, depth=2)
    x = torch.randn(4, 64, 64)
    loss, grads, x_grad = train_step(torch.compile(model, backend="aot_eager"), x)
    backend = offload_pass.backend(fraction=1.0, min_bytes=0, profile="h200", compiler="eager")
    offloaded = train_step(torch.compile(model, backend=backend), x)
    assert torch.equal(offloaded[0], loss) and torch.equal(offloaded[2], x_grad)
    assert grads.keys() == offloaded[1].keys()
    for name, grad in grads.items():
        assert torch.equal(offloaded[1][name], grad), name

    (plan,) = backend.plans
    for graph, op in ((plan.forward.graph, ops.OFFLOAD), (plan.backward.graph, ops.RELOAD)):
        sizes = [len(n.args[0]) for n in graph.find_nodes(op="call_function", target=op)]
        assert sum(sizes) == len(plan.moved)
        assert max(sizes) > 1, f"every {op} moves one storage"


def test_where_copies_cannot_overlap_compute_reloads_share_an_op_as_far_as_memory_allows():
    # The first test's chunk on a device whose copies run on the compute thread (a CPU):
    # a reload costs the step the same wherever it is issued, so all eight storages come
    # back in one op before the first need of them, under the 8 MB activation's peak.
    # Where only moved storages are on the device, holding them earlier would raise it.
    cpu_like = dataclasses.replace(PROFILE, copies_overlap_compute=False)
    small = [group(i, MB // 10) for i in range(8)]
    stays = group(9, 8 * MB)
    costs = chunk([*small, stays], cpu_like)
    shares = {g.root: ("", 1.0) for g in small} | {stays.root: ("", 0.0)}
    planned = plan_offloads([*small, stays], costs, Request(shares, 0, 0.0, None))
    bucketed = bucket_transfers(planned, costs, stall_tolerance=0.0)
    assert {_positions(bucketed)[g.root][2:] for g in small} == {(2, 3)}
    assert bucketed.prediction.step_seconds == pytest.approx(planned.prediction.step_seconds)
    assert bucketed.prediction.peak_bytes == planned.prediction.peak_bytes

    alone = plan(small, share=1.0, profile=cpu_like)
    tight = bucket_transfers(alone, chunk(small, cpu_like), stall_tolerance=0.0)
    assert len({_positions(tight)[g.root][2] for g in small}) == 7, "a6 and a7 alone share"
    assert tight.prediction.peak_bytes == alone.prediction.peak_bytes


def test_released_copies_share_an_op_where_the_queue_allows():
    # With a second forward to end under, a7, a8 and a9 are released at forward's end.
    # a8's copy was to start at 10 ms, when a9 is made: issued with a9's, it starts no
    # later. a7's, issued there too, would start 2 ms late and delay the others.
    groups = [group(7, 2 * MB), group(8, 2 * MB), group(9, MB)]
    planned = plan(groups, share=1.0, in_flight=2)
    assert all(t.released for t in planned.transfers)
    bucketed = bucket_transfers(planned, chunk(groups), 0.0, 2)
    offload_at = {t.root: t.offload_at for t in bucketed.transfers}
    assert offload_at == {"a7": 7, "a8": 9, "a9": 9}
    assert all(t.released for t in bucketed.transfers)
