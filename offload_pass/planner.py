"""Plan: choose which saved storages move, and place every transfer op.

Selection, per chunk:
- a share (``fraction``, a pattern or ``set_fraction``) moves up to that share of its
  module's candidate bytes, the candidates with the longest overlap window first;
- ``auto`` moves what hides: forward's copies in production order while the
  device-to-host queue finishes by the end of forward, then backward's reloads, latest
  needed first, while the host-to-device queue brings each back before its first use,
  or late by no more than ``stall_tolerance`` of the step in all; a copy that makes
  compute wait stays only if the predicted peak is higher without it; then, where the
  host's time for the transfer ops would lengthen the step by more than the tolerance,
  the smallest storages stay;
- ``memory_budget`` moves the fewest candidates, those ``auto`` would move first, that
  bring the predicted peak under the budget, at the overlap depth (below) whose plan is
  predicted fastest; where none does, the fewest that bring it lowest.

Placement: each offload right after its producer; its wait at the first node by which
the copy is predicted complete (and not before the last forward use); reloads as late as
they can start and still finish before first use, in first-use order. Where other
forwards of the chunk run before its backward (``in_flight`` above 1) and the copy queue
keeps pace with them, a copy that would be waited for at forward's end is released there
instead: compute does not wait for it, and its storage is freed once the copy has read
it, under the next forward's compute. Where more is moved than the copy queues can carry
in time (a share or a budget asks for it), every copy is waited for no later than where
the copy ``OVERLAP_DEPTH`` later is produced, and a reload that would start before
backward is issued ``OVERLAP_DEPTH`` reloads before its need: compute then waits for the
queue either way, but holds only a few copies in flight, not all. A budget tries each depth of
``BUDGET_DEPTHS``: fewer copies in flight lower the peak, so fewer need to move, while
more let compute run further ahead of the queue.

Selection prices copies as predicted; placement prices them slower (``OFFLOAD_MARGIN``,
``RELOAD_MARGIN``), so that a wait or a reload placed by a slightly optimistic prediction
still does not stall. Reloads get the wider margin: on an H200, W1's backward stalled 5 ms
with 5% (docs/gpu-validation.md), and a reload issued early costs little memory late in
backward.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections.abc import Sequence

from offload_pass.analysis import SavedGroup
from offload_pass.costs import ChunkCosts
from offload_pass.simulate import (
    CopyQueue,
    DeadlineChain,
    MemoryTimeline,
    Prediction,
    Transfer,
    peak_bytes,
    simulate,
    unhindered_starts,
)

OFFLOAD_MARGIN = 1.05
RELOAD_MARGIN = 1.25
OVERLAP_DEPTH = 3
BUDGET_DEPTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24)

MOVED = "moved"
TOO_SMALL = "too small"
FRACTION_REACHED = "fraction reached"
WOULD_NOT_HIDE = "would not hide"
SLOWS_THE_STEP = "slows the step"
BUDGET_MET = "budget met"
PEAK_NOT_LOWERED = "would not lower the peak"


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether ``group`` moves and why. ``share`` is the fraction that applied, or None
    where the chunk's planner mode (auto or memory budget) decided."""

    group: SavedGroup
    moved: bool
    reason: str
    owner: str
    share: float | None


@dataclasses.dataclass(frozen=True)
class Request:
    """What the planner is asked for, per chunk: each candidate's owner and share (None:
    the mode decides), the mode's settings, and how many forwards of the chunk run
    before its first backward (``in_flight``: a pipeline stage's microbatches, blocks
    compiled each on their own), which multiplies what is held between forward and
    backward in the predicted peak, and lets copies end under the forwards that follow."""

    owners: dict[str, tuple[str, float | None]]
    min_bytes: int
    stall_tolerance: float
    memory_budget: int | float | None
    in_flight: int = 1


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """The decisions, their placed transfers and the predicted step. ``overlap_depth``:
    how many copies ahead of compute the queues may run where they cannot keep up
    (``OVERLAP_DEPTH`` but under a memory budget)."""

    decisions: tuple[Decision, ...]
    transfers: tuple[Transfer, ...]
    prediction: Prediction
    budget_bytes: int | None
    overlap_depth: int = OVERLAP_DEPTH

    @property
    def budget_shortfall(self) -> int:
        """Predicted bytes over the memory budget (0 when met or when there is none)."""
        if self.budget_bytes is None:
            return 0
        return max(0, self.prediction.peak_bytes - self.budget_bytes)


@dataclasses.dataclass(frozen=True)
class _Clocks:
    """Compute times with nothing moved (the host's issuing included): forward node
    ends, backward node starts from backward's start. ``followed``: other forwards of
    the chunk run before its backward (``in_flight`` above 1), under whose compute a
    copy may end, where copies overlap compute at all."""

    forward_end: tuple[float, ...]
    backward_start: tuple[float, ...]
    first_backward_compute: int
    followed: bool = False

    @classmethod
    def of(cls, costs: ChunkCosts, in_flight: int = 1) -> _Clocks:
        forward_starts, backward_starts = unhindered_starts(costs)
        forward_end = tuple(map(operator.add, forward_starts, costs.forward_seconds))
        backward_start = forward_end[-1] if forward_end else 0.0
        return cls(
            forward_end,
            tuple(start - backward_start for start in backward_starts),
            costs.backward_inputs,
            in_flight > 1 and costs.profile.copies_overlap_compute,
        )

    @property
    def forward_seconds(self) -> float:
        return self.forward_end[-1] if self.forward_end else 0.0

    def window(self, g: SavedGroup) -> float:
        """How long its copies have: rest of forward, and backward before first use."""
        return min(
            self.forward_seconds - self.forward_end[g.produced_at],
            self.backward_start[g.first_backward_use],
        )


def _wait_positions(
    groups: Sequence[SavedGroup], costs: ChunkCosts, clocks: _Clocks, depth: int
) -> tuple[dict[str, int], set[str]]:
    """Each offload_wait at the first node by which its copy is done, queued in order;
    and the copies released at forward's end instead (``_released``).

    Where the queue cannot carry the copies within forward even as predicted (a share
    or a budget moves more than hides), every copy is waited for by where the copy
    ``depth`` later is produced, if it is not done before: forward slows to the copy
    rate, but holds only a few copies in flight, not the queue's whole backlog (and not
    every late copy until forward's end).
    """
    last_forward = len(clocks.forward_end) - 2
    order = sorted(groups, key=lambda g: g.produced_at)

    def ends(backlog: float) -> tuple[list[float], list[float]]:
        return (
            _offload_ends(order, costs, clocks, 1.0, backlog),
            _offload_ends(order, costs, clocks, OFFLOAD_MARGIN, backlog),
        )

    predicted, margined = ends(0.0)
    released = _released(order, predicted, margined, costs, clocks)
    if released:
        # Each forward finds the queue busy with the last one's released copies until
        # they end, and its own copies queue behind them (steady: the queue's copies take
        # it no longer than a forward, so the backlog does not grow past this).
        last = max(p for g, p in zip(order, predicted, strict=True) if g.root in released)
        predicted, margined = ends(last - clocks.forward_seconds)
        released = _released(order, predicted, margined, costs, clocks)
        if not released:
            predicted, margined = ends(0.0)
    behind = not released and max(predicted, default=0.0) > clocks.forward_seconds
    wait_at = {}
    for i, g in enumerate(order):
        done = bisect.bisect_left(clocks.forward_end, margined[i], lo=g.last_forward_use)
        if g.root in released:
            done = last_forward
        elif behind and i + depth < len(order):
            done = min(done, max(g.last_forward_use, order[i + depth].produced_at))
        wait_at[g.root] = min(done, last_forward)
    return wait_at, released


def _released(
    order: Sequence[SavedGroup],
    predicted: Sequence[float],
    margined: Sequence[float],
    costs: ChunkCosts,
    clocks: _Clocks,
) -> set[str]:
    """The copies that would be waited for at forward's end, where the next forward can
    take them: their offload_release hands the host buffer on at forward's end without
    making compute wait, and each storage is freed once its copy has read it.

    Only where the queue keeps pace with the forwards that follow: the chunk's copies
    take the device-to-host queue no longer than its forward, and each ends within the
    next forward (``predicted`` counts the queue busy with the forward before's released
    copies). Then each forward's copies end under the next one's compute, however many
    run: a forward finds the queue busy with the last one's copies for less than its own
    length. Otherwise none is released, and forward waits for each copy."""
    seconds = sum(costs.offload_seconds(g.nbytes) for g in order)
    forward = clocks.forward_seconds
    if not clocks.followed or seconds > forward or max(predicted, default=0.0) > 2 * forward:
        return set()
    return {g.root for g, end in zip(order, margined, strict=True) if end > forward}


def _offload_ends(
    order: Sequence[SavedGroup],
    costs: ChunkCosts,
    clocks: _Clocks,
    margin: float,
    backlog: float = 0.0,
) -> list[float]:
    """When each copy of the device-to-host queue ends, copies ``margin`` times slower,
    the queue busy until ``backlog`` into forward."""
    queue = CopyQueue(free_at=backlog)
    return [
        queue.push(clocks.forward_end[g.produced_at], margin * costs.offload_seconds(g.nbytes))[1]
        for g in order
    ]


def reload_positions(
    groups: Sequence[SavedGroup], costs: ChunkCosts, depth: int = OVERLAP_DEPTH
) -> dict[str, int]:
    """Where each storage's reload goes, moved with ``groups`` (see ``place``)."""
    return _reload_positions(groups, costs, _Clocks.of(costs), depth)


def _reload_positions(
    groups: Sequence[SavedGroup], costs: ChunkCosts, clocks: _Clocks, depth: int
) -> dict[str, int]:
    """Each reload as late as the chain of reloads, latest needed first, still arrives.

    Reloads that cannot arrive in time even as predicted (the chain starts before
    backward does) are issued ``depth`` reloads ahead of their need, not all at
    backward's start: backward waits for them either way, and fewer are held at once.
    """
    order = sorted(groups, key=lambda g: (-g.first_backward_use, -g.produced_at))
    margined = _reload_starts(order, costs, clocks, RELOAD_MARGIN)
    predicted = _reload_starts(order, costs, clocks, 1.0)
    reload_at = {}
    for g, start in zip(order, margined, strict=True):
        issue = bisect.bisect_right(clocks.backward_start, start) - 1
        reload_at[g.root] = min(max(issue, clocks.first_backward_compute), g.first_backward_use)
    late = _late_front(order, predicted, clocks)
    for ahead, g in zip(late, late[depth:], strict=False):
        reload_at[g.root] = max(reload_at[g.root], ahead.first_backward_use)
    issued = 0  # the queue is FIFO: none issued before one needed earlier
    for g in reversed(order):
        issued = reload_at[g.root] = max(issued, reload_at[g.root])
    return reload_at


def _late_front(
    order: Sequence[SavedGroup], starts: Sequence[float], clocks: _Clocks
) -> list[SavedGroup]:
    """In need order: the reloads that start late, and those queued right behind them
    (the host-to-device queue busy from backward's start until each one starts)."""
    front: list[SavedGroup] = []
    if not starts or starts[-1] >= 0:
        return front
    for k in range(len(order) - 1, -1, -1):
        front.append(order[k])
        if k and starts[k - 1] > clocks.backward_start[order[k].first_backward_use]:
            break
    return front


def _reload_starts(
    order: Sequence[SavedGroup], costs: ChunkCosts, clocks: _Clocks, margin: float
) -> list[float]:
    """When each reload of the chain must start, latest needed first, copies ``margin``
    times slower (negative: before backward starts)."""
    chain = DeadlineChain()
    return [
        chain.push(
            clocks.backward_start[g.first_backward_use], margin * costs.reload_seconds(g.nbytes)
        )
        for g in order
    ]


def place(
    groups: Sequence[SavedGroup], costs: ChunkCosts, clocks: _Clocks, depth: int = OVERLAP_DEPTH
) -> list[Transfer]:
    wait_at, released = _wait_positions(groups, costs, clocks, depth)
    reload_at = _reload_positions(groups, costs, clocks, depth)
    return [
        Transfer(
            g.root,
            g.nbytes,
            g.produced_at,
            wait_at[g.root],
            reload_at[g.root],
            g.first_backward_use,
            g.root in released,
        )
        for g in sorted(groups, key=lambda g: g.produced_at)
    ]


def _hides(
    candidates: Sequence[SavedGroup],
    forced: Sequence[SavedGroup],
    costs: ChunkCosts,
    clocks: _Clocks,
    tolerance: float,
) -> set[str]:
    """The candidates ``auto`` moves alongside ``forced``.

    Forward: an offload must finish before forward does; one that finishes later is
    waited for at forward's end, still held at the peak there, and saves nothing. Where
    other forwards follow (``_Clocks.followed``), it may end under the next forward, as
    long as the copies take the queue no longer than one forward in all (``_released``;
    then each ends within the next forward).
    Backward: reloads may make compute wait up to ``tolerance`` of the step in all.
    """
    if not costs.profile.copies_overlap_compute:
        return set()
    forced_roots = {g.root for g in forced}
    forward = clocks.forward_seconds
    queue = CopyQueue()
    busy = 0.0
    forward_ok = []
    for g in sorted([*candidates, *forced], key=lambda g: g.produced_at):
        ready, seconds = clocks.forward_end[g.produced_at], costs.offload_seconds(g.nbytes)
        in_time = clocks.followed or queue.start_of(ready) + seconds <= forward
        if g.root in forced_roots or (in_time and busy + seconds <= forward):
            queue.push(ready, seconds)
            busy += seconds
            forward_ok.append(g)

    allowance = tolerance * (sum(costs.forward_seconds) + sum(costs.backward_seconds))
    chain = DeadlineChain()
    hidden = set()
    for g in sorted(forward_ok, key=lambda g: (-g.first_backward_use, -g.produced_at)):
        due, seconds = clocks.backward_start[g.first_backward_use], costs.reload_seconds(g.nbytes)
        if g.root in forced_roots or chain.start_of(due, seconds) >= -allowance:
            chain.push(due, seconds)
            hidden.add(g.root)
    return hidden - forced_roots


def _worth_their_stalls(
    hidden: set[str],
    candidates: Sequence[SavedGroup],
    forced: Sequence[SavedGroup],
    costs: ChunkCosts,
    clocks: _Clocks,
    in_flight: int,
) -> set[str]:
    """``hidden`` less each copy that makes compute wait without lowering the predicted
    peak, longest wait first: such a copy costs time and saves nothing. Each is judged
    where ``hidden`` places it all (placing again per copy is quadratic in the graph).

    Under a recompute budget, the partitioner recomputes the residual stream at
    backward's start from saved outputs; a reload of one of those is needed there, before
    any compute it could hide under, and that storage is freed there anyway.
    """
    moved = [*forced, *(g for g in candidates if g.root in hidden)]
    transfers = place(moved, costs, clocks, OVERLAP_DEPTH)
    prediction = simulate(costs, transfers, in_flight)
    stalling = sorted(
        (c for c in prediction.copies if c.stall > 0 and c.root in hidden),
        key=lambda c: -c.stall,
    )
    placed = {t.root: t for t in transfers}
    memory = MemoryTimeline(costs, transfers, in_flight)
    peak = memory.peak
    kept = set(hidden)
    for copy in stalling:
        if memory.peak_without(placed[copy.root]) <= peak:
            memory.keep(placed[copy.root])
            kept.discard(copy.root)
    return kept


def _within_tolerance(
    moving: set[str],
    candidates: Sequence[SavedGroup],
    forced: Sequence[SavedGroup],
    costs: ChunkCosts,
    clocks: _Clocks,
    request: Request,
) -> set[str]:
    """``moving`` less its smallest storages, as few as it takes for the predicted step
    to stay within ``stall_tolerance`` of the step with nothing moved.

    Each storage moved costs the host the same, whatever its size: where the step is the
    host's, the smallest save the least memory for that cost.
    """
    ranked = sorted(
        (g for g in candidates if g.root in moving), key=lambda g: (-g.nbytes, g.produced_at)
    )

    def prediction(count: int) -> Prediction:
        transfers = place([*forced, *ranked[:count]], costs, clocks, OVERLAP_DEPTH)
        return simulate(costs, transfers, request.in_flight)

    def too_slow(count: int) -> bool:
        return not prediction(count).within(request.stall_tolerance)

    if not too_slow(len(ranked)):
        return moving
    counts = range(len(ranked) + 1)
    kept = max(0, bisect.bisect_left(counts, True, key=too_slow) - 1)
    return {g.root for g in ranked[:kept]}


def _by_share(candidates: Sequence[SavedGroup], request: Request, clocks: _Clocks) -> set[str]:
    totals: dict[str, int] = {}
    for g in candidates:
        owner = request.owners[g.root][0]
        totals[owner] = totals.get(owner, 0) + g.nbytes
    taken = dict.fromkeys(totals, 0)
    chosen = set()
    for g in sorted(candidates, key=lambda g: (-clocks.window(g), g.produced_at)):
        owner, share = request.owners[g.root]
        if taken[owner] + g.nbytes <= share * totals[owner]:
            taken[owner] += g.nbytes
            chosen.add(g.root)
    return chosen


def _within_budget(
    ranked: Sequence[SavedGroup],
    forced: Sequence[SavedGroup],
    costs: ChunkCosts,
    clocks: _Clocks,
    budget: int,
    in_flight: int,
) -> tuple[set[str], int]:
    """The prefix of ``ranked`` that, with ``forced``, meets the budget in the step
    predicted fastest, and the overlap depth to place it with: per depth of
    ``BUDGET_DEPTHS``, the shortest prefix that meets it there. If none does: the
    shortest prefix reaching the lowest peak, at the depth of that peak (a copy more
    would slow the step and leave the peak where it is)."""

    def transfers(count: int, depth: int) -> list[Transfer]:
        return place([*forced, *ranked[:count]], costs, clocks, depth)

    def peak(count: int, depth: int) -> int:
        return peak_bytes(costs, transfers(count, depth), in_flight)

    def fewest(depth: int, reaching: int) -> int:
        counts = range(len(ranked) + 1)
        return bisect.bisect_left(counts, True, key=lambda c: peak(c, depth) <= reaching)

    peaks = {d: peak(len(ranked), d) for d in BUDGET_DEPTHS}
    meeting = [d for d, p in peaks.items() if p <= budget]
    if not meeting:
        depth = min(peaks, key=lambda d: (peaks[d], -d))
        return {g.root for g in ranked[: fewest(depth, peaks[depth])]}, depth
    plans = []
    for depth in meeting:
        count = fewest(depth, budget)
        seconds = simulate(costs, transfers(count, depth), in_flight).step_seconds
        plans.append((seconds, count, depth))
    _, count, depth = min(plans)
    return {g.root for g in ranked[:count]}, depth


def _budget_bytes(request: Request, costs: ChunkCosts) -> int | None:
    budget = request.memory_budget
    if budget is None or isinstance(budget, int):
        return budget
    return int(budget * peak_bytes(costs, (), request.in_flight))


def plan_offloads(groups: Sequence[SavedGroup], costs: ChunkCosts, request: Request) -> ChunkPlan:
    clocks = _Clocks.of(costs, request.in_flight)
    candidates = [g for g in groups if g.fixed_reason is None and g.nbytes >= request.min_bytes]
    shared = [g for g in candidates if request.owners[g.root][1] is not None]
    by_mode = [g for g in candidates if request.owners[g.root][1] is None]
    chosen = _by_share(shared, request, clocks)
    forced = [g for g in shared if g.root in chosen]
    hidden = _hides(by_mode, forced, costs, clocks, request.stall_tolerance)
    budget = _budget_bytes(request, costs)
    depth = OVERLAP_DEPTH
    slowing: set[str] = set()
    if budget is None:
        worth = _worth_their_stalls(hidden, by_mode, forced, costs, clocks, request.in_flight)
        within = _within_tolerance(worth, by_mode, forced, costs, clocks, request)
        chosen |= within
        slowing = worth - within
        unchosen_reason = WOULD_NOT_HIDE
    else:
        ranked = sorted(by_mode, key=lambda g: (g.root not in hidden, -clocks.window(g)))
        within, depth = _within_budget(ranked, forced, costs, clocks, budget, request.in_flight)
        chosen |= within
        unchosen_reason = BUDGET_MET

    moved = [g for g in groups if g.root in chosen]
    transfers = tuple(place(moved, costs, clocks, depth))
    prediction = simulate(costs, transfers, request.in_flight)
    if budget is not None and prediction.peak_bytes > budget:
        unchosen_reason = PEAK_NOT_LOWERED
    decisions = tuple(
        _decide(g, chosen, request, SLOWS_THE_STEP if g.root in slowing else unchosen_reason)
        for g in groups
    )
    return ChunkPlan(decisions, transfers, prediction, budget, depth)


def _decide(g: SavedGroup, chosen: set[str], request: Request, unchosen: str) -> Decision:
    owner, share = request.owners[g.root]
    if g.fixed_reason is not None:
        reason = g.fixed_reason
    elif g.nbytes < request.min_bytes:
        reason = TOO_SMALL
    elif g.root in chosen:
        reason = MOVED
    else:
        reason = FRACTION_REACHED if share is not None else unchosen
    return Decision(g, g.root in chosen, reason, owner, share)
