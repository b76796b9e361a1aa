"""Per-value recomputation: which saved values backward computes again, one by one.

The partitioner's knapsack (a recompute level) and whole checkpointed blocks recompute
what they choose, weighing bytes, not the plan. Once a split is planned, the plan shows
what each saved storage costs: kept, it holds its bytes to backward; moved, it costs the
copy queues' time, and compute's where they cannot keep up; computed again, it costs
its producer's time in backward, as the cost model prices that node. The joint search
(joint.py) asks for the storages cheapest to compute again per byte, as many as a
shortfall or the moves' slowdown calls for and the time allows, and plans the split with
those recomputed: the simulation of that split weighs the three choices together, what
the partitioner must save instead included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx

from offload_pass import _compat
from offload_pass.driver import PlannedChunk
from offload_pass.graphs import storage_root, tensor_bytes


@dataclasses.dataclass(frozen=True)
class Recomputable:
    """A saved storage backward could compute again: the forward nodes that name it (its
    producer first, then the saved views of it), the bytes recomputing it would free,
    what computing it once more is predicted to take, and whether the plan moves it."""

    names: tuple[str, ...]
    nbytes: int
    seconds: float
    moved: bool


def recomputable(planned: PlannedChunk) -> tuple[Recomputable, ...]:
    """The storages ``planned`` saves that backward may compute again, cheapest per byte
    freed first: those the planner may move, made and viewed by ops that return one
    tensor each and draw no random numbers (computed again, they would draw others). A
    storage frees its bytes less those of the inputs its producer reads that the split
    does not already save; one that frees none is left out."""
    nodes = {node.name: node for node in planned.chunk.forward.graph.nodes}
    saved = {nodes[d.group.root] for d in planned.planned.decisions}
    seconds = planned.costs.forward_seconds
    found = []
    for decision in planned.planned.decisions:
        group = decision.group
        names = tuple(dict.fromkeys((group.root, *group.members)))
        if group.fixed_reason is not None or not all(_computable_again(nodes[n]) for n in names):
            continue
        frees = group.nbytes - _bytes_saved_instead(nodes[group.root], saved)
        if frees > 0:
            found.append(Recomputable(names, frees, seconds[group.produced_at], decision.moved))
    return tuple(sorted(found, key=lambda r: r.seconds / r.nbytes))


def cheapest(candidates: Sequence[Recomputable], nbytes: float, seconds: float) -> tuple[str, ...]:
    """The names of the first ``candidates`` whose bytes reach ``nbytes``, stopping before
    the first whose time would take their total past ``seconds``."""
    names: list[str] = []
    taken_bytes, taken_seconds = 0, 0.0
    for candidate in candidates:
        if taken_bytes >= nbytes or taken_seconds + candidate.seconds > seconds:
            break
        names.extend(candidate.names)
        taken_bytes += candidate.nbytes
        taken_seconds += candidate.seconds
    return tuple(names)


def _computable_again(node: torch.fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and _compat.is_aten_op(target)
        and torch.Tag.nondeterministic_seeded not in target.tags
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


def _bytes_saved_instead(producer: torch.fx.Node, saved: set[torch.fx.Node]) -> int:
    """The bytes of the storages ``producer`` reads that are neither inputs of the graph
    nor among ``saved``: what the split must save instead, to compute it again."""
    read = {storage_root(node) for node in producer.all_input_nodes}
    return sum(
        tensor_bytes(node.meta.get("val"))
        for node in read
        if node.op != "placeholder" and node not in saved
    )
