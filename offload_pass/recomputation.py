"""Per-value recomputation: which saved values backward computes again, one by one.

The partitioner's knapsack (a recompute level) and whole checkpointed blocks recompute
what they choose, weighing bytes, not the plan. Once a split is planned, the plan shows
what each saved storage costs: kept, it holds its bytes to backward; moved, it costs the
copy queues' time, and compute's where they cannot keep up; computed again, it costs the
time of its producer and of the nodes between it and what the split saves, as the cost
model prices them. Those nodes are marked with it: marked alone, it would leave the
partitioner free to save one of them in its place (a norm's output reads an upcast the
split does not save). Where that computation reaches a node that cannot be computed
again (one result of a multi-output op, such as a norm's mean and variance, or a draw of
random numbers), the split saves that node in its place, and the storage frees its bytes
less that node's. The joint search (joint.py) asks for the storages cheapest to
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
from offload_pass.blocks import Split
from offload_pass.driver import PlannedChunk
from offload_pass.graphs import storage_root, tensor_bytes


@dataclasses.dataclass(frozen=True)
class Recomputable:
    """A saved storage backward could compute again: the forward nodes to mark (those
    that name it, its producer first, then the saved views of it, then the nodes its
    producer reads, transitively, that the split does not save), the nodes those read
    that cannot be computed again and that the split would save in its place
    (``saved``), the bytes recomputing it frees (its own, less those of the storages
    newly saved), what computing the marked nodes once more is predicted to take, and
    whether the plan moves it."""

    names: tuple[str, ...]
    nbytes: int
    seconds: float
    moved: bool
    saved: tuple[str, ...] = ()


def recomputable(planned: PlannedChunk) -> tuple[Recomputable, ...]:
    """The storages ``planned`` saves that backward may compute again, in the order
    forward makes them: those the planner may move, made and viewed by ops that return
    one tensor each and draw no random numbers (computed again, they would draw others),
    that free bytes computed from what the split saves, the graph's inputs and the nodes
    saved in their place. Their price is the time of the nodes computed again that the
    split does not already recompute."""
    graph = planned.chunk.forward.graph
    index = {node: i for i, node in enumerate(graph.nodes)}
    nodes = {node.name: node for node in index}
    decisions = sorted(planned.planned.decisions, key=lambda d: d.group.produced_at)
    saved = {nodes[name] for d in decisions for name in (d.group.root, *d.group.members)}
    saved_storages = {storage_root(node) for node in saved}
    already = set(planned.split.recomputed)
    seconds = planned.costs.forward_seconds
    found = []
    for decision in decisions:
        group = decision.group
        if group.fixed_reason is not None or group.nbytes <= 0:
            continue
        members = [nodes[name] for name in dict.fromkeys((group.root, *group.members))]
        computation = _computation(nodes[group.root], saved)
        if computation is None or not all(_computable_again(node) for node in members):
            continue
        needed, kept = computation
        newly_saved = {storage_root(node) for node in kept} - saved_storages
        nbytes = group.nbytes - sum(tensor_bytes(node.meta["val"]) for node in newly_saved)
        if nbytes <= 0:
            continue
        marked = tuple(dict.fromkeys(node.name for node in (*members, *needed)))
        cost = sum(seconds[index[node]] for node in needed if node.name not in already)
        kept_names = tuple(node.name for node in kept)
        found.append(Recomputable(marked, nbytes, cost, decision.moved, kept_names))
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


def saving_nothing_more(candidates: Sequence[Recomputable]) -> list[Recomputable]:
    """Of ``candidates``, those computed from what the split saves already, in
    :func:`first_made_first`'s order. A value computed from what it newly saves (a norm's
    output from its statistics) can be computed again where backward peaks: on W1 under
    6.69 GiB, block 0's norms recomputed beside its attention's backward left every plan
    at the lowest peak moving 4.4 GiB, where these alone left one moving 1.3 GiB."""
    return first_made_first([candidate for candidate in candidates if not candidate.saved])


def _price(candidate: Recomputable) -> float:
    return candidate.seconds / candidate.nbytes


def cheapest(
    candidates: Sequence[Recomputable], nbytes: float, seconds: float
) -> tuple[Recomputable, ...]:
    """The first ``candidates`` whose bytes reach ``nbytes``, stopping before the first
    whose time would take their total past ``seconds``."""
    taken: list[Recomputable] = []
    taken_bytes, taken_seconds = 0, 0.0
    for candidate in candidates:
        if taken_bytes >= nbytes or taken_seconds + candidate.seconds > seconds:
            break
        taken.append(candidate)
        taken_bytes += candidate.nbytes
        taken_seconds += candidate.seconds
    return tuple(taken)


def recomputing(split: Split, taken: Sequence[Recomputable]) -> Split:
    """``split`` with the storages ``taken`` computed again in backward, and the nodes
    they are computed from that cannot be computed again saved."""
    recomputed = (*split.recomputed, *(name for value in taken for name in value.names))
    saved = (*split.saved, *(name for value in taken for name in value.saved))
    return dataclasses.replace(
        split, recomputed=tuple(dict.fromkeys(recomputed)), saved=tuple(dict.fromkeys(saved))
    )


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
) -> tuple[tuple[torch.fx.Node, ...], tuple[torch.fx.Node, ...]] | None:
    """What backward computes to have ``value`` again: ``value`` and the nodes it reads,
    transitively, short of ``saved``, the graph's inputs and the nodes that cannot be
    computed again; and those nodes, which would be saved in its place. None where
    ``value`` cannot be computed again, or one of those nodes is not a tensor (a
    multi-output op read whole)."""
    needed: dict[torch.fx.Node, None] = {}
    kept: dict[torch.fx.Node, None] = {}
    pending = [value]
    while pending:
        node = pending.pop()
        if node in needed or node in kept:
            continue
        if not _computable_again(node):
            if node is value or not isinstance(node.meta.get("val"), torch.Tensor):
                return None
            kept[node] = None
            continue
        needed[node] = None
        pending.extend(
            read for read in node.all_input_nodes if read.op != "placeholder" and read not in saved
        )
    return tuple(needed), tuple(kept)
