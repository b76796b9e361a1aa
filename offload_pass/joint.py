"""Joint planning of a memory budget: recompute where moving alone is too slow.

Offloading lowers the peak only as far as the copies hide under compute; past that,
every byte more waits on PCIe. Recomputing costs compute instead. Where the offload plan
of the stock partition does not meet ``memory_budget`` within ``stall_tolerance`` of the
step with nothing moved, the stock partitioner splits the graph again under
``RECOMPUTE_LEVELS`` in turn (torch's ``activation_memory_budget``: it recomputes in
backward what is cheapest to recompute until the saved activations fit that share), the
pass plans each split's offloads for the same budget in bytes, and the search stops at the
first plan that meets the budget within the tolerance. It keeps the plan predicted fastest
among those that meet it; where none does, the one predicted nearest. The cost model
prices the recomputed nodes in backward like any other, so one simulation compares
moving, recomputing and both. The kept plan's ``stage_seconds`` carry the seconds spent
splitting and planning the splits not kept (``"search"``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from offload_pass.driver import PlannedChunk, plan_chunk
from offload_pass.graphs import ChunkGraphs
from offload_pass.options import FractionRule, OffloadOptions

RECOMPUTE_LEVELS = (0.8, 0.6, 0.4, 0.2)
"""The partitioner budgets tried, beyond torch's own setting, when moving alone is too slow."""

Partition = Callable[[float | None], ChunkGraphs]
"""The chunk's forward and backward graphs, split under a recompute budget (None: torch's
setting)."""


def plan_jointly(partition: Partition, options: OffloadOptions, rule: FractionRule) -> PlannedChunk:
    """The planned split of the chunk: under ``options.recompute_budget`` where given; for
    a memory budget, the fastest split found that meets it (module docstring); else the
    stock split."""
    fixed = options.recompute_budget
    if options.memory_budget is None or fixed is not None:
        return plan_chunk(partition(fixed), options, rule, fixed)
    best = stock = plan_chunk(partition(None), options, rule, None)
    slowest = stock.planned.prediction.baseline_seconds * (1 + options.stall_tolerance)
    in_bytes = dataclasses.replace(options, memory_budget=stock.planned.budget_bytes)
    seconds: dict[float | None, float] = {}
    for level in RECOMPUTE_LEVELS:
        if _meets_budget_by(best, slowest):
            break
        start = time.perf_counter()
        tried = plan_chunk(partition(level), in_bytes, rule, level)
        seconds[level] = time.perf_counter() - start
        best = min(best, tried, key=_shortfall_then_step)
    searched = sum(s for level, s in seconds.items() if level != best.recompute_budget)
    return dataclasses.replace(best, stage_seconds={**best.stage_seconds, "search": searched})


def _meets_budget_by(planned: PlannedChunk, slowest: float) -> bool:
    prediction = planned.planned.prediction
    return not planned.planned.budget_shortfall and prediction.step_seconds <= slowest


def _shortfall_then_step(planned: PlannedChunk) -> tuple[int, float]:
    return planned.planned.budget_shortfall, planned.planned.prediction.step_seconds
