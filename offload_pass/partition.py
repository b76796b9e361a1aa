"""The partition step: the stock min-cut partitioner, then order, analyse, plan and
rewrite."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from offload_pass import _compat, dump
from offload_pass.analysis import ChunkGraphs, find_saved_groups
from offload_pass.costs import estimate_costs
from offload_pass.options import FractionRule, OffloadOptions
from offload_pass.order import free_memory_early, resident_inputs
from offload_pass.plan import Plan
from offload_pass.planner import Request, placements, plan_offloads
from offload_pass.profiles import profile_for
from offload_pass.rewrite import insert_transfers


def offload_chunk(chunk: ChunkGraphs, options: OffloadOptions, name: str) -> Plan:
    groups = find_saved_groups(chunk)
    profile = profile_for(options.profile, chunk.device())
    costs = estimate_costs(chunk, profile)
    rule = FractionRule.current(options)
    request = Request(
        owners={g.root: rule.resolve(g.module_stack) for g in groups},
        min_bytes=options.min_bytes,
        stall_tolerance=options.stall_tolerance,
        memory_budget=options.memory_budget,
        in_flight=options.in_flight_microbatches,
    )
    planned = plan_offloads(groups, costs, request)
    if planned.budget_shortfall:
        warnings.warn(
            f"offload_pass: {name} cannot meet memory_budget={planned.budget_bytes:,} bytes; "
            f"moving every candidate, its predicted peak is {planned.budget_shortfall:,} "
            "bytes over",
            stacklevel=2,
        )
    moved = [d.group for d in planned.decisions if d.moved]
    placed = placements(planned.transfers, chunk.forward.graph, chunk.backward.graph)
    insert_transfers(chunk, moved, placed)
    return Plan(name, costs, planned, placed, chunk.forward, chunk.backward)


class OffloadPartitioner(_compat.PartitionerBase):
    """Usable as Inductor's ``custom_partitioner_fn`` and as AOTAutograd's partition_fn."""

    def __init__(self, options: OffloadOptions, name: str, on_plan: Callable[[Plan], None]) -> None:
        self.options = options
        self.name = name
        self.on_plan = on_plan

    def __call__(
        self, joint: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        forward, backward = _compat.stock_partition(
            joint, joint_inputs, self.options.recompute_budget, **kwargs
        )
        chunk = ChunkGraphs(forward, backward, kwargs["num_fwd_outputs"])
        free_memory_early(backward, resident_inputs(chunk))
        plan = offload_chunk(chunk, self.options, self.name)
        dump.record(plan, dump.dump_dir(self.options.dump_dir))
        self.on_plan(plan)
        return forward, backward

    def uuid(self) -> None:
        return None
