"""Bucket: storages the plan moves close together travel in one op each way.

Every transfer op costs the host one call through the dispatcher and into Python, and
the compiler one more node to lower, whatever it moves: a transformer block saves a dozen
storages, and moved one by one they took four ops each. One op moving several storages
copies them one after another on its stream, as that many ops issued at its point
would; what changes is when each copy starts and how long each storage is held.

- Forward: a run of storages in production order is copied by one offload after its
  last producer and waited for once, where the last of their waits was; earlier members
  stay on the device until then. A storage joins where the run's copies, issued
  together, still end before that wait (priced as the planner places waits) and before
  the queue was to start the next copy: on a queue that is never idle, a run that
  starts its copies late delays every copy after it.
- Backward: a run of storages in need order, each reloaded (as planned alone) before the
  run's first need, is reloaded by one op and waited for once, before that need. The op
  is placed as the planner places a reload, the run taken as one storage of all its
  bytes: members needed later arrive on the device earlier. Where copies cannot overlap
  compute, a reload costs the step the same wherever it is issued, so a storage joins
  the run before it wherever being reloaded with the run's first leaves backward's peak
  where it is.

A storage joins a forward run only where what it holds longer leaves forward's predicted
peak where it is (``MemoryTimeline.hold_if_fits``), and a backward run is kept only where
what its storages hold earlier leaves backward's where it is. The buckets are kept where
the simulated step is no slower than the plan's without them, or within the stall
tolerance of the step with nothing moved; else the forward's alone, else none. The
simulation prices a storage that joins another's op at the profile's bucketed host
cost, so this check sees what joining saves the host.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

from offload_pass.costs import ChunkCosts
from offload_pass.planner import OFFLOAD_MARGIN, ChunkPlan, reload_positions
from offload_pass.simulate import Hold, MemoryTimeline, Prediction, Transfer, simulate


def _runs(
    ordered: Sequence[Transfer],
    joins: Callable[[list[Transfer], Transfer], bool],
    holds: Callable[[list[Transfer], Transfer], list[Hold]],
    memory: MemoryTimeline,
) -> list[list[Transfer]]:
    """``ordered`` cut into runs: each transfer joins the run before it where ``joins``
    allows and the memory it ``holds`` longer fits under its pass's peak."""
    runs: list[list[Transfer]] = []
    for t in ordered:
        run = runs[-1] if runs else []
        if run and joins(run, t) and memory.hold_if_fits(holds(run, t)):
            run.append(t)
        else:
            runs.append([t])
    return runs


@dataclasses.dataclass
class _RunTotals:
    """What joining a forward run reads of it: its copies' earliest planned start, their
    seconds in all, its last wait and its bytes; kept as the run grows, so that each
    join costs the same however long the run."""

    count: int = 0
    first_start: float = float("inf")
    seconds: float = 0.0
    last_wait: int = -1
    nbytes: int = 0


def _forward_runs(
    planned: ChunkPlan, costs: ChunkCosts, memory: MemoryTimeline
) -> list[list[Transfer]]:
    copies = {c.root: c for c in planned.prediction.copies}
    starts = planned.prediction.forward_starts
    ends = [s + d for s, d in zip(starts, costs.forward_seconds, strict=True)]
    queue = sorted(copies.values(), key=lambda c: c.offload_start)
    next_start = {c.root: later.offload_start for c, later in itertools.pairwise(queue)}
    known: dict[str, _RunTotals] = {}

    def totals(run: list[Transfer]) -> _RunTotals:
        """The run's totals, by its first member's root, brought up to its members (a run
        only grows at its end)."""
        found = known.setdefault(run[0].root, _RunTotals())
        for m in run[found.count :]:
            found.count += 1
            found.first_start = min(found.first_start, copies[m.root].offload_start)
            found.seconds += costs.offload_seconds(m.nbytes)
            found.last_wait = max(found.last_wait, m.wait_at)
            found.nbytes += m.nbytes
        return found

    def joins(run: list[Transfer], t: Transfer) -> bool:
        """Whether the run's copies, issued together after ``t`` is made, still end
        (priced as the planner places waits) before the run's last wait, and before the
        queue was to start the copy after ``t``'s (priced as planned: the copies after
        were placed at those prices): where the queue is never idle, a run that starts
        its copies later delays every copy after it. Where copies cannot overlap
        compute, each costs the same wherever it is issued. A copy released at
        forward's end and one waited for never share an op; released copies end under
        the next forward, not before a wait, so only the queue decides theirs."""
        if t.released != run[0].released:
            return False
        if not costs.profile.copies_overlap_compute:
            return True
        run_totals = totals(run)
        start = max(ends[t.offload_at], min(run_totals.first_start, copies[t.root].offload_start))
        seconds = run_totals.seconds + costs.offload_seconds(t.nbytes)
        wait = ends[max(run_totals.last_wait, t.wait_at)]
        in_time = t.released or start + OFFLOAD_MARGIN * seconds <= wait
        queue_free = start + seconds <= next_start.get(t.root, math.inf) * (1 + 1e-9)
        return in_time and queue_free

    def holds(run: list[Transfer], t: Transfer) -> list[Hold]:
        """Every member of the run, each held to the run's last wait already, now held to
        ``t``'s wait where that is later; ``t`` held from its own wait to there."""
        run_totals = totals(run)
        was = run_totals.last_wait
        now = max(was, t.wait_at)
        return [(was + 1, now + 1, run_totals.nbytes), (t.wait_at + 1, now + 1, t.nbytes)]

    ordered = sorted(planned.transfers, key=lambda t: t.offload_at)
    return _runs(ordered, joins, holds, memory)


def _backward_runs(
    transfers: Sequence[Transfer], costs: ChunkCosts, memory: MemoryTimeline
) -> list[list[Transfer]]:
    """Runs in need order. Where copies overlap compute, of storages each reloaded (as
    planned alone) before the run's first need: it would have been on the device by then
    anyway. Where they cannot, a reload costs the step the same wherever it is issued, so
    a storage joins the run before it wherever reloading it with the run's first leaves
    backward's peak where it is (judged on a copy of ``memory``: a run is held for good only
    once placed, in ``_reloads_that_fit``)."""
    ordered = sorted(transfers, key=lambda t: (t.need_at, t.reload_at))
    if costs.profile.copies_overlap_compute:
        return _runs(ordered, _reloaded_before_first_need, lambda run, t: [], memory)
    before = memory.num_forward

    def held_from_first(run: list[Transfer], t: Transfer) -> list[Hold]:
        return [(before + run[0].reload_at, before + t.reload_at, t.nbytes)]

    return _runs(ordered, lambda run, t: True, held_from_first, copy.deepcopy(memory))


def _reloaded_before_first_need(run: list[Transfer], t: Transfer) -> bool:
    return t.reload_at <= run[0].need_at


def _reloads_placed(
    runs: Sequence[Sequence[Transfer]], planned: ChunkPlan, costs: ChunkCosts
) -> dict[str, dict[str, int]]:
    """Each run's reload placed by the planner's rule, the run taken as one storage of
    all its bytes needed at its first need; its wait before that need."""
    groups = {d.group.root: d.group for d in planned.decisions}
    as_one = {
        run[0].root: dataclasses.replace(
            groups[run[0].root],
            nbytes=sum(t.nbytes for t in run),
            first_backward_use=run[0].need_at,
        )
        for run in runs
    }
    reload_at = reload_positions(list(as_one.values()), costs, planned.overlap_depth)
    return {
        t.root: {"reload_at": reload_at[run[0].root], "need_at": run[0].need_at}
        for run in runs
        for t in run
    }


def _reloads_that_fit(
    runs: Sequence[Sequence[Transfer]],
    placed: dict[str, dict[str, int]],
    memory: MemoryTimeline,
) -> dict[str, dict[str, int]]:
    """``placed`` for each run whose storages, reloaded before their own reloads, leave
    backward's peak where it is; each storage of any other run where it was planned
    alone."""
    before = memory.num_forward
    kept = {}
    for run in runs:
        held = [
            (before + placed[t.root]["reload_at"], before + t.reload_at, t.nbytes)
            for t in run
            if placed[t.root]["reload_at"] < t.reload_at
        ]
        fits = memory.hold_if_fits(held)
        for t in run:
            alone = {"reload_at": t.reload_at, "need_at": t.need_at}
            kept[t.root] = placed[t.root] if fits else alone
    return kept


_FORWARD = {"offload_at": max, "wait_at": max}


def _together(
    runs: Sequence[Sequence[Transfer]], fields: dict[str, Callable[..., int]]
) -> dict[str, dict[str, int]]:
    """Each run's positions, one per field (the latest of its members'), by root."""
    placed = {}
    for run in runs:
        together = {f: pick(getattr(t, f) for t in run) for f, pick in fields.items()}
        placed.update(dict.fromkeys((t.root for t in run), together))
    return placed


def _no_worse(bucketed: Prediction, alone: Prediction, stall_tolerance: float) -> bool:
    """Peak no higher, step no slower than ``alone``'s or the tolerance allows (times
    summed in another order differ in their last bits: those are equal)."""
    slowest = max(alone.step_seconds, (1 + stall_tolerance) * alone.baseline_seconds)
    return bucketed.peak_bytes <= alone.peak_bytes and bucketed.step_seconds <= slowest * (1 + 1e-9)


def bucket_transfers(
    planned: ChunkPlan, costs: ChunkCosts, stall_tolerance: float, in_flight: int = 1
) -> ChunkPlan:
    """``planned`` with its transfers in buckets both ways, else forward's alone, where
    the prediction is no worse (see above), and that prediction; else ``planned``."""
    transfers = planned.transfers
    memory = MemoryTimeline(costs, transfers, in_flight)
    forward = _together(_forward_runs(planned, costs, memory), _FORWARD)
    forward_only = tuple(dataclasses.replace(t, **forward[t.root]) for t in transfers)
    runs = _backward_runs(transfers, costs, memory)
    backward = _reloads_that_fit(runs, _reloads_placed(runs, planned, costs), memory)
    both = tuple(dataclasses.replace(t, **backward[t.root]) for t in forward_only)
    for candidate in (both, forward_only):
        if candidate == transfers:
            return planned
        prediction = simulate(costs, candidate, in_flight)
        if _no_worse(prediction, planned.prediction, stall_tolerance):
            return dataclasses.replace(planned, transfers=candidate, prediction=prediction)
    return planned
