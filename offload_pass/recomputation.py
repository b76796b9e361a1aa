"""Per-value recomputation: which saved values backward computes again, one by one.

The partitioner's knapsack (a recompute level) and whole checkpointed blocks recompute
what they choose, weighing bytes, not the plan. Once a split is planned, the plan shows
what each saved storage costs: kept, it holds its bytes to backward; moved, it costs the
copy queues' time, and compute's where they cannot keep up; computed again, it costs the
time of its producer and of the nodes between it and what the split saves, as the cost
model prices them. Those nodes are marked with it: marked alone, it would leave the
partitioner free to save one of them in its place (a norm's output reads an upcast the
split does not save). The joint search (joint.py) asks for the storages cheapest to
compute again per byte, as many as a shortfall or the moves' slowdown calls for and the
time allows, and plans the split with those recomputed: the simulation of that split
weighs the three choices together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.fx

from offload_pass import _compat
from offload_pass.driver import PlannedChunk


@dataclasses.dataclass(frozen=True)
class Recomputable:
    """A saved storage backward could compute again: the forward nodes to mark (those
    that name it, its producer first, then the saved views of it, then the nodes its
    producer reads, transitively, that the split does not save), the bytes recomputing
    it frees, what computing those nodes once more is predicted to take, and whether the
    plan moves it."""

    names: tuple[str, ...]
    nbytes: int
    seconds: float
    moved: bool


def recomputable(planned: PlannedChunk) -> tuple[Recomputable, ...]:
    """The storages ``planned`` saves that backward may compute again, in the order
    forward makes them: those the planner may move whose computation from what the split
    saves (or the graph's inputs) runs ops that return one tensor each and draw no random
    numbers (computed again, they would draw others). Computed from what is saved anyway,
    a storage frees all its bytes; its price is the time of the nodes computed again that
    the split does not already recompute."""
    graph = planned.chunk.forward.graph
    index = {node: i for i, node in enumerate(graph.nodes)}
    nodes = {node.name: node for node in index}
    decisions = sorted(planned.planned.decisions, key=lambda d: d.group.produced_at)
    saved = {nodes[name] for d in decisions for name in (d.group.root, *d.group.members)}
    already = set(planned.split.recomputed)
    seconds = planned.costs.forward_seconds
    found = []
    for decision in decisions:
        group = decision.group
        if group.fixed_reason is not None or group.nbytes <= 0:
            continue
        members = [nodes[name] for name in dict.fromkeys((group.root, *group.members))]
        needed = _computation(nodes[group.root], saved)
        if needed is None or not all(_computable_again(node) for node in members):
            continue
        marked = tuple(dict.fromkeys(node.name for node in (*members, *needed)))
        cost = sum(seconds[index[node]] for node in needed if node.name not in already)
        found.append(Recomputable(marked, group.nbytes, cost, decision.moved))
    return tuple(found)


Order = Callable[[Sequence[Recomputable]], list[Recomputable]]
"""An order in which to take candidates for recomputation."""


def first_made_first(candidates: Sequence[Recomputable]) -> list[Recomputable]:
    """``candidates`` (in the order forward makes them) cheapest per byte first, and among
    equals, the first made first: the last made, needed first in backward, stay saved."""
    return sorted(candidates, key=_price)


def last_made_first(candidates: Sequence[Recomputable]) -> list[Recomputable]:
    """``candidates`` (in the order forward makes them) cheapest per byte first, and among
    equals, the last made first: the first made, with the longest copy windows, stay
    saved to be moved, and are not computed again where backward ends, beside its
    gradients."""
    return sorted(reversed(candidates), key=_price)


def _price(candidate: Recomputable) -> float:
    return candidate.seconds / candidate.nbytes


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


def _computation(
    value: torch.fx.Node, saved: set[torch.fx.Node]
) -> tuple[torch.fx.Node, ...] | None:
    """``value`` and the nodes it reads, transitively, short of ``saved`` and the graph's
    inputs: what backward computes to have ``value`` again. None where one of them
    cannot be computed again."""
    needed: dict[torch.fx.Node, None] = {}
    pending = [value]
    while pending:
        node = pending.pop()
        if node in needed:
            continue
        if not _computable_again(node):
            return None
        needed[node] = None
        pending.extend(
            read for read in node.all_input_nodes if read.op != "placeholder" and read not in saved
        )
    return tuple(needed)
