"""Joint planning: recompute where moving alone is too slow, or where it is free.

Offloading lowers the peak only as far as the copies hide under compute; past that,
every byte more waits on PCIe. Recomputing costs compute instead. Where the offload plan
of the stock partition misses ``memory_budget``, or meets it only by slowing the step
past ``stall_tolerance`` of the step with nothing moved, the search splits the graph
again three ways, each tried only where those before leave the budget unmet within the
tolerance:

1. the stock split with saved values recomputed, each with the nodes it is computed from
   (:mod:`offload_pass.recomputation`), those cheapest per byte freed, as many as its
   plan moves and misses by, in rounds, in three orders;
2. the partitioner's knapsack under ``RECOMPUTE_LEVELS`` in turn (torch's
   ``activation_memory_budget``: the lower, the more it recomputes in backward, cheapest
   first);
3. the stock split with the last blocks checkpointed.

The pass plans each split's offloads for the same budget in bytes. The cost model prices
the recomputed nodes in backward like any other, so one simulation weighs moving,
recomputing and both.

The values come first because their splits are the cheapest to make: the partitioner
solves one min-cut for each, where a level takes four and a knapsack (on W1 on the CPU,
a level's split took 2.7 to 4.1 times as long as the stock split). A level cannot be
refined value by value either (its knapsack would save others in place of the values
marked); the stock split can. Values of one price (the same op in every block) are
taken in two orders, first made first, then last made first, each in its own rounds:
which leaves the lower peak depends on where the step peaks. A third order offers only
the values computed from what the split saves already: one computed from what it newly
saves, a norm's output from its statistics, can be held where backward peaks. Each round
takes a share (``VALUE_STEP``) of what is left to free.

The search keeps the plan that meets the budget predicted fastest, or where none meets it
the one predicted nearest. It stops at the first plan that meets the budget within the
tolerance, and, among the levels, once a plan meets the budget no faster than the last
split's step with nothing moved: each level recomputes more than the last, so no lower
level's plan can be faster (the step of a split with nothing moved bounds every plan on
it from below, and it grows as the level falls), and each split costs a partition. Where
a plan meets the budget, a level that does not improve on it does not end the search:
one that recomputes more may leave less to move (W2 at 13.96 GiB, planned on the H200:
735 ms at 0.8, 751 at 0.6, 615 at 0.4). Where none meets it yet, the first level that
gets no nearer does.

The partitioner's knapsack weighs each value's bytes, not the peak: recomputing from the
whole model's inputs, its lowest level saves little at the peak. Checkpointing whole
blocks (:mod:`offload_pass.blocks`) does, as the stock compile of a checkpointed model
does: so the last way splits the stock level with the last blocks checkpointed, and
plans what is left to move (the checkpointed blocks' inputs among it) as on any split.
Checkpointing the last blocks first leaves the first blocks' values, which have the
longest copy windows, to be moved.

In ``auto`` with ``recompute_budget="search"``, the search keeps the split whose plan
predicts the lowest peak while its step stays within ``stall_tolerance`` of the stock
split's step with nothing moved: whatever is cheaper to recompute than to keep is
recomputed. Each level's plan moves within the tolerance of its own split's step, so a
level whose step with nothing moved is close to the limit may plan past it and is not
kept; the first level whose step with nothing moved is past the limit ends the search,
since every lower level recomputes more. On the CPU with the H200 profile, ``auto``
on W1 predicts 9.38 GiB on the stock split and 6.94 GiB on split 0.8, both within 0.2%
of the stock step. ``auto`` keeps the most blocks checkpointed within the tolerance where
that lowers the peak further than the levels, and recomputes the values that fit into
its tolerance.

The kept plan's ``stage_seconds`` carry the seconds spent splitting and planning the splits
not kept (``"search"``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch.fx

from offload_pass import _compat
from offload_pass.blocks import Split, find_blocks
from offload_pass.driver import PlannedChunk, plan_chunk
from offload_pass.graphs import ChunkGraphs
from offload_pass.options import SEARCH, FractionRule, OffloadOptions
from offload_pass.profiles import UNMEASURED, HostScale
from offload_pass.recomputation import (
    Order,
    cheapest,
    first_made_first,
    last_made_first,
    recomputable,
    recomputing,
    saving_nothing_more,
)

RECOMPUTE_LEVELS = (0.8, 0.6, 0.4, 0.2)
"""The partitioner budgets a search may try, those below torch's setting."""

VALUE_ROUNDS = 3
"""How many times a budget's search recomputes more values, one split each."""

VALUE_STEP = 0.5
"""The share of what a plan moves and misses the budget by that one round recomputes.
Values computed again are held in backward, which moves the step's peak, so a round
takes a share and the next, planned on the new split, sees what is left. Taking it all
at once (``1.0``) planned every one of W1, W2, HF Llama and Qwen2 at checkpointing's
peak slower on the CPU with the H200 profile (docs/design.md)."""

Partition = Callable[[Split], ChunkGraphs]
"""The chunk's forward and backward graphs, split as asked."""


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The splits a search may try: the partitioner's knapsack at ``levels``, the last
    of ``blocks`` checkpointed (:mod:`offload_pass.blocks`), any number of them, and,
    where ``values``, saved values recomputed one by one
    (:mod:`offload_pass.recomputation`)."""

    levels: tuple[float, ...] = ()
    blocks: tuple[str, ...] = ()
    values: bool = False

    def __bool__(self) -> bool:
        return bool(self.levels or self.blocks or self.values)


def search_space(
    options: OffloadOptions, joint: torch.fx.GraphModule, num_forward_outputs: int
) -> SearchSpace:
    """The splits the search may try on ``joint`` (its first ``num_forward_outputs``
    outputs forward's): under a memory budget or where ``recompute_budget`` is
    ``"search"``, the levels below the partitioner's own setting and the repeated
    blocks. None where the options fix the split or where the
    partitioner agrees its choices across ranks (each split a collective, which ranks
    planning differently would call a different number of times); no level where the
    graph's nodes carry their own budget (the partitioner takes it over any setting, so
    every level's split would be the same), and no block or value where they carry their
    own checkpointing policy (the user's checkpointing is kept as it is)."""
    chosen = options.recompute_budget
    searching = chosen == SEARCH or (chosen is None and options.memory_budget is not None)
    if not searching or _compat.partitions_sync_across_ranks():
        return SearchSpace()
    torch_level = _compat.activation_memory_budget()
    levels = () if _compat.budget_annotated(joint) else RECOMPUTE_LEVELS
    checkpointed = any("recompute" in n.meta for n in joint.graph.nodes)
    return SearchSpace(
        tuple(level for level in levels if level < torch_level),
        () if checkpointed else find_blocks(joint, num_forward_outputs),
        values=not checkpointed,
    )


def plan_jointly(
    partition: Partition,
    options: OffloadOptions,
    rule: FractionRule,
    space: SearchSpace = SearchSpace(),
    host_scale: HostScale = UNMEASURED,
) -> PlannedChunk:
    """The planned split of the chunk: under ``options.recompute_budget`` (None: torch's
    setting), or the best the search over ``space`` finds (module docstring).
    ``host_scale``: as :func:`driver.plan_chunk` takes it."""
    seconds: dict[Split, float] = {}

    def plan_at(split: Split, planned_for: OffloadOptions = options) -> PlannedChunk:
        start = time.perf_counter()
        planned = plan_chunk(partition(split), planned_for, rule, host_scale)
        seconds[split] = time.perf_counter() - start
        return dataclasses.replace(planned, split=split)

    stock = plan_at(Split(options.fixed_recompute_budget))
    if not space:
        return stock
    if options.memory_budget is not None:
        best = _meet_budget(plan_at, options, space, stock)
    else:
        best = _lowest_peak_in_time(plan_at, options, space, stock)
    searched = sum(s for split, s in seconds.items() if split != best.split)
    return dataclasses.replace(best, stage_seconds={**best.stage_seconds, "search": searched})


PlanAt = Callable[..., PlannedChunk]
"""The chunk split as asked and planned, with the options given or the search's own."""


def _meet_budget(
    plan_at: PlanAt, options: OffloadOptions, space: SearchSpace, stock: PlannedChunk
) -> PlannedChunk:
    """The plan meeting the budget predicted fastest, else the nearest: the stock split
    with values recomputed in place of what it moves or misses; where that does not meet
    the budget within the tolerance, the levels'; where they do not either, the
    checkpointed blocks'. The values are recomputed on the stock split alone: under a
    level, the partitioner's knapsack would save others in their place."""
    slowest = _slowest(stock, options)
    # a share of the stock peak, in bytes, for every split (at least one: bytes must be)
    in_bytes = dataclasses.replace(options, memory_budget=max(1, stock.planned.budget_bytes))
    best = stock
    if space.values:  # the stock plan among those it compares
        best = _values_recomputed_for_budget(plan_at, in_bytes, stock, slowest)
    best = _level_meeting_budget(plan_at, in_bytes, space.levels, best, slowest)
    if space.blocks and not _meets_budget_in_time(best, slowest):
        checkpointing = _checkpointing_meeting_budget(plan_at, in_bytes, space.blocks, best)
        best = min(best, checkpointing, key=_shortfall_then_step)
    return best


def _level_meeting_budget(
    plan_at: PlanAt,
    in_bytes: OffloadOptions,
    levels: Sequence[float],
    best: PlannedChunk,
    slowest: float,
) -> PlannedChunk:
    for level in levels:
        if _meets_budget_in_time(best, slowest):
            break
        tried = plan_at(Split(level), in_bytes)
        if _shortfall_then_step(tried) < _shortfall_then_step(best):
            best = tried
        elif best.planned.budget_shortfall or _unbeatable(best, tried):
            break
    return best


def _checkpointing_meeting_budget(
    plan_at: PlanAt, in_bytes: OffloadOptions, blocks: tuple[str, ...], best: PlannedChunk
) -> PlannedChunk:
    """Of the plans checkpointing the last blocks, the fastest meeting the budget, else
    the nearest, among those planned in looking for two: the fewest blocks whose plan
    meets the budget, moving what it must, and the fewest whose split meets it with
    nothing moved (each block more than that only recomputes more). Each block more
    lowers the peak, so both are found by halving; where no split meets the budget with
    nothing moved, the one checkpointing every block, the nearest, is planned too.

    Each block more also recomputes more, so where ``best`` meets the budget no slower
    than a count's split with nothing moved, no count from there up can beat it: the
    halving takes that count as enough, and where it is one block, ends there."""
    planned: dict[int, PlannedChunk] = {}

    def plan(count: int) -> PlannedChunk:
        if count not in planned:
            planned[count] = plan_at(_checkpointing(blocks, count, in_bytes), in_bytes)
        return planned[count]

    def beaten(count: int) -> bool:
        return _unbeatable(best, plan(count))

    def meets(count: int) -> bool:
        return beaten(count) or not plan(count).planned.budget_shortfall

    def unmoved_meets(count: int) -> bool:
        chunk = plan(count).planned
        return beaten(count) or chunk.prediction.baseline_peak_bytes <= (chunk.budget_bytes or 0)

    if not best.planned.budget_shortfall and beaten(1):
        return planned[1]
    _fewest(len(blocks), meets)
    if _fewest(len(blocks), unmoved_meets) is None:
        plan(len(blocks))
    return min(planned.values(), key=_shortfall_then_step)


def _values_recomputed_for_budget(
    plan_at: PlanAt, in_bytes: OffloadOptions, planned: PlannedChunk, slowest: float
) -> PlannedChunk:
    """The first plan meeting the budget within ``slowest``, else the fastest meeting
    it, else the nearest, of the rounds of values recomputed taking equals first made
    first, then last made first: which leaves the lower peak depends on where the step
    peaks (``recomputation.last_made_first``); then those alone that save nothing more
    (``recomputation.saving_nothing_more``)."""
    tried: dict[Split, PlannedChunk] = {}

    def plan_once(split: Split) -> PlannedChunk:
        # without ties the two orders choose alike: a split is partitioned once
        if split not in tried:
            tried[split] = plan_at(split, in_bytes)
        return tried[split]

    best = planned
    for order in (first_made_first, last_made_first, saving_nothing_more):
        best = min(best, _rounds(plan_once, planned, order, slowest), key=_shortfall_then_step)
        if _meets_budget_in_time(best, slowest):
            break
    return best


def _rounds(
    plan: Callable[[Split], PlannedChunk], planned: PlannedChunk, order: Order, slowest: float
) -> PlannedChunk:
    """The first plan meeting the budget within ``slowest``, else the fastest meeting
    it, else the nearest, of up to ``VALUE_ROUNDS`` splits, each ``planned``'s or the
    last one's with more values recomputed: those first in ``order``, kept or moved,
    until their bytes reach ``VALUE_STEP`` of what the last plan moves and misses the
    budget by, in no more time than its moves add to its step (any, where it misses the
    budget). The rounds stop at a plan neither nearer the budget nor faster than the
    last."""
    best = planned
    for _ in range(VALUE_ROUNDS):
        chunk = planned.planned
        prediction = chunk.prediction
        moved = sum(d.group.nbytes for d in chunk.decisions if d.moved)
        slowdown = prediction.step_seconds - prediction.baseline_seconds
        affordable = math.inf if chunk.budget_shortfall else slowdown
        wanted = VALUE_STEP * (chunk.budget_shortfall + moved)
        taken = cheapest(order(recomputable(planned)), wanted, affordable)
        if not taken:
            break
        tried = plan(recomputing(planned.split, taken))
        if not _nearer_or_faster(tried, planned):
            break
        best = min(best, tried, key=_shortfall_then_step)
        if _meets_budget_in_time(best, slowest):
            break
        planned = tried
    return best


def _nearer_or_faster(planned: PlannedChunk, than: PlannedChunk) -> bool:
    shortfall, step = _shortfall_then_step(planned)
    shortfall_than, step_than = _shortfall_then_step(than)
    return shortfall < shortfall_than or step < step_than


def _fewest(most: int, enough: Callable[[int], bool]) -> int | None:
    """The fewest of 1 to ``most`` that is ``enough``, by halving (each count more is
    taken to be as much enough); None where ``most`` is not."""
    return _halved(enough, 0, most)


def _fewest_one_first(most: int, enough: Callable[[int], bool]) -> int | None:
    """As :func:`_fewest`, trying 1 first: one try where 1 is enough, one more than
    halving where it is not."""
    if most >= 1 and enough(1):
        return 1
    return _halved(enough, min(most, 1), most)


def _halved(enough: Callable[[int], bool], short: int, most: int) -> int | None:
    """The fewest of ``short + 1`` to ``most`` that is ``enough`` (``short``: known not
    to be), by halving; None where ``most`` is not."""
    enough_at = most + 1
    while enough_at - short > 1:
        count = (short + enough_at) // 2
        if enough(count):
            enough_at = count
        else:
            short = count
    return enough_at if enough_at <= most else None


def _lowest_peak_in_time(
    plan_at: PlanAt, options: OffloadOptions, space: SearchSpace, stock: PlannedChunk
) -> PlannedChunk:
    """``auto``'s plan predicting the lowest peak within the tolerance of the stock
    split's step with nothing moved: the levels', the checkpointed blocks', and the
    stock split's with the values it keeps recomputed, as many as the tolerance leaves
    time for."""
    slowest = _slowest(stock, options)
    best = stock
    for level in space.levels:
        tried = plan_at(Split(level))
        prediction = tried.planned.prediction
        if prediction.baseline_seconds > slowest:
            break
        if prediction.step_seconds <= slowest and prediction.peak_bytes < _peak(best):
            best = tried
    if space.blocks:
        checkpointing = _most_checkpointing_in_time(plan_at, options, space.blocks, slowest)
        if checkpointing is not None and _peak(checkpointing) < _peak(best):
            best = checkpointing
    if not space.values:
        return best
    with_values = _values_recomputed_in_time(plan_at, stock, slowest)
    return with_values if _peak(with_values) < _peak(best) else best


def _values_recomputed_in_time(
    plan_at: PlanAt, planned: PlannedChunk, slowest: float
) -> PlannedChunk:
    """``planned``'s split with the values it keeps that are cheapest to compute again
    per byte recomputed, as many as fit between its step and ``slowest``, where that
    plan's step is within ``slowest``; else ``planned``."""
    spare = slowest - planned.planned.prediction.step_seconds
    kept = first_made_first([value for value in recomputable(planned) if not value.moved])
    taken = cheapest(kept, math.inf, spare)
    if not taken:
        return planned
    tried = plan_at(recomputing(planned.split, taken))
    return tried if tried.planned.prediction.step_seconds <= slowest else planned


def _most_checkpointing_in_time(
    plan_at: PlanAt, options: OffloadOptions, blocks: tuple[str, ...], slowest: float
) -> PlannedChunk | None:
    """Of the plans checkpointing the last blocks within ``slowest``, the lowest peak
    among those made in looking for the fewest blocks past ``slowest`` (each block more
    recomputes more), trying one first: within a small tolerance, one block can be past it
    already; None where none is within it."""
    planned: dict[int, PlannedChunk] = {}

    def too_slow(count: int) -> bool:
        planned[count] = plan_at(_checkpointing(blocks, count, options))
        return planned[count].planned.prediction.step_seconds > slowest

    _fewest_one_first(len(blocks), too_slow)
    in_time = [p for p in planned.values() if p.planned.prediction.step_seconds <= slowest]
    return min(in_time, key=_peak, default=None)


def _checkpointing(blocks: tuple[str, ...], count: int, options: OffloadOptions) -> Split:
    """The split checkpointing the last ``count`` blocks, at the options' level: the
    first blocks' saved values have the longest copy windows, so moving suits them best."""
    return Split(options.fixed_recompute_budget, blocks[len(blocks) - count :])


def _slowest(stock: PlannedChunk, options: OffloadOptions) -> float:
    return stock.planned.prediction.baseline_seconds * (1 + options.stall_tolerance)


def _peak(planned: PlannedChunk) -> int:
    return planned.planned.prediction.peak_bytes


def _meets_budget_in_time(planned: PlannedChunk, slowest: float) -> bool:
    prediction = planned.planned.prediction
    return not planned.planned.budget_shortfall and prediction.step_seconds <= slowest


def _unbeatable(best: PlannedChunk, tried: PlannedChunk) -> bool:
    """Whether ``best`` meets the budget no slower than ``tried``'s split with nothing
    moved, which bounds from below the plans of every split recomputing more: every
    lower level's (module docstring), or every larger count of blocks checkpointed."""
    prediction = best.planned.prediction
    floor = tried.planned.prediction.baseline_seconds
    return not best.planned.budget_shortfall and prediction.step_seconds <= floor


def _shortfall_then_step(planned: PlannedChunk) -> tuple[int, float]:
    return planned.planned.budget_shortfall, planned.planned.prediction.step_seconds
