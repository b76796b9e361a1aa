"""Order: in backward, run each kernel that frees more memory than it writes as soon as
what it needs has run.

Backward computes a linear layer's input gradient before its weight gradient, the
autograd formula's order, so the saved input that the weight gradient reads for the last
time is still alive while the input gradient is allocated. Inductor's peak-memory
reordering would swap the two, but offload_pass turns that reordering off in graphs that
hold transfers (it would sink each reload to its first use), and there the graph's order
is the order the code runs in. So the graph is put in that order here, before the cost
model reads it, and the plan is made for the order that runs.

Only kernels that Inductor cannot fuse move (matrix products, attention and the like),
each with the view ops that feed only it. A kernel moves no earlier than its inputs, the
other kernels reading the storages it frees, and the last side-effecting node or graph
input before it. Its inputs are then freed earlier and its smaller output written
earlier, so memory is lower or equal at every point in between.
"""

from __future__ import annotations

import collections
import dataclasses

import torch.fx

from offload_pass.graphs import (
    ChunkGraphs,
    is_fusible,
    is_view,
    kernels_reading,
    materializes,
    storage_root,
    tensor_bytes,
    tensor_values,
)


def free_memory_early(backward: torch.fx.GraphModule, resident: frozenset[str]) -> None:
    """Reorder ``backward`` in place (see the module docstring). ``resident`` names the
    inputs that stay alive whatever backward does: parameters and the batch."""
    nodes = list(backward.graph.nodes)
    order = _schedule(nodes, _early_kernels(nodes, resident))
    if order != nodes:
        _apply_order(backward.graph, order)
        backward.graph.lint()
        backward.recompile()


def resident_inputs(chunk: ChunkGraphs) -> frozenset[str]:
    """Backward's inputs that alias a forward input."""
    received = chunk.saved_values_by_input()
    return frozenset(
        node.name for node, value in received.items() if storage_root(value).op == "placeholder"
    )


@dataclasses.dataclass(frozen=True)
class _EarlyKernel:
    """A kernel to run early, with the view ops that feed only it, once ``needs`` ran."""

    members: tuple[torch.fx.Node, ...]
    needs: frozenset[torch.fx.Node]


def _early_kernels(
    nodes: list[torch.fx.Node], resident: frozenset[str]
) -> dict[torch.fx.Node, _EarlyKernel]:
    position = {n: i for i, n in enumerate(nodes)}
    readers = _storage_readers(nodes)
    found = {}
    barrier = nodes[0]
    for node in nodes:
        if node.op == "placeholder" or node.is_impure():
            barrier = node
            continue
        if node.op != "call_function" or is_fusible(node) or not materializes(node):
            continue
        members = _with_feeding_views(node, position)
        freed = _freed_storages(members, readers, resident, position)
        if _frees_more_than_it_writes(node, freed):
            needs = _prerequisites(members, freed, readers) | {barrier}
            found[node] = _EarlyKernel(tuple(members), frozenset(needs))
    return found


def _schedule(
    nodes: list[torch.fx.Node], early: dict[torch.fx.Node, _EarlyKernel]
) -> list[torch.fx.Node]:
    """The graph's order, except that each early kernel runs once what it needs has."""
    waiting_on: dict[torch.fx.Node, list[torch.fx.Node]] = collections.defaultdict(list)
    for kernel, entry in early.items():
        for need in entry.needs:
            waiting_on[need].append(kernel)
    unmet = {kernel: len(entry.needs) for kernel, entry in early.items()}
    deferred = {m for entry in early.values() for m in entry.members}
    order: list[torch.fx.Node] = []

    def place(node: torch.fx.Node) -> None:
        ready = collections.deque([node])
        while ready:
            placed = ready.popleft()
            order.append(placed)
            for kernel in waiting_on.pop(placed, ()):
                unmet[kernel] -= 1
                if unmet[kernel] == 0:
                    ready.extend(early[kernel].members)

    for node in nodes:
        if node not in deferred:
            place(node)
    return order


def _storage_readers(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, set[torch.fx.Node]]:
    """For each storage, the kernels that read it (the output node if it is returned)."""
    kernels: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}
    readers: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for node in nodes:
        if is_view(node):
            continue
        for arg in node.all_input_nodes:
            readers.setdefault(storage_root(arg), set()).update(kernels_reading(node, kernels))
    return readers


def _with_feeding_views(
    kernel: torch.fx.Node, position: dict[torch.fx.Node, int]
) -> list[torch.fx.Node]:
    """The kernel and the view ops whose every user is in this list, in graph order."""
    members = {kernel}
    pending = list(kernel.all_input_nodes)
    while pending:
        node = pending.pop()
        if is_view(node) and node not in members and set(node.users) <= members:
            members.add(node)
            pending.extend(node.all_input_nodes)
    return sorted(members, key=position.__getitem__)


def _freed_storages(
    members: list[torch.fx.Node],
    readers: dict[torch.fx.Node, set[torch.fx.Node]],
    resident: frozenset[str],
    position: dict[torch.fx.Node, int],
) -> set[torch.fx.Node]:
    """The storages the kernel (the last member) reads last: each is freed once it ran.
    (Sizes that views take are values, not storages.)"""
    kernel = members[-1]
    roots = {storage_root(a) for m in members for a in m.all_input_nodes}
    return {
        root
        for root in roots
        if root in readers
        and root.name not in resident
        and max(readers[root], key=position.__getitem__) is kernel
    }


def _frees_more_than_it_writes(kernel: torch.fx.Node, freed: set[torch.fx.Node]) -> bool:
    written = sum(tensor_bytes(v) for v in tensor_values(kernel.meta.get("val")))
    return sum(tensor_bytes(r.meta.get("val")) for r in freed) > written


def _prerequisites(
    group: list[torch.fx.Node],
    freed: set[torch.fx.Node],
    readers: dict[torch.fx.Node, set[torch.fx.Node]],
) -> set[torch.fx.Node]:
    """The group's inputs, and the other kernels reading what it frees, so that it stays
    their last reader."""
    inputs = {a for m in group for a in m.all_input_nodes}
    others = {r for root in freed for r in readers[root]}
    return (inputs | others) - set(group)


def _apply_order(graph: torch.fx.Graph, order: list[torch.fx.Node]) -> None:
    previous = order[0]
    for node in order[1:]:
        if previous.next is not node:
            previous.append(node)
        previous = node
