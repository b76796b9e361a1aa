"""The planner on synthetic chunks whose best plan is worked out by hand.

The chunk: forward runs ten 1 ms nodes then its output; backward has one input, ten 1 ms
nodes, then its output. Activation ``a<i>`` is produced by forward node ``i``, used by
node ``i + 1``, and first read by backward node ``10 - i`` (backward mirrors forward).
Copies run at 1 GB/s, so 4 MB takes 4 ms.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from offload_pass.analysis import SavedGroup
from offload_pass.costs import ChunkCosts, ReuseHold
from offload_pass.planner import (
    BUDGET_MET,
    FRACTION_REACHED,
    MOVED,
    OVERLAP_DEPTH,
    PEAK_NOT_LOWERED,
    SLOWS_THE_STEP,
    WOULD_NOT_HIDE,
    ChunkPlan,
    Request,
    plan_offloads,
)
from offload_pass.profiles import DeviceProfile
from offload_pass.simulate import MemoryTimeline, Transfer, peak_bytes, simulate

MS = 1e-3
MB = 10**6
NODES = 10
PROFILE = DeviceProfile("test", 1e15, 1e15, 1e15, 1e9, 1e9, 2e9)


def group(i: int, nbytes: int, module: str = "blocks.0") -> SavedGroup:
    return SavedGroup(
        root=f"a{i}",
        members=(f"a{i}",),
        module_stack=((module, None),),
        op="aten.mm.default",
        shape=(nbytes,),
        dtype=torch.uint8,
        nbytes=nbytes,
        produced_at=i,
        last_forward_use=i + 1,
        forward_readers=(f"n{i + 1}",),
        first_backward_use=NODES - i,
        fixed_reason=None,
    )


def chunk(
    groups: list[SavedGroup], profile: DeviceProfile = PROFILE, backward_node: float = MS
) -> ChunkCosts:
    forward = (MS,) * NODES + (0.0,)
    backward = (0.0,) + (backward_node,) * NODES + (0.0,)
    allocated = [0] * (len(forward) + len(backward))
    freed = list(allocated)
    for g in groups:
        allocated[g.produced_at] += g.nbytes
        freed[len(forward) + g.first_backward_use] += g.nbytes
    return ChunkCosts(
        profile=profile,
        forward_seconds=forward,
        backward_seconds=backward,
        forward_launches=tuple(int(s > 0) for s in forward),
        backward_launches=tuple(int(s > 0) for s in backward),
        resident_bytes=0,
        allocated=tuple(allocated),
        freed=tuple(freed),
        backward_inputs=1,
    )


def plan(
    groups: list[SavedGroup],
    share: float | None = None,
    budget: int | float | None = None,
    tolerance: float = 0.0,
    profile: DeviceProfile = PROFILE,
    in_flight: int = 1,
) -> ChunkPlan:
    request = Request({g.root: ("", share) for g in groups}, 0, tolerance, budget, in_flight)
    return plan_offloads(groups, chunk(groups, profile), request)


def moved(result: ChunkPlan) -> list[str]:
    return [d.group.root for d in result.decisions if d.moved]


def reasons(result: ChunkPlan) -> dict[str, str]:
    return {d.group.root: d.reason for d in result.decisions}


THREE = [group(0, 4 * MB), group(1, 4 * MB), group(8, 4 * MB)]


def test_auto_moves_what_hides_and_keeps_the_last_activation_of_forward():
    # a0 copies over 1..5 ms and a1 over 5..9 ms, inside forward's 10 ms; a8 would copy
    # over 9..13 ms, past the end of forward. Backward brings a1 back over 0..4 ms and a0
    # over 4..8 ms, both before first use.
    result = plan(THREE)
    assert reasons(result) == {"a0": MOVED, "a1": MOVED, "a8": WOULD_NOT_HIDE}
    assert result.prediction.stall_seconds == 0
    assert result.prediction.step_seconds == pytest.approx(20 * MS)
    assert result.prediction.baseline_peak_bytes == 12 * MB
    assert result.prediction.peak_bytes == 8 * MB


def test_auto_never_moves_what_forward_would_wait_for():
    # a8's copy would end 3 ms after forward: held at forward's end, it saves nothing.
    assert "a8" not in moved(plan(THREE, tolerance=1.0))


def _auto(groups: list[SavedGroup], tolerance: float, costs: ChunkCosts):
    request = Request({g.root: ("", None) for g in groups}, 0, tolerance, None)
    return plan_offloads(groups, costs, request)


def test_auto_takes_a_backward_stall_within_its_tolerance():
    # Backward nodes of 0.5 ms: a0 is needed at 4.5 ms and a1 at 4 ms; reloading both
    # (4 ms each) from backward's start makes compute wait 3.5 ms, 23% of the 15 ms step.
    # Forward ends with a 10 MB temporary: the peak is 18 MB with nothing moved, 14 MB
    # with one of them moved, 10 MB with both.
    groups = THREE[:2]
    costs = chunk(groups, backward_node=MS / 2)
    allocated, freed = list(costs.allocated), list(costs.freed)
    allocated[NODES] += 10 * MB
    freed[NODES] += 10 * MB
    costs = dataclasses.replace(costs, allocated=tuple(allocated), freed=tuple(freed))

    within = _auto(groups, 0.2, costs)
    assert moved(within) == ["a0"]
    assert within.prediction.peak_bytes == 14 * MB
    beyond = _auto(groups, 0.25, costs)
    assert moved(beyond) == ["a0", "a1"]
    assert beyond.prediction.stall_seconds == pytest.approx(3.5 * MS)
    assert beyond.prediction.peak_bytes == 10 * MB


def test_auto_takes_no_stall_that_lowers_no_peak():
    # As above without the temporary: the peak is 8 MB whether one or both move (a1 is
    # alive while a0 comes back), so the tolerance buys nothing and nothing stalls.
    groups = THREE[:2]
    result = _auto(groups, 0.25, chunk(groups, backward_node=MS / 2))
    assert len(moved(result)) == 1
    assert result.prediction.stall_seconds == 0
    assert result.prediction.peak_bytes == 8 * MB


def test_simulation_of_a_plan_that_stalls_matches_the_hand_computed_timeline():
    # fraction 1: a8's offload runs 9..13 ms, so forward waits 3 ms; backward starts at
    # 13 ms, reloads a8 over 13..17 ms and needs it at 14 ms: 3 ms more.
    result = plan(THREE, share=1.0)
    p = result.prediction
    assert p.forward_seconds == pytest.approx(13 * MS)
    assert p.stall_seconds == pytest.approx(6 * MS)
    assert p.step_seconds == pytest.approx(26 * MS)
    copies = {c.root: c for c in p.copies}
    assert (copies["a8"].offload_start, copies["a8"].offload_end) == pytest.approx(
        (9 * MS, 13 * MS)
    )
    assert (copies["a8"].reload_start, copies["a8"].reload_end) == pytest.approx((13 * MS, 17 * MS))
    assert copies["a8"].stall == pytest.approx(6 * MS)
    assert copies["a8"].hidden_share == pytest.approx(0.25)
    assert copies["a0"].hidden_share == 1.0


HOST_BOUND = dataclasses.replace(
    PROFILE, kernel_launch_seconds=2 * MS, offload_host_seconds=3 * MS, reload_host_seconds=3 * MS
)
"""The host takes 2 ms to issue each kernel of 1 ms: the step is the host's."""


def test_the_device_waits_for_the_host_to_issue_its_kernels():
    # 20 kernels, issued 2 ms apart; the last starts at 40 ms and runs 1 ms.
    prediction = simulate(chunk([], HOST_BOUND), ())
    assert prediction.step_seconds == pytest.approx(41 * MS)
    assert prediction.host_wait_seconds == pytest.approx(21 * MS)
    assert prediction.host_seconds == pytest.approx(40 * MS)
    assert prediction.baseline_seconds == pytest.approx(41 * MS)


def test_each_transfer_lengthens_a_host_bound_step_by_its_host_time():
    result = plan([group(0, MB)], share=1.0, profile=HOST_BOUND)
    assert moved(result) == ["a0"]
    assert result.prediction.stall_seconds == 0
    assert result.prediction.step_seconds == pytest.approx((41 + 3 + 3) * MS)
    assert result.prediction.host_seconds == pytest.approx((40 + 3 + 3) * MS)


def test_auto_moves_nothing_whose_host_time_slows_the_step_beyond_its_tolerance():
    # moving a0 costs 6 ms of a 41 ms step: 15%
    assert reasons(plan([group(0, MB)], tolerance=0.1, profile=HOST_BOUND)) == {
        "a0": SLOWS_THE_STEP
    }
    assert moved(plan([group(0, MB)], tolerance=0.2, profile=HOST_BOUND)) == ["a0"]


def test_auto_keeps_the_largest_storages_when_the_host_limits_how_many_move():
    # each storage moved costs 6 ms; a tolerance of 0.3 (12.3 ms) pays for two of three
    groups = [group(0, MB), group(1, 2 * MB), group(2, MB // 2)]
    result = plan(groups, tolerance=0.3, profile=HOST_BOUND)
    assert reasons(result) == {"a0": MOVED, "a1": MOVED, "a2": SLOWS_THE_STEP}
    assert result.prediction.step_seconds <= 1.3 * result.prediction.baseline_seconds


def test_storages_moved_by_one_op_cost_the_host_less_than_ops_of_their_own():
    # a0 and a1 both offload after node 1 and wait there, and reload before node 10 for
    # node 12: one op each way, 3 ms for the first storage and 1 ms for the second
    bucketed = dataclasses.replace(
        HOST_BOUND, bucketed_offload_host_seconds=1 * MS, bucketed_reload_host_seconds=1 * MS
    )
    costs = chunk([group(0, MB), group(1, MB)], bucketed)
    joined = [Transfer(f"a{i}", MB, 1, 1, 10, 12) for i in (0, 1)]
    apart = [Transfer("a0", MB, 1, 1, 10, 12), Transfer("a1", MB, 1, 2, 10, 13)]
    assert simulate(costs, joined).step_seconds == pytest.approx((41 + 4 + 4) * MS)
    assert simulate(costs, apart).step_seconds == pytest.approx((41 + 6 + 6) * MS)
    # a1 released: the rewrite gives it an offload of its own (reloads stay joined)
    mixed = [joined[0], dataclasses.replace(joined[1], released=True)]
    assert simulate(costs, mixed).step_seconds == pytest.approx((41 + 6 + 4) * MS)


def test_host_time_hidden_behind_the_device_costs_nothing():
    # kernels of 1 ms issued in 0.1 ms each: the host runs ahead and its transfer ops
    # (0.2 ms each) hide behind the device, as in the first test without host costs
    ahead = dataclasses.replace(
        PROFILE,
        kernel_launch_seconds=0.1 * MS,
        offload_host_seconds=0.2 * MS,
        reload_host_seconds=0.2 * MS,
    )
    result = plan(THREE, profile=ahead)
    assert moved(result) == ["a0", "a1"]
    assert result.prediction.step_seconds == pytest.approx(result.prediction.baseline_seconds)
    assert result.prediction.baseline_seconds == pytest.approx(20.1 * MS)


@pytest.mark.parametrize("in_flight", [1, 2])
def test_the_peak_without_one_transfer_is_that_of_the_others(in_flight):
    groups = [group(0, 4 * MB), group(1, 3 * MB), group(4, 2 * MB), group(8, MB)]
    result = plan(groups, share=1.0, in_flight=in_flight)
    assert any(t.released for t in result.transfers) == (in_flight > 1)
    costs = chunk(groups)
    memory = MemoryTimeline(costs, result.transfers, in_flight)
    assert memory.peak == result.prediction.peak_bytes
    kept = []
    for t in result.transfers[::-1]:
        kept.append(t)
        others = [u for u in result.transfers if u not in kept]
        assert memory.peak_without(t) == peak_bytes(costs, others, in_flight)
        memory.keep(t)
        assert memory.peak == peak_bytes(costs, others, in_flight)


def test_holds_fit_only_where_their_sum_stays_under_the_top():
    """Overlapping holds count together: each fits alone, both do not, and a refused set
    changes nothing."""
    groups = [group(0, 4 * MB), group(1, 3 * MB), group(4, 2 * MB), group(8, MB)]
    costs = chunk(groups)
    memory = MemoryTimeline(costs, plan(groups, share=1.0).transfers)
    live = memory.live.to_list()
    low = min(range(len(live)), key=live.__getitem__)
    room = memory.pass_top(low) - live[low]
    assert room > 1
    both = [(low, low + 1, room // 2 + 1), (low, low + 1, room // 2 + 1)]
    assert not memory.hold_if_fits(both)
    assert memory.live.to_list() == live
    assert memory.hold_if_fits(both[:1]) and memory.hold_if_fits([(low, low + 1, room // 2 - 1)])
    after = memory.live.to_list()
    assert after[low] == live[low] + 2 * (room // 2)
    assert after[:low] + after[low + 1 :] == live[:low] + live[low + 1 :]
    assert memory.top == max(live)


def _with_backward_transient() -> tuple[ChunkCosts, int]:
    """Four storages' chunk whose backward's first node holds 5 MB more while it runs,
    so backward's top (the step's) is above forward's; and that node's position."""
    groups = [group(0, 4 * MB), group(1, 3 * MB), group(4, 2 * MB), group(8, MB)]
    costs = chunk(groups)
    transient = costs.num_forward + 1
    allocated, freed = list(costs.allocated), list(costs.freed)
    allocated[transient] += 5 * MB
    freed[transient] += 5 * MB
    return dataclasses.replace(costs, allocated=tuple(allocated), freed=tuple(freed)), transient


def test_a_hold_in_forward_fits_under_forward_top_not_the_step_top():
    """A forward hold that would raise forward's top is refused even where it stays
    under backward's (the step's), and a backward hold up to backward's top fits."""
    costs, transient = _with_backward_transient()
    memory = MemoryTimeline(costs, ())
    live = memory.live.to_list()
    forward_top, backward_top = memory.pass_top(0), memory.pass_top(transient)
    assert forward_top == max(live[: costs.num_forward]) < backward_top == memory.top
    low = min(range(costs.num_forward), key=live.__getitem__)
    over_forward = forward_top - live[low] + 1
    assert live[low] + over_forward <= backward_top
    assert not memory.hold_if_fits([(low, low + 1, over_forward)])
    assert memory.hold_if_fits([(low, low + 1, over_forward - 1)])
    backward_low = len(live) - 1
    room = backward_top - live[backward_low]
    assert room > forward_top - live[backward_low]
    assert memory.hold_if_fits([(backward_low, backward_low + 1, room)])
    assert memory.top == max(live)


def test_a_hold_across_both_passes_counts_against_each_pass_top():
    """A hold from forward's end into backward is refused where its forward part would
    raise forward's top, though the step's top (backward's) has room for all of it; its
    backward part alone fits."""
    costs, _ = _with_backward_transient()
    memory = MemoryTimeline(costs, ())
    live = memory.live.to_list()
    edge = costs.num_forward
    assert all(v + MB <= memory.top for v in live[edge - 2 : edge + 1])
    assert max(live[edge - 2 : edge]) + MB > memory.pass_top(0)
    assert not memory.hold_if_fits([(edge - 2, edge + 1, MB)])
    assert memory.live.to_list() == live
    assert memory.hold_if_fits([(edge, edge + 1, MB)])


def test_fraction_prefers_the_candidates_whose_copies_hide_best():
    result = plan(THREE, share=1 / 3)
    assert reasons(result) == {"a0": MOVED, "a1": FRACTION_REACHED, "a8": FRACTION_REACHED}


@pytest.mark.parametrize("tolerance", [0.0, 0.1])
def test_bytes_moved_grow_with_fraction(tolerance):
    groups = [group(i, (i % 3 + 1) * MB) for i in range(9)]
    total = sum(g.nbytes for g in groups)
    fractions = [0.0, 0.25, 0.5, 0.75, 1.0]
    moved_bytes = []
    for f in fractions:
        result = plan(groups, share=f, tolerance=tolerance)
        moved_bytes.append(sum(d.group.nbytes for d in result.decisions if d.moved))
    assert moved_bytes == sorted(moved_bytes)
    assert all(b <= f * total for b, f in zip(moved_bytes, fractions, strict=True))
    assert moved_bytes[0] == 0 and moved_bytes[-1] == total


A0_MOVED = Transfer("a0", 4 * MB, 0, 5, 9, 10)


def _pooled(transients: dict[int, int]) -> ChunkCosts:
    """``a0``'s chunk with a 5 MB buffer freed after node 2 that Inductor's pool keeps
    for another of its size made at 8, and ``transients`` (bytes made and freed at a
    node)."""
    costs = chunk(THREE[:1])
    allocated, freed = list(costs.allocated), list(costs.freed)
    for at, nbytes in {2: 5 * MB, 8: 5 * MB, **transients}.items():
        allocated[at] += nbytes
        freed[at] += nbytes
    return dataclasses.replace(
        costs,
        allocated=tuple(allocated),
        freed=tuple(freed),
        reuse_holds=(ReuseHold(2, 8, 5 * MB),),
    )


def test_a_buffer_pooled_for_reuse_is_held_only_where_nothing_moves():
    """Inductor's buffer reuse keeps a freed buffer until a later one of its size takes
    it; it is off in graphs that hold transfers (``_compat.TRANSFER_GRAPH_SETTINGS``)."""
    costs = _pooled({})
    assert MemoryTimeline(costs, ()).live.max(6, 7) == 4 * MB + 5 * MB  # a0, the pool
    assert MemoryTimeline(costs, (A0_MOVED,)).live.max(6, 7) == 0


def test_with_the_last_transfer_kept_the_pool_is_held_again():
    """Keeping the last transfer on the device switches Inductor's buffer reuse back on:
    the peak without it is the step's with nothing moved and the pool held, here above
    what the same timeline without the pool tops at."""
    costs = _pooled({6: 3 * MB})
    unmoved = peak_bytes(costs, ())
    assert unmoved == 4 * MB + 5 * MB + 3 * MB  # a0, the pool and the transient at 6
    assert unmoved > peak_bytes(dataclasses.replace(costs, reuse_holds=()), ())
    memory = MemoryTimeline(costs, (A0_MOVED,))
    assert memory.peak_without(A0_MOVED) == unmoved
    memory.keep(A0_MOVED)
    assert memory.peak == unmoved


def test_budget_moves_the_fewest_that_meet_it():
    # Moving a0 alone already lowers the peak from 12 MB to 8 MB.
    result = plan(THREE, budget=9 * MB)
    assert reasons(result) == {"a0": MOVED, "a1": BUDGET_MET, "a8": BUDGET_MET}
    assert result.prediction.peak_bytes <= 9 * MB
    assert result.budget_shortfall == 0


def test_budget_as_a_share_of_the_peak_without_offloading():
    result = plan(THREE, budget=0.75)
    assert result.budget_bytes == 9 * MB
    assert moved(result) == ["a0"]


def test_a_budget_that_cannot_be_met_moves_the_fewest_reaching_the_lowest_peak():
    # a1 and a8 are both live while forward's last node runs, whatever moves: moving a0
    # lowers the peak to 8 MB, and moving them too would only slow the step.
    result = plan(THREE, budget=5 * MB)
    assert reasons(result) == {"a0": MOVED, "a1": PEAK_NOT_LOWERED, "a8": PEAK_NOT_LOWERED}
    assert result.prediction.peak_bytes == 8 * MB
    assert result.budget_shortfall == 3 * MB
    assert plan(THREE, share=1.0).prediction.peak_bytes == 8 * MB


def test_a_budget_out_of_reach_is_met_with_fewer_copies_in_flight():
    # Moving all of NINE, copies OVERLAP_DEPTH (3) ahead of compute, peaks at 8 MB.
    assert plan(NINE, share=1.0).prediction.peak_bytes == 8 * MB
    result = plan(NINE, budget=7 * MB)
    assert result.overlap_depth < OVERLAP_DEPTH
    assert result.prediction.peak_bytes <= 11 * MB
    assert result.budget_shortfall == 0


def test_a_budget_takes_the_depth_whose_plan_is_fastest():
    # 13 MB: three copies ahead it takes a0..a5 (26 ms), two ahead a0..a4 (24 ms), one
    # ahead a0..a4 (28 ms). Compute waiting for the queue earlier lets fewer moves do.
    result = plan(NINE, budget=13 * MB)
    assert (result.overlap_depth, moved(result)) == (2, ["a0", "a1", "a2", "a3", "a4"])
    assert result.prediction.step_seconds == pytest.approx(24 * MS)
    assert result.prediction.peak_bytes <= 13 * MB


def test_placement_keeps_the_contract():
    groups = [group(i, (i % 3 + 1) * MB) for i in range(9)]
    result = plan(groups, share=1.0)
    by_need = sorted(result.transfers, key=lambda t: t.need_at)
    for t in result.transfers:
        g = next(g for g in groups if g.root == t.root)
        assert t.offload_at == g.produced_at
        assert g.last_forward_use <= t.wait_at <= NODES - 1, "wait after last use, before output"
        assert 1 <= t.reload_at <= t.need_at == g.first_backward_use
    assert [t.reload_at for t in by_need] == sorted(t.reload_at for t in by_need)


def test_waits_sit_where_copies_are_predicted_done():
    # With the margin a0's copy ends at 5.2 ms, in node 5; a1's at 9.4 ms, in node 9.
    result = plan(THREE)
    assert {t.root: t.wait_at for t in result.transfers} == {"a0": 5, "a1": 9}
    copies = {c.root: c for c in result.prediction.copies}
    assert copies["a0"].offload_end == pytest.approx(5 * MS)
    assert copies["a1"].offload_end == pytest.approx(9 * MS)


def test_reloads_are_issued_as_late_as_they_can_still_hide():
    result = plan(THREE)
    reload_at = {t.root: t.reload_at for t in result.transfers}
    # a0 is needed at 9 ms and takes 5 ms with the reload margin: issued before node 5
    # (4 ms).
    assert reload_at["a0"] == 5
    assert reload_at["a1"] == 1


NINE = [group(i, 2 * MB) for i in range(9)]


def test_copies_that_cannot_finish_in_forward_are_waited_for_a_few_copies_later():
    # 18 ms of copies in a 10 ms forward: the queue falls behind compute. Forward waits
    # for each copy where the copy OVERLAP_DEPTH later is produced, if it is not done
    # before (a0's ends at 3 ms with the margin), so it holds no more than four in flight
    # (a1's copy would end in node 5, a3's in node 9, a4's after forward).
    assert OVERLAP_DEPTH == 3
    wait_at = {t.root: t.wait_at for t in plan(NINE, share=1.0).transfers}
    assert wait_at == {"a0": 3, "a1": 4, "a2": 5, "a3": 6, "a4": 7, "a5": 8} | dict.fromkeys(
        ("a6", "a7", "a8"), 9
    )


def test_reloads_that_cannot_arrive_in_time_are_issued_a_few_needs_ahead():
    # Backward needs a8 at its node 2, a7 at 3, ..., a0 at 10, but 18 ms of reloads take
    # longer than backward: all are late. Each is issued where the reload OVERLAP_DEPTH
    # earlier is needed, so no more than OVERLAP_DEPTH + 1 are on the device at once.
    result = plan(NINE, share=1.0)
    by_need = sorted(result.transfers, key=lambda t: t.need_at)
    assert [t.reload_at for t in by_need] == [1, 1, 1, 2, 3, 4, 5, 6, 7]
    for node in range(1, NODES + 1):
        on_device = [t for t in by_need if t.reload_at <= node <= t.need_at]
        assert len(on_device) <= OVERLAP_DEPTH + 1
    assert result.prediction.peak_bytes < result.prediction.baseline_peak_bytes


def test_reloads_with_time_to_spare_after_the_late_ones_stay_as_late_as_they_can():
    # a8, a7, a6 and a5 (2 ms each) are needed at backward nodes 2 to 5, 1 to 4 ms in:
    # all late. a5 is issued where a8 is needed. a0 (1 ms, needed at 9 ms) has time to
    # spare after them: issued at node 8 (7 ms), as without the late ones.
    groups = [group(0, MB), *(group(i, 2 * MB) for i in (5, 6, 7, 8))]
    reload_at = {t.root: t.reload_at for t in plan(groups, share=1.0).transfers}
    assert reload_at == {"a8": 1, "a7": 1, "a6": 1, "a5": 2, "a0": 8}


def test_copies_that_cannot_overlap_compute_are_not_moved_by_auto():
    cpu_like = dataclasses.replace(PROFILE, copies_overlap_compute=False)
    result = plan(THREE, profile=cpu_like)
    assert set(reasons(result).values()) == {WOULD_NOT_HIDE}


def test_planning_is_deterministic():
    groups = [group(i, (i % 3 + 1) * MB) for i in range(9)]
    for kwargs in ({}, {"share": 0.5}, {"budget": 0.6}):
        assert plan(groups, **kwargs) == plan(groups, **kwargs)


def test_fraction_owners_and_auto_share_one_queue():
    # a0's module has share 1; the rest are auto. a8 cannot hide after a0 and a1.
    groups = THREE
    request = Request({"a0": ("blocks.0", 1.0), "a1": ("", None), "a8": ("", None)}, 0, 0.0, None)
    result = plan_offloads(groups, chunk(groups), request)
    assert reasons(result) == {"a0": MOVED, "a1": MOVED, "a8": WOULD_NOT_HIDE}
    assert result.decisions[0].share == 1.0 and result.decisions[1].share is None


def test_a_pipeline_stage_holds_what_each_microbatch_keeps_for_backward():
    # Two microbatches in flight: the other one holds its 12 MB of activations at the
    # boundary; after auto moves a0 and a1 it holds only a8's 4 MB.
    result = plan(THREE, in_flight=2)
    assert result.prediction.baseline_peak_bytes == 24 * MB
    assert result.prediction.peak_bytes == 8 * MB + 4 * MB


def test_a_budget_counts_the_microbatches_in_flight():
    # 18 MB is 0.75 of 24 MB; moving a0 leaves 8 MB per microbatch at the boundary.
    result = plan(THREE, budget=18 * MB, in_flight=2)
    assert moved(result) == ["a0"]
    assert result.prediction.peak_bytes == 8 * MB + 8 * MB


LATE = dataclasses.replace(group(8, 2 * MB), first_backward_use=NODES - 1)
"""Made by forward's node 8, read by backward's node 9: its copy, 9 to 11 ms, would end
after forward, and its reload hides under backward."""


def test_a_copy_ends_under_the_next_forward_where_one_follows():
    # Alone, a8 would be waited for at forward's end and save nothing. With a second
    # forward of the chunk before backward, it is released at forward's end: compute does
    # not wait, and the other forward's a8 is freed once its copy has read it.
    groups = [group(0, 4 * MB), LATE]
    assert reasons(plan(groups)) == {"a0": MOVED, "a8": WOULD_NOT_HIDE}
    result = plan(groups, in_flight=2)
    assert reasons(result) == {"a0": MOVED, "a8": MOVED}
    placed = {t.root: t for t in result.transfers}
    assert not placed["a0"].released and placed["a0"].wait_at == 5
    assert placed["a8"].released and placed["a8"].wait_at == NODES - 1, "at forward's end"
    copies = {c.root: c for c in result.prediction.copies}
    assert copies["a8"].offload_end == pytest.approx(11 * MS)
    assert result.prediction.stall_seconds == 0
    assert result.prediction.step_seconds == pytest.approx(20 * MS)
    # Each forward holds a0 and a8 (6 MB) at its end with nothing moved. This one's own
    # top is 6 MB (a8 held, as if no forward followed it; a0 reloaded beside it); the
    # other forward holds nothing once its copies are read.
    assert result.prediction.baseline_peak_bytes == 12 * MB
    assert result.prediction.peak_bytes == 6 * MB
    assert peak_bytes(chunk(groups), [placed["a0"]], 2) == 8 * MB, "a8 kept"
    waited = [dataclasses.replace(t, released=False) for t in result.transfers]
    assert simulate(chunk(groups), waited, 2).forward_seconds == pytest.approx(11 * MS)


def test_no_copy_is_released_where_the_queue_cannot_keep_pace_with_the_forwards():
    # 18 ms of copies for each 10 ms forward: each forward's copies would end ever later.
    alone, followed = plan(NINE, share=1.0), plan(NINE, share=1.0, in_flight=2)
    assert not any(t.released for t in followed.transfers)
    assert followed.transfers == alone.transfers


def test_copies_cannot_be_released_where_they_cannot_overlap_compute():
    cpu_like = dataclasses.replace(PROFILE, copies_overlap_compute=False)
    result = plan([group(0, 4 * MB), LATE], share=1.0, profile=cpu_like, in_flight=2)
    assert len(result.transfers) == 2 and not any(t.released for t in result.transfers)


@pytest.mark.parametrize("released", [False, True])
def test_a_released_copy_stalls_no_forward_and_its_reload_waits_for_it(released):
    # a8's copy runs 9 to 11 ms; backward starts at 10 ms and needs it at its node 2.
    t = Transfer("a8", 2 * MB, 8, NODES - 1, 1, 2, released)
    prediction = simulate(chunk([LATE]), [t], 2)
    (copy,) = prediction.copies
    assert prediction.forward_seconds == pytest.approx((10 if released else 11) * MS)
    assert copy.reload_start == pytest.approx(copy.offload_end) == pytest.approx(11 * MS)


def test_the_forward_before_holds_its_released_storage_while_this_one_runs():
    # a9's copy runs 10 to 19 ms: through most of the next forward, whose 100 MB
    # temporary at node 5 meets the last forward's a3, a9 and its own a3 (a3 may not
    # move). Releasing a9 lowers no peak.
    a3 = dataclasses.replace(group(3, 20 * MB), fixed_reason="input or parameter")
    groups = [a3, group(9, 9 * MB)]
    costs = chunk(groups)
    allocated, freed = list(costs.allocated), list(costs.freed)
    allocated[5] += 100 * MB
    freed[5] += 100 * MB
    costs = dataclasses.replace(costs, allocated=tuple(allocated), freed=tuple(freed))
    request = Request({g.root: ("", 1.0) for g in groups}, 0, 0.0, None, 2)
    result = plan_offloads(groups, costs, request)
    assert [(t.root, t.released) for t in result.transfers] == [("a9", True)]
    assert result.prediction.peak_bytes == result.prediction.baseline_peak_bytes == 149 * MB


def test_a_forward_queues_its_copies_behind_the_released_copies_of_the_one_before():
    # a9's copy, released, ends 5 ms into the next forward; that forward's a0, made at
    # 1 ms, is copied from 5 to 9 ms, and waited for after node 9, not node 5.
    result = plan([group(0, 4 * MB), group(9, 5 * MB)], share=1.0, in_flight=2)
    placed = {t.root: t for t in result.transfers}
    assert placed["a9"].released and not placed["a0"].released
    assert placed["a0"].wait_at == 9
    copies = {c.root: c for c in result.prediction.copies}
    assert copies["a0"].offload_start == pytest.approx(5 * MS)
    assert copies["a9"].offload_end == pytest.approx(15 * MS)
    assert result.prediction.forward_seconds == pytest.approx(10 * MS), "no wait in forward"
