"""The record of what the pass did to one compiled chunk, and what it predicts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.fx

from offload_pass.costs import ChunkCosts
from offload_pass.ops import OFFLOAD, RELOAD
from offload_pass.planner import ChunkPlan, Decision
from offload_pass.profiles import DeviceProfile
from offload_pass.report import format_plan
from offload_pass.simulate import CopyPrediction, Prediction


@dataclasses.dataclass(frozen=True)
class Plan:
    """One chunk's decisions, transfers, prediction and rewritten graphs.

    ``forward`` and ``backward`` are the graphs as rewritten, before the compiler
    lowers them; ``print(plan.forward.code)`` shows every offload, wait and reload.
    ``print(plan)`` shows the report (see :mod:`offload_pass.report`).
    ``stage_seconds``: what each stage of the pass took on this chunk (order, analyse,
    costs, plan, bucket, rewrite; under a memory budget also ``search``, the splits tried
    and not kept), the compile time the pass adds before the compiler's own.
    ``recompute_budget``: the partitioner's ``activation_memory_budget`` the graphs were
    split under (None: torch's setting), and ``checkpointed_blocks`` the module paths of
    the blocks backward computes again whole, chosen by the options or by the joint
    search (:mod:`offload_pass.joint`); ``recomputed_nodes`` the forward nodes the search
    chose to compute again in backward one by one: values the split without them saves,
    and the nodes they are computed from (:mod:`offload_pass.recomputation`).
    """

    chunk: str
    costs: ChunkCosts
    planned: ChunkPlan
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    stage_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    recompute_budget: float | None = None
    checkpointed_blocks: tuple[str, ...] = ()
    recomputed_nodes: tuple[str, ...] = ()

    @property
    def split_name(self) -> str:
        """How the graphs were split, in short: the partitioner's level ("stock" for
        torch's setting), then the blocks checkpointed and the nodes recomputed one by
        one, if any: ``"0.8"``, ``"stock, 8 blocks"``, ``"stock, 116 nodes"``."""
        level = "stock" if self.recompute_budget is None else f"{self.recompute_budget:g}"
        blocks = f", {len(self.checkpointed_blocks)} blocks" if self.checkpointed_blocks else ""
        nodes = f", {len(self.recomputed_nodes)} nodes" if self.recomputed_nodes else ""
        return level + blocks + nodes

    @property
    def profile(self) -> DeviceProfile:
        return self.costs.profile

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return self.planned.decisions

    @property
    def prediction(self) -> Prediction:
        return self.planned.prediction

    @property
    def moved(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.moved)

    @property
    def bytes_moved(self) -> int:
        return sum(d.group.nbytes for d in self.moved)

    @property
    def offload_ops(self) -> int:
        """Offload ops in the rewritten forward; each moves one bucket of storages."""
        return sum(1 for n in self.forward.graph.nodes if n.target is OFFLOAD)

    @property
    def reload_ops(self) -> int:
        """Reload ops in the rewritten backward; each moves one bucket of storages."""
        return sum(1 for n in self.backward.graph.nodes if n.target is RELOAD)

    @property
    def bytes_saved_for_backward(self) -> int:
        return sum(d.group.nbytes for d in self.decisions)

    def copies_by_root(self) -> dict[str, CopyPrediction]:
        return {c.root: c for c in self.prediction.copies}

    def __str__(self) -> str:
        return format_plan(self)
