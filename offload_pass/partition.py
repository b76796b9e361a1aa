"""The partition step: the stock min-cut partitioner, then analyse, plan and rewrite."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from offload_pass import _compat
from offload_pass.analysis import ChunkGraphs, find_saved_groups
from offload_pass.options import FractionRule, OffloadOptions
from offload_pass.plan import Plan
from offload_pass.planner import choose_groups, place_transfers
from offload_pass.rewrite import insert_transfers


def offload_chunk(chunk: ChunkGraphs, options: OffloadOptions, name: str) -> Plan:
    groups = find_saved_groups(chunk)
    decisions = choose_groups(groups, FractionRule.current(options), options.min_bytes)
    moved = [d.group for d in decisions if d.moved]
    placements = place_transfers(moved, chunk.forward.graph, chunk.backward.graph)
    insert_transfers(chunk, moved, placements)
    return Plan(name, decisions, placements, chunk.forward, chunk.backward)


class OffloadPartitioner(_compat.PartitionerBase):
    """Usable as Inductor's ``custom_partitioner_fn`` and as AOTAutograd's partition_fn."""

    def __init__(self, options: OffloadOptions, name: str, on_plan: Callable[[Plan], None]) -> None:
        self.options = options
        self.name = name
        self.on_plan = on_plan

    def __call__(
        self, joint: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        forward, backward = _compat.stock_partition(joint, joint_inputs, **kwargs)
        chunk = ChunkGraphs(forward, backward, kwargs["num_fwd_outputs"])
        self.on_plan(offload_chunk(chunk, self.options, self.name))
        return forward, backward

    def uuid(self) -> None:
        return None
