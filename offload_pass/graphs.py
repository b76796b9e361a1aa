"""A partitioned chunk's graphs, and what the stages read off their nodes: which nodes
are views of which storage, which ones Inductor fuses into the kernels that read them,
where a value's work really happens, and how many bytes a value holds.

Every later stage (order, analyse, cost model, rewrite) reads the graphs through these.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterator, Sequence

import torch
import torch.fx

from offload_pass import _compat


@dataclasses.dataclass(frozen=True)
class ChunkGraphs:
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    num_forward_outputs: int

    def saved_values(self) -> list[torch.fx.Node]:
        outputs = self.forward.graph.output_node().args[0]
        return list(outputs[self.num_forward_outputs :])

    def device(self) -> torch.device:
        return forward_device(self.forward)

    def user_outputs(self) -> list[torch.fx.Node]:
        outputs = self.forward.graph.output_node().args[0]
        return [n for n in outputs[: self.num_forward_outputs] if isinstance(n, torch.fx.Node)]

    def backward_inputs(self) -> dict[torch.fx.Node, torch.fx.Node]:
        """Each saved forward value that backward takes, and the backward input taking it.

        The partitioner names each backward input after the forward value it receives:
        this is the one place that relies on it.
        """
        inputs = {n.name: n for n in self.backward.graph.find_nodes(op="placeholder")}
        saved = (n for n in self.saved_values() if isinstance(n, torch.fx.Node))
        return {n: inputs[n.name] for n in saved if n.name in inputs}

    def saved_values_by_input(self) -> dict[torch.fx.Node, torch.fx.Node]:
        """Each backward input that receives a saved value, and that forward value."""
        return {received: value for value, received in self.backward_inputs().items()}


def forward_device(forward: torch.fx.GraphModule) -> torch.device:
    """The first accelerator any input of ``forward`` lives on, else the CPU."""
    for node in forward.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.device
    return torch.device("cpu")


def is_view(node: torch.fx.Node) -> bool:
    """An op whose result aliases its first input: a view op, or one element of a
    multi-output view op such as ``unbind``."""
    target = node.target
    if target is not operator.getitem and not _compat.is_view_op(target):
        return False  # most nodes: decided without reading their arguments
    args = node.args
    if node.op != "call_function" or not args or not isinstance(args[0], torch.fx.Node):
        return False
    return target is not operator.getitem or is_view(args[0])


def storage_root(node: torch.fx.Node) -> torch.fx.Node:
    while is_view(node):
        node = node.args[0]
    return node


def view_chain(node: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
    """The view ops from ``node``'s storage root down to ``node``, root side first."""
    chain = []
    while is_view(node):
        chain.append(node)
        node = node.args[0]
    return tuple(reversed(chain))


_ORDER_KEEPING_VIEWS = frozenset(
    {
        torch.ops.aten.view,
        torch.ops.aten._unsafe_view,
        torch.ops.aten.reshape,
        torch.ops.aten.squeeze,
        torch.ops.aten.unsqueeze,
        torch.ops.aten.alias,
    }
)


def keeps_element_order(node: torch.fx.Node) -> bool:
    """Whether ``node`` (a storage root, or a view of one) holds its storage's elements in
    their order: each view between them reshapes, squeezes or aliases, none permutes,
    slices or broadcasts. A kernel reading through it reads element i where a result of
    the same size writes element i."""
    chain = view_chain(node)
    return all(getattr(v.target, "overloadpacket", None) in _ORDER_KEEPING_VIEWS for v in chain)


def aliases(root: torch.fx.Node) -> Iterator[torch.fx.Node]:
    pending = [root]
    while pending:
        node = pending.pop()
        yield node
        pending.extend(user for user in node.users if is_view(user) and user.args[0] is node)


_FUSIBLE_TAGS = frozenset(_compat.fusible_tags())
_LOWERED_AS_POINTWISE = frozenset(
    {
        torch.ops.aten.gather,
        torch.ops.aten.embedding,
        torch.ops.aten.cat,
        torch.ops.aten.clone,
        torch.ops.aten.full,
        torch.ops.aten.arange,
        torch.ops.prims.iota,
        torch.ops.aten.constant_pad_nd,
        torch.ops.aten.slice_scatter,
        torch.ops.aten.select_scatter,
    }
)
"""Ops without torch's pointwise tag that Inductor lowers as pointwise all the same: each
element reads one element of an input (indexed gathers, pads, concatenations, copies) or
none (constants). The cross-entropy's ``gather`` of the log-softmax is one: that fp32
log-softmax, as large as the logits, is never written to memory."""


def is_fusible(node: torch.fx.Node) -> bool:
    """A pointwise op or reduction, or one result of one (``var_mean``'s variance, say):
    Inductor computes it inside the kernels that read it."""
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return is_fusible(node.args[0])
    if not _compat.is_aten_op(target):
        return False
    fusible = _FUSIBLE_OPS.get(target)
    if fusible is None:
        fusible = not _FUSIBLE_TAGS.isdisjoint(target.tags) or (
            target.overloadpacket in _LOWERED_AS_POINTWISE
        )
        _FUSIBLE_OPS[target] = fusible
    return fusible


_FUSIBLE_OPS: dict[object, bool] = {}
"""Whether each op overload met so far fuses: the stages ask it of every node, often."""


def consumers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes reading ``node``'s values, looking through views."""
    found = []
    for user in node.users:
        found.extend(consumers(user) if is_view(user) and user.args[0] is node else [user])
    return found


def materializes(node: torch.fx.Node) -> bool:
    """Whether the node's result is written to memory: it is not fusible, or something
    that cannot fuse reads it."""
    if node.op == "placeholder":
        return True
    if node.op != "call_function" or is_view(node):
        return False
    return not is_fusible(node) or not all(is_fusible(c) for c in consumers(node))


def kernels_reading(
    node: torch.fx.Node, known: dict[torch.fx.Node, frozenset[torch.fx.Node]]
) -> frozenset[torch.fx.Node]:
    """Where a node's work really happens: the node itself if its result is written to
    memory, else every such node it feeds (a fused node is computed again inside each
    kernel that reads it)."""
    if node not in known:
        if materializes(node) or node.op == "output":
            known[node] = frozenset((node,))
        else:
            known[node] = frozenset(k for c in consumers(node) for k in kernels_reading(c, known))
    return known[node]


_REDUCTION = getattr(torch.Tag, "reduction", None)


def _writes_tensor(node: torch.fx.Node) -> bool:
    """A value written to memory that holds a tensor (not a size computed on the host)."""
    return materializes(node) and bool(tensor_values(node.meta.get("val")))


def _sizes(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The sizes of the node's first tensor at their hints; None where one has none."""
    values = tensor_values(node.meta.get("val"))
    if not values:
        return None
    sizes = tuple(_compat.concrete_int(d) for d in values[0].shape)
    return None if None in sizes else sizes


def _reduces(node: torch.fx.Node, known: dict[torch.fx.Node, bool]) -> bool:
    """Whether the kernel computing ``node`` reduces: it is a reduction, or computes one
    of its inputs inline."""
    if node not in known:
        known[node] = False  # guards the recursion; set below
        known[node] = _REDUCTION in getattr(node.target, "tags", ()) or any(
            is_fusible(arg) and not materializes(arg) and _reduces(arg, known)
            for arg in node.all_input_nodes
        )
    return known[node]


def _one_loop(a: torch.fx.Node, b: torch.fx.Node, reduces: dict[torch.fx.Node, bool]) -> bool:
    """Whether Inductor computes ``a`` and ``b`` in one loop: they are as large, or the
    smaller reduces within each row of the larger (a normalization's statistics and its
    output). A reduction over rows (a bias gradient's sum over tokens) runs in a kernel
    of its own, and so does a value broadcast to a larger one."""
    sizes_a, sizes_b = _sizes(a), _sizes(b)
    if sizes_a is None or sizes_b is None:
        return False
    if math.prod(sizes_a) == math.prod(sizes_b):
        return True
    (small, small_sizes), (_, large_sizes) = sorted(
        ((a, sizes_a), (b, sizes_b)), key=lambda pair: math.prod(pair[1])
    )
    rows = [d for d in large_sizes[:-1] if d != 1]
    return (
        bool(large_sizes)
        and [d for d in small_sizes if d != 1] == rows
        and _reduces(small, reduces)
    )


def _depths(
    nodes: Sequence[torch.fx.Node], kernels: set[torch.fx.Node]
) -> dict[torch.fx.Node, int]:
    """How many kernels that cannot fuse (matrix products, attention, ...) lie on the
    longest path into each node."""
    depth: dict[torch.fx.Node, int] = {}
    for node in nodes:
        depth[node] = max(
            (
                depth.get(arg, 0) + int(arg in kernels and not is_fusible(arg))
                for arg in node.all_input_nodes
            ),
            default=0,
        )
    return depth


def _written_before(nodes: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    """How many values are written to memory before each node (Inductor's scheduler
    numbers its nodes so, one per buffer)."""
    found, count = {}, 0
    for node in nodes:
        found[node] = count
        count += _writes_tensor(node)
    return found


def fused_kernels(nodes: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each op whose tensor is written to memory, and the first op of the kernel that
    writes it (multi-output results and the graph's inputs are not ops of their own).

    Fusible ops written to memory share a kernel, as Inductor fuses them, where one feeds
    the other directly in one loop (a normalization's statistics and its output: one
    kernel, two outputs), or where both read one value written to memory and write as
    many elements (an activation's two gradients, and a gated unit's product recomputed
    beside them). A kernel that cannot fuse between them keeps them apart: in the first
    case, one on a path into either (a residual stream's next add, say); in the second,
    one on a path from the earlier to the later (fused, they would wait on each other),
    or more than ``HORIZONTAL_REACH`` values written between them (Inductor's scheduler
    does not fuse distant nodes side by side, which would lengthen live ranges).
    """
    written = [n for n in nodes if _writes_tensor(n)]
    parent = {n: n for n in written if n.op == "call_function" and n.target is not operator.getitem}
    depth = _depths(nodes, set(parent))
    order = {n: i for i, n in enumerate(nodes)}
    written_at = _written_before(nodes)
    known: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}
    reduces: dict[torch.fx.Node, bool] = {}

    def find(node: torch.fx.Node) -> torch.fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def fused_readers(value: torch.fx.Node) -> list[torch.fx.Node]:
        """The fusible kernels computing what reads ``value``."""
        found = []
        for consumer in consumers(value):
            if is_fusible(consumer):
                found.extend(
                    k for k in kernels_reading(consumer, known) if k in parent and is_fusible(k)
                )
        return found

    def join(a: torch.fx.Node, b: torch.fx.Node) -> None:
        first, second = sorted((find(a), find(b)), key=order.__getitem__)
        parent[second] = first

    for value in written:
        readers = fused_readers(value)
        if value in parent and is_fusible(value):
            for kernel in readers:
                if depth[kernel] == depth[value] and _one_loop(value, kernel, reduces):
                    join(value, kernel)
        alike: dict[int, list[list[torch.fx.Node]]] = {}
        for kernel in sorted(set(readers), key=order.__getitem__):
            sizes = _sizes(kernel)
            if sizes is None:
                continue
            groups = alike.setdefault(math.prod(sizes), [])
            group = next((g for g in groups if _side_by_side(g, kernel, written_at)), None)
            if group is None:
                groups.append([kernel])
            else:
                join(group[0], kernel)
                group.append(kernel)
    return {n: find(n) for n in parent}


HORIZONTAL_REACH = 64
"""How many values written apart two kernels may still fuse side by side (Inductor's
``Scheduler.are_long_distant_nodes``)."""


def _side_by_side(
    group: list[torch.fx.Node], later: torch.fx.Node, written_at: dict[torch.fx.Node, int]
) -> bool:
    """Whether ``later`` fuses with each kernel of ``group``, all before it: none is
    too far before it, and none reaches it through a kernel that cannot fuse."""
    if written_at[later] - written_at[group[0]] > HORIZONTAL_REACH:
        return False
    return not any(_through_a_kernel(k, later, written_at) for k in group)


def _through_a_kernel(
    earlier: torch.fx.Node, later: torch.fx.Node, written_at: dict[torch.fx.Node, int]
) -> bool:
    """Whether a path from ``earlier`` to ``later`` passes a node that cannot fuse."""
    stop = written_at[later]
    seen: set[tuple[torch.fx.Node, bool]] = set()
    frontier = [(user, False) for user in earlier.users]
    while frontier:
        node, passed = frontier.pop()
        if node is later:
            if passed:
                return True
            continue
        if (node, passed) in seen or written_at.get(node, stop) > stop:
            continue
        seen.add((node, passed))
        passed = passed or (node.op == "call_function" and not is_fusible(node))
        frontier.extend((user, passed) for user in node.users)
    return False


def tensor_bytes(value: object) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    return (_compat.concrete_int(value.numel()) or 0) * value.element_size()


def tensor_values(value: object) -> list[torch.Tensor]:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return [v for v in values if isinstance(v, torch.Tensor)]
