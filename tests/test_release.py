"""Copies released at forward's end, where other forwards of the chunk follow before its
backward (``in_flight_microbatches`` above 1): the rewritten graphs and the gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import offload_pass
from offload_pass import ops
from tests import models
from tests.conftest import assert_same_step, compiled_pair, train_step

QUICK_COPIES = models.H200_QUICK_COPIES


def _block() -> torch.nn.Module:
    return models.BlockStack(dim=256, heads=4, depth=1)


def _x() -> torch.Tensor:
    return torch.randn(2, 512, 256)


def _released(plan: offload_pass.Plan) -> list[str]:
    return [t.root for t in plan.planned.transfers if t.released]


def test_a_copy_ending_after_forward_is_released_only_where_a_forward_follows():
    alone = offload_pass.explain(_block(), _x(), profile=QUICK_COPIES, fraction=1.0).plans[0]
    torch._dynamo.reset()
    followed = offload_pass.explain(
        _block(), _x(), profile=QUICK_COPIES, fraction=1.0, in_flight_microbatches=2
    ).plans[0]
    assert _released(alone) == []
    assert len(_released(followed)) == 1
    assert followed.prediction.forward_seconds < alone.prediction.forward_seconds, (
        "forward no longer waits for the last copy"
    )
    (copy,) = [c for c in followed.prediction.copies if c.root in _released(followed)]
    assert copy.offload_end > followed.prediction.forward_seconds
    (row,) = [r for r in offload_pass.report.plan_rows(followed) if r.name == copy.root]
    assert row.reason == "moved (<root>: fraction 1; released at forward's end)"


def _after_last_compute(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """Whether only transfer ops and the items of their lists follow ``node`` to the
    output: it comes after all of forward's compute."""
    rest = list(graph.nodes)[list(graph.nodes).index(node) + 1 : -1]
    return all(n.target in ops.TRANSFERS or n.args[0].target in ops.TRANSFERS for n in rest)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_released_copies_leave_gradients_as_without_offloading(compiler):
    model, reference, backend = compiled_pair(
        _block, compiler, fraction=1.0, profile=QUICK_COPIES, in_flight_microbatches=2
    )
    x = _x()
    assert_same_step(train_step(model, x), train_step(reference, x))
    (plan,) = backend.plans
    graph = plan.forward.graph
    (release,) = graph.find_nodes(op="call_function", target=ops.OFFLOAD_RELEASE)
    assert _after_last_compute(graph, release)
    released = set(_released(plan))
    assert {a.name for a in release.args[1]} == released
    waited = graph.find_nodes(op="call_function", target=ops.OFFLOAD_WAIT)
    assert waited and all(released.isdisjoint(a.name for a in w.args[1]) for w in waited)
    assert offload_pass.counts().pending_offloads == 0


def test_inductor_releases_after_forward_compute():
    model, _, backend = compiled_pair(
        _block, "inductor", fraction=1.0, profile=QUICK_COPIES, in_flight_microbatches=2
    )
    _, (forward_code, _) = run_and_get_code(lambda: train_step(model, _x()))
    after = forward_code.split("offload_pass.offload_release.default(", 1)[1]
    kernels = ("cpp_fused_", "extern_kernels.", ".run(")
    assert all(kernel not in after for kernel in kernels), "no kernel after the release"
    assert all(kernel in forward_code for kernel in kernels[:2])
    assert "offload_pass.offload_wait.default(" in forward_code
    marked = offload_pass.report.format_graphs(backend.plans[0])
    assert "compute does not wait; the device tensor is freed once its copy" in marked


def _blocks_compiled_each(compile_blocks) -> offload_pass.Plan:
    """The plan of four blocks sharing one chunk, compiled by ``compile_blocks(model)``."""
    torch.manual_seed(0)
    model = models.BlockStack(dim=256, heads=4, depth=4)
    reference = copy.deepcopy(model)
    backend = compile_blocks(model)
    offload_pass.compile_regions(reference, "aot_eager")
    x = _x()
    assert_same_step(train_step(model, x), train_step(reference, x))
    (plan,) = backend.plans
    return plan


def _options(**more) -> dict:
    return dict(fraction=1.0, profile=QUICK_COPIES, compiler="eager", **more)


def test_compile_regions_plans_the_blocks_for_one_forward_each():
    """Four blocks share one chunk: compile_regions tells the backend, whose plans keep
    it, and the blocks train as without offloading."""

    def by_regions(model):
        backend = offload_pass.backend(**_options())
        offload_pass.compile_regions(model, backend)
        return backend

    def by_hand(in_flight: int):
        def compile_blocks(model):
            backend = offload_pass.backend(**_options(in_flight_microbatches=in_flight))
            for block in model.blocks:
                block.compile(backend=backend)
            return backend

        return compile_blocks

    regions, told, untold = map(_blocks_compiled_each, (by_regions, by_hand(4), by_hand(1)))
    assert _released(regions), "a copy ending after its block's forward ends under the next"
    assert regions.prediction.peak_bytes == told.prediction.peak_bytes
    assert regions.prediction.baseline_peak_bytes == told.prediction.baseline_peak_bytes
    assert regions.prediction.baseline_peak_bytes > untold.prediction.baseline_peak_bytes
    assert not _released(untold)


def test_a_backend_holds_a_positive_whole_number_of_forwards():
    backend = offload_pass.backend()
    with pytest.raises(ValueError, match="count must be an int >= 1, got 0"):
        backend.with_forwards_in_flight(0)
    with pytest.raises(ValueError, match="count must be an int >= 1, got True"):
        backend.with_forwards_in_flight(True)
    piped = offload_pass.backend(in_flight_microbatches=2)
    assert piped.with_forwards_in_flight(3).options.in_flight_microbatches == 6
    assert piped.with_forwards_in_flight(3) is piped.with_forwards_in_flight(3), (
        "one per count, so that Dynamo's code compiled for it is shared"
    )
