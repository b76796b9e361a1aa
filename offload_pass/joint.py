"""Joint planning of a memory budget: recompute where moving alone is too slow.

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
from offload_pass.options import FractionRule, OffloadOptions

RECOMPUTE_LEVELS = (0.8, 0.6, 0.4, 0.2)
"""The partitioner budgets a memory budget's search may try, those below torch's setting."""

Partition = Callable[[float | None], ChunkGraphs]
"""The chunk's forward and backward graphs, split under a recompute budget (None: torch's
setting)."""


def search_levels(options: OffloadOptions, joint: torch.fx.GraphModule) -> tuple[float, ...]:
    """The recompute budgets the search may try on ``joint``: the levels below the
    partitioner's own setting, under a memory budget. None where the options fix the
    split, where the graph's nodes carry their own budget (the partitioner takes it over
    any setting, so every split would be the same), or where the partitioner agrees its
    choices across ranks (each split a collective, which ranks planning differently would
    call a different number of times)."""
    if options.memory_budget is None or options.recompute_budget is not None:
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
    start = time.perf_counter()
    best = stock = _planned(partition, options.recompute_budget, options, rule, host_scale)
    if not levels:
        return stock
    seconds: dict[float | None, float] = {None: time.perf_counter() - start}
    slowest = stock.planned.prediction.baseline_seconds * (1 + options.stall_tolerance)
    # a share of the stock peak, in bytes, for every split (at least one: bytes must be)
    in_bytes = dataclasses.replace(options, memory_budget=max(1, stock.planned.budget_bytes))
    for level in levels:
        if _meets_budget_in_time(best, slowest):
            break
        start = time.perf_counter()
        tried = _planned(partition, level, in_bytes, rule, host_scale)
        seconds[level] = time.perf_counter() - start
        if _shortfall_then_step(tried) < _shortfall_then_step(best):
            best = tried
        elif best.planned.budget_shortfall or _unbeatable(best, tried):
            break
    searched = sum(s for level, s in seconds.items() if level != best.recompute_budget)
    return dataclasses.replace(best, stage_seconds={**best.stage_seconds, "search": searched})


def _planned(
    partition: Partition,
    level: float | None,
    options: OffloadOptions,
    rule: FractionRule,
    host_scale: float,
) -> PlannedChunk:
    planned = plan_chunk(partition(level), options, rule, host_scale)
    return dataclasses.replace(planned, recompute_budget=level)


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
