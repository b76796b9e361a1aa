"""Joint planning: recompute where moving alone is too slow, or where it is free.

Offloading lowers the peak only as far as the copies hide under compute; past that,
every byte more waits on PCIe. Recomputing costs compute instead. Where the offload plan
of the stock partition misses ``memory_budget``, or meets it only by slowing the step
past ``stall_tolerance`` of the step with nothing moved, the stock partitioner splits the
graph again under ``RECOMPUTE_LEVELS`` in turn (torch's ``activation_memory_budget``: the
lower, the more it recomputes in backward, cheapest first), and the pass plans each
split's offloads for the same budget in bytes. The cost model prices the recomputed nodes
in backward like any other, so one simulation weighs moving, recomputing and both.

The search keeps the plan that meets the budget predicted fastest, or where none meets it
the one predicted nearest. It stops at the first plan that meets the budget within the
tolerance, and once a plan meets the budget no faster than the last split's step with
nothing moved: each level recomputes more than the last, so no lower level's plan can be
faster (the step of a split with nothing moved bounds every plan on it from below, and it
grows as the level falls), and each split costs a partition. Where a plan meets the
budget, a level that does not improve on it does not end the search: one that recomputes
more may leave less to move (W2 at 13.96 GiB, planned on the H200: 735 ms at 0.8, 751 at
0.6, 615 at 0.4). Where none meets it yet, the first level that gets no nearer does.
In ``auto`` with ``recompute_budget="search"``, the search keeps the split whose plan
predicts the lowest peak while its step stays within ``stall_tolerance`` of the stock
split's step with nothing moved: whatever is cheaper to recompute than to keep is
recomputed. Each level's plan moves within the tolerance of its own split's step, so a
level whose step with nothing moved is close to the limit may plan past it and is not
kept; the first level whose step with nothing moved is past the limit ends the search,
since every lower level recomputes more. On the CPU with the H200 profile, ``auto``
on W1 predicts 9.38 GiB on the stock split and 6.94 GiB on split 0.8, both within 0.2%
of the stock step.

The kept plan's ``stage_seconds`` carry the seconds spent splitting and planning the splits
not kept (``"search"``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch.fx

from offload_pass import _compat
from offload_pass.driver import PlannedChunk, plan_chunk
from offload_pass.graphs import ChunkGraphs
from offload_pass.options import SEARCH, FractionRule, OffloadOptions

RECOMPUTE_LEVELS = (0.8, 0.6, 0.4, 0.2)
"""The partitioner budgets a search may try, those below torch's setting."""

Partition = Callable[[float | None], ChunkGraphs]
"""The chunk's forward and backward graphs, split under a recompute budget (None: torch's
setting)."""


def search_levels(options: OffloadOptions, joint: torch.fx.GraphModule) -> tuple[float, ...]:
    """The recompute budgets the search may try on ``joint``: the levels below the
    partitioner's own setting, under a memory budget or where ``recompute_budget`` is
    ``"search"``. None where the options fix the split, where the graph's nodes carry
    their own budget (the partitioner takes it over any setting, so every split would be
    the same), or where the partitioner agrees its choices across ranks (each split a
    collective, which ranks planning differently would call a different number of
    times)."""
    chosen = options.recompute_budget
    searching = chosen == SEARCH or (chosen is None and options.memory_budget is not None)
    if not searching:
        return ()
    if _compat.budget_annotated(joint) or _compat.partitions_sync_across_ranks():
        return ()
    return tuple(level for level in RECOMPUTE_LEVELS if level < _compat.activation_memory_budget())


def plan_jointly(
    partition: Partition,
    options: OffloadOptions,
    rule: FractionRule,
    levels: Sequence[float],
    host_scale: float = 1.0,
) -> PlannedChunk:
    """The planned split of the chunk: under ``options.recompute_budget`` (None: torch's
    setting), or the best the search over ``levels`` finds (module docstring).
    ``host_scale``: as :func:`driver.plan_chunk` takes it."""
    seconds: dict[float | None, float] = {}

    def plan_at(level: float | None, planned_for: OffloadOptions = options) -> PlannedChunk:
        start = time.perf_counter()
        planned = plan_chunk(partition(level), planned_for, rule, host_scale)
        seconds[level] = time.perf_counter() - start
        return dataclasses.replace(planned, recompute_budget=level)

    stock = plan_at(options.fixed_recompute_budget)
    if not levels:
        return stock
    search = _meet_budget if options.memory_budget is not None else _lowest_peak_in_time
    best = search(plan_at, options, levels, stock)
    searched = sum(s for level, s in seconds.items() if level != best.recompute_budget)
    return dataclasses.replace(best, stage_seconds={**best.stage_seconds, "search": searched})


PlanAt = Callable[..., PlannedChunk]
"""The chunk split under a recompute budget and planned, with the options given or the
search's own."""


def _meet_budget(
    plan_at: PlanAt, options: OffloadOptions, levels: Sequence[float], stock: PlannedChunk
) -> PlannedChunk:
    """The plan meeting the budget predicted fastest, else the nearest."""
    best = stock
    slowest = stock.planned.prediction.baseline_seconds * (1 + options.stall_tolerance)
    # a share of the stock peak, in bytes, for every split (at least one: bytes must be)
    in_bytes = dataclasses.replace(options, memory_budget=max(1, stock.planned.budget_bytes))
    for level in levels:
        if _meets_budget_in_time(best, slowest):
            break
        tried = plan_at(level, in_bytes)
        if _shortfall_then_step(tried) < _shortfall_then_step(best):
            best = tried
        elif best.planned.budget_shortfall or _unbeatable(best, tried):
            break
    return best


def _lowest_peak_in_time(
    plan_at: PlanAt, options: OffloadOptions, levels: Sequence[float], stock: PlannedChunk
) -> PlannedChunk:
    """``auto``'s plan predicting the lowest peak within the tolerance of the stock
    split's step with nothing moved."""
    best = stock
    slowest = stock.planned.prediction.baseline_seconds * (1 + options.stall_tolerance)
    for level in levels:
        tried = plan_at(level)
        prediction = tried.planned.prediction
        if prediction.baseline_seconds > slowest:
            break
        if prediction.step_seconds <= slowest and prediction.peak_bytes < _peak(best):
            best = tried
    return best


def _peak(planned: PlannedChunk) -> int:
    return planned.planned.prediction.peak_bytes


def _meets_budget_in_time(planned: PlannedChunk, slowest: float) -> bool:
    prediction = planned.planned.prediction
    return not planned.planned.budget_shortfall and prediction.step_seconds <= slowest


def _unbeatable(best: PlannedChunk, tried: PlannedChunk) -> bool:
    """Whether ``best`` meets the budget no slower than ``tried``'s split with nothing
    moved, which bounds the plans of every lower level from below (module docstring)."""
    prediction = best.planned.prediction
    floor = tried.planned.prediction.baseline_seconds
    return not best.planned.budget_shortfall and prediction.step_seconds <= floor


def _shortfall_then_step(planned: PlannedChunk) -> tuple[int, float]:
    return planned.planned.budget_shortfall, planned.planned.prediction.step_seconds
