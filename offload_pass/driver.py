"""The pass on one partitioned chunk, stage by stage:

    order    backward runs each kernel that frees memory as soon as it can   (order.py)
    analyse  the storages forward saves, and which of them may move           (analysis.py)
    costs    what each node takes in time, and when memory is held            (costs.py)
    plan     which storages move, and where each transfer op goes             (planner.py)
    bucket   moves placed close together share one op each way                (bucket.py)
    rewrite  the transfer ops, inserted into both graphs                      (rewrite.py)

Each stage reads the data the ones before it made; only ``order`` and ``rewrite`` edit
the graphs. :func:`plan_chunk` runs the stages up to the rewrite, so that several
partitions of one graph can be planned and one kept (joint.py); :func:`rewrite_chunk`
rewrites the one kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from offload_pass import _compat
from offload_pass.analysis import SavedGroup, find_saved_groups
from offload_pass.blocks import Split
from offload_pass.bucket import bucket_transfers
from offload_pass.calibration import profile_for
from offload_pass.costs import ChunkCosts, estimate_costs, node_seconds
from offload_pass.graphs import ChunkGraphs, forward_device
from offload_pass.options import FractionRule, OffloadOptions
from offload_pass.order import free_memory_early, resident_inputs
from offload_pass.plan import Plan
from offload_pass.planner import ChunkPlan, Request, plan_offloads
from offload_pass.profiles import UNMEASURED, DeviceProfile, HostScale
from offload_pass.rewrite import insert_transfers
from offload_pass.timing import alone_timer_for, timer_for


def request_for(
    groups: Sequence[SavedGroup], options: OffloadOptions, rule: FractionRule
) -> Request:
    """What the planner is asked, from the options and the shares ``rule`` gives."""
    return Request(
        owners={g.root: rule.resolve(g.module_stack) for g in groups},
        min_bytes=options.min_bytes,
        stall_tolerance=options.stall_tolerance,
        memory_budget=options.memory_budget,
        in_flight=options.in_flight_microbatches,
    )


def planning_profile(
    options: OffloadOptions, device: torch.device, host_scale: HostScale = UNMEASURED
) -> DeviceProfile:
    """The rates ``device`` runs the chunk at: ``options.profile``'s, its host costs
    times ``host_scale`` where the host was measured (``host_clock``), changed as CUDA
    graphs change them where the Inductor compile in progress captures them."""
    profile = profile_for(options.profile, device)
    if host_scale != UNMEASURED:
        profile = profile.with_host_measured(host_scale)
    captured = options.compiler == "inductor" and _compat.inductor_captures_around_transfers()
    return profile.under_cuda_graphs() if captured else profile


def recompute_pricing(
    options: OffloadOptions, joint: torch.fx.GraphModule
) -> Callable[[torch.fx.Node], float]:
    """What recomputing each node of ``joint`` costs, as the cost model prices the node
    (its time measured alone on the CUDA device present, else its FLOPs or traffic over
    the profile's rates): what the partitioner weighs, under a recompute budget, in
    choosing which values to compute again in backward rather than save, so that the
    recomputation planned and the one simulated are priced alike. The profile is resolved
    at the first node priced: a split under no recompute budget prices none."""
    device = forward_device(joint)

    @functools.cache
    def pricing() -> Callable[[torch.fx.Node], float]:
        profile = profile_for(options.profile, device)
        timer = alone_timer_for(options.profile, device)
        return functools.partial(node_seconds, profile=profile, timer=timer)

    return lambda node: pricing()(node)


class _StageClock:
    """Seconds each stage of one chunk's pass took, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class PlannedChunk:
    """One partition of a chunk, planned and not yet rewritten. ``split``: how the
    partitioner made it; ``stage_seconds``: what each stage took so far."""

    chunk: ChunkGraphs
    costs: ChunkCosts
    planned: ChunkPlan
    stage_seconds: Mapping[str, float]
    split: Split = Split()


def plan_chunk(
    chunk: ChunkGraphs,
    options: OffloadOptions,
    rule: FractionRule,
    host_scale: HostScale = UNMEASURED,
) -> PlannedChunk:
    """Every stage but the rewrite on ``chunk`` (``order`` edits its backward in place).
    ``rule``: the shares in force when the graph began to compile; ``host_scale``: the
    host's measured price over the profile's (``host_clock``)."""
    clock = _StageClock()
    with clock.stage("order"):
        free_memory_early(chunk.backward, resident_inputs(chunk))
    with clock.stage("analyse"):
        groups = find_saved_groups(chunk)
    with clock.stage("costs"):
        device = chunk.device()
        nodes = [*chunk.forward.graph.nodes, *chunk.backward.graph.nodes]
        timer = timer_for(options.profile, device, nodes)
        costs = estimate_costs(chunk, planning_profile(options, device, host_scale), timer)
    with clock.stage("plan"):
        request = request_for(groups, options, rule)
        planned = plan_offloads(groups, costs, request)
    with clock.stage("bucket"):
        planned = bucket_transfers(planned, costs, request.stall_tolerance, request.in_flight)
    return PlannedChunk(chunk, costs, planned, clock.seconds)


def rewrite_chunk(planned: PlannedChunk, name: str) -> Plan:
    """Insert the planned transfers into the chunk's graphs; the plan made."""
    if planned.planned.budget_shortfall:
        warnings.warn(
            f"offload_pass: {name} cannot meet memory_budget={planned.planned.budget_bytes:,} "
            f"bytes; its predicted peak is {planned.planned.budget_shortfall:,} bytes over",
            stacklevel=2,
        )
    clock = _StageClock()
    with clock.stage("rewrite"):
        moved = [d.group for d in planned.planned.decisions if d.moved]
        insert_transfers(planned.chunk, moved, planned.planned.transfers)
    chunk = planned.chunk
    return Plan(
        name,
        planned.costs,
        planned.planned,
        chunk.forward,
        chunk.backward,
        {**planned.stage_seconds, **clock.seconds},
        planned.split.recompute_budget,
        planned.split.checkpointed,
        planned.split.recomputed,
    )


def offload_chunk(
    chunk: ChunkGraphs, options: OffloadOptions, rule: FractionRule, name: str
) -> Plan:
    """Every stage on ``chunk``, rewriting its graphs in place; the plan made."""
    return rewrite_chunk(plan_chunk(chunk, options, rule), name)
