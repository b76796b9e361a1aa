"""Whole blocks that backward computes again from their inputs: checkpointing, chosen by
the pass.

Deep models repeat one block (a decoder layer, an encoder layer) as children of one
module. Checkpointing a block saves what enters it and computes the rest again in
backward, one block at a time: the memory of many blocks' activations for the compute of
one more forward of each. The joint search (joint.py) weighs that against moving and
against the partitioner's own knapsack; what a checkpointed split still saves, the
blocks' inputs among it, the planner may move as it moves any saved value. The
partitioner makes the split: each block's forward nodes of the joint graph carry the
selective-checkpointing policy it honours, each block its own region, so that it saves
the values that pass from one block to the next (``_compat.partitioner_policies``).
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.fx

from offload_pass import _compat


@dataclasses.dataclass(frozen=True)
class Split:
    """How the partitioner splits a chunk's joint graph between forward and backward.

    ``recompute_budget``: torch's ``activation_memory_budget`` (None: torch's setting);
    ``checkpointed``: the module paths of the blocks backward computes again whole;
    ``recomputed``: the joint graph's nodes that backward computes again one by one, saved
    values of another split and the nodes they are computed from
    (:mod:`offload_pass.recomputation`); ``saved``: the nodes those are computed from that
    cannot be computed again, saved in their place."""

    recompute_budget: float | None = None
    checkpointed: tuple[str, ...] = ()
    recomputed: tuple[str, ...] = ()
    saved: tuple[str, ...] = ()


def find_blocks(joint: torch.fx.GraphModule, num_forward_outputs: int) -> tuple[str, ...]:
    """The module paths of the repeated blocks of ``joint``'s forward (what its first
    ``num_forward_outputs`` outputs need), in the order forward runs them: the children
    of one module that share a class and hold modules of their own, at least two, of the
    module whose such children hold the most forward nodes. Empty where nothing
    repeats."""
    nodes_by_family: collections.Counter[tuple[str, str]] = collections.Counter()
    children: dict[tuple[str, str], dict[str, None]] = collections.defaultdict(dict)
    containers: set[str] = set()
    for node in forward_nodes(joint, num_forward_outputs):
        stack = _compat.module_classes(node)
        containers.update(path for path, _ in stack[:-1])
        for path, kind in stack:
            family = (_parent(path), kind)
            nodes_by_family[family] += 1
            children[family][path] = None
    repeated = [
        family
        for family, paths in children.items()
        if len(paths) >= 2 and containers.issuperset(paths)
    ]
    if not repeated:
        return ()
    return tuple(children[max(repeated, key=nodes_by_family.__getitem__)])


def recomputed_regions(
    joint: torch.fx.GraphModule, num_forward_outputs: int, checkpointed: tuple[str, ...]
) -> dict[str, int]:
    """The forward nodes of ``joint`` (whose first ``num_forward_outputs`` outputs are
    forward's) inside the blocks named ``checkpointed``, each with
    its block's place among them: what backward computes again. Not the blocks' outputs
    that forward reads outside them or returns: as with torch's own checkpointing, the
    partitioner may save those (computed again, the last block's output would be
    computed at the start of backward, where the loss's gradients peak). Those that draw
    random numbers are marked too: the partitioner saves the generator's state for them
    in forward and draws again from it in backward."""
    region = {path: i for i, path in enumerate(checkpointed)}
    forward = forward_nodes(joint, num_forward_outputs)
    inside: dict[torch.fx.Node, int] = {}
    for node in forward:
        paths = [path for path, _ in _compat.module_classes(node) if path in region]
        if paths:
            inside[node] = region[paths[0]]
    outside = {*set(forward).difference(inside), joint.graph.output_node()}
    read_outside = {node for node in inside if not outside.isdisjoint(node.users)}
    return {node.name: i for node, i in inside.items() if node not in read_outside}


def forward_nodes(joint: torch.fx.GraphModule, num_forward_outputs: int) -> list[torch.fx.Node]:
    """The computing nodes of the joint graph that forward's outputs (the first
    ``num_forward_outputs``) need, in graph order."""
    outputs = joint.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, list | tuple) else [outputs]
    pending = [n for n in outputs[:num_forward_outputs] if isinstance(n, torch.fx.Node)]
    needed: set[torch.fx.Node] = set()
    while pending:
        node = pending.pop()
        if node not in needed:
            needed.add(node)
            pending.extend(node.all_input_nodes)
    return [n for n in joint.graph.nodes if n in needed and n.op == "call_function"]


def _parent(path: str) -> str:
    return path.rpartition(".")[0]
