"""Recomputed values that Inductor would write out and hold through backward.

Under a recompute budget below 1 the partitioner lifts its bans on long chains of
pointwise ops and prices recomputing them as free. A residual stream rebuilt in backward
from saved matrix-product outputs is such a chain: each block's backward reads its own
link, and the last block's backward, which runs first, needs the whole chain. Inductor
computes a pointwise value inside each kernel that reads it only while doing so reads at
most ``realize_reads_threshold`` buffers. Past that, where several kernels read it, the
value is written out once, by the kernel that computes the chain at backward's start, and
held until its last reader: one value per block that no cost model over the graph sees
(W1's first backward kernel wrote six float32 residual-stream values, 768 MiB).

The partition stage asks the partitioner to save such values instead. Saved, they are
visible to the plan, which can keep or move them like any other.
"""

from __future__ import annotations

import itertools

import torch.fx

from offload_pass.graphs import ChunkGraphs, consumers, is_fusible, is_view, storage_root


def _inlined_reads(
    node: torch.fx.Node, reads: dict[torch.fx.Node, frozenset[torch.fx.Node]]
) -> frozenset[torch.fx.Node]:
    """The buffers computing ``node`` inside its readers would read: through the
    recomputed pointwise values it is made of, down to values written to memory."""
    found: set[torch.fx.Node] = set()
    for arg in node.all_input_nodes:
        root = storage_root(arg)
        found |= reads.get(root, {root})
    return frozenset(found)


def held_recomputations(graphs: ChunkGraphs, reads_threshold: int) -> frozenset[str]:
    """The names of the values ``graphs`` recomputes in backward that Inductor would write
    out and hold across a kernel that cannot fuse: pointwise, read only by pointwise ops
    (so a graph-level model computes them in each reader), with readers on both sides of
    such a kernel, and more than ``reads_threshold`` buffers to read if inlined. A value
    held is written out, so what is computed from it reads it as one buffer: along a
    chain, every few links are held (as Inductor writes them), and a dtype conversion of
    a held link is not held itself.

    A recomputed value is one computed in both graphs; the partitioner copies each node of
    the joint graph under its own name, so the names are the joint graph's."""
    computed_in_forward = {n.name for n in graphs.forward.graph.nodes if n.op == "call_function"}
    nodes = list(graphs.backward.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    kernels_before = list(itertools.accumulate((_cannot_fuse(n) for n in nodes), initial=0))
    reads: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}
    held = set()
    for node in nodes:
        if node.name not in computed_in_forward or not is_fusible(node) or is_view(node):
            continue
        reads[node] = _inlined_reads(node, reads)
        readers = consumers(node)
        if not readers or not all(is_fusible(r) for r in readers):
            continue
        first, last = min(map(position.get, readers)), max(map(position.get, readers))
        if len(reads[node]) > reads_threshold and kernels_before[last] > kernels_before[first]:
            held.add(node.name)
            reads[node] = frozenset((node,))  # written out: what reads it reads one buffer
    return frozenset(held)


def _cannot_fuse(node: torch.fx.Node) -> bool:
    """A kernel of its own that pointwise work cannot fuse into (a matrix product,
    attention, a collective)."""
    return node.op == "call_function" and not is_fusible(node) and not is_view(node)
