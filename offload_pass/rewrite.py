"""Rewrite: insert the transfer ops where the plan says. Decides nothing.

Forward: ``ticket = offload(a)`` after ``a``'s producer, ``h = offload_wait(ticket, a)``
where placed, and ``h`` replaces the saved values of ``a``'s storage in the outputs.
Backward: the saved-value inputs become one host input, ``ticket = reload(h)`` and
``g = reload_wait(ticket, h)`` go where placed, and each saved view is applied again to
``g`` (with symbolic sizes computed from backward's own values).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx

from offload_pass import _compat, ops
from offload_pass.analysis import SavedGroup
from offload_pass.graphs import ChunkGraphs, materializes, view_chain
from offload_pass.layout import dense_layout
from offload_pass.planner import Placement
from offload_pass.symbolic import SymbolSources

_COPIED_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


def _add_node(
    graph: torch.fx.Graph,
    target: object,
    args: tuple,
    like: torch.fx.Node,
    kwargs: dict | None = None,
) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs)
    values = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    node.meta["val"] = _compat.run_on_fakes(target, *values)
    node.meta.update({k: like.meta[k] for k in _COPIED_META if k in like.meta})
    return node


def _is_token(node: torch.fx.Node) -> bool:
    """Whether ``node`` can order a transfer op: a tensor the compiled code writes to
    memory whether or not the op reads it. A value copied into a graph input does not
    qualify: it is an input's update (a batch norm's running mean), which Inductor writes
    in place into the input, and a read of it made Inductor write it out a second time
    (a ResNet's batch norm kernels on CUDA stored each running mean twice)."""
    return (
        node.target not in ops.TICKETS
        and isinstance(node.meta.get("val"), torch.Tensor)
        and materializes(node)
        and not any(u.target is torch.ops.aten.copy_.default for u in node.users)
    )


def _token_before(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The latest token at or before ``node`` (none if only graph inputs come before)."""
    while node.op not in ("placeholder", "root"):
        if _is_token(node):
            return [node]
        node = node.prev
    return []


def _as_tensor(node: torch.fx.Node) -> torch.fx.Node | None:
    """``node`` as a token, or for an op returning several tensors one taken from it."""
    if _is_token(node):
        return node
    return next((u for u in node.users if _is_token(u)), None)


def _wait_tokens(
    group: SavedGroup,
    nodes: dict[str, torch.fx.Node],
    wait_after: torch.fx.Node,
    tickets: dict[str, torch.fx.Node],
) -> list[torch.fx.Node]:
    """What an offload_wait must come after: every kernel reading the storage, and the
    point the planner chose. (Depending on the readers' results keeps a compiler from
    computing a fused read after the wait.) A moved storage stands in by its ticket, so
    its own wait stays its last use."""
    order = {n: i for i, n in enumerate(wait_after.graph.nodes)}
    readers = [_as_tensor(nodes[name]) for name in group.forward_readers]
    candidates = [t for t in [*readers, *_token_before(wait_after)] if t is not None]
    found = [tickets.get(t.name, t) for t in candidates]
    return [
        t
        for t in dict.fromkeys(found)
        if t is not nodes[group.root] and order[t] <= order[wait_after]
    ]


def rewrite_forward(
    forward: torch.fx.GraphModule,
    groups: dict[str, SavedGroup],
    placements: Sequence[Placement],
    num_forward_outputs: int,
) -> dict[str, torch.fx.Node]:
    """Insert offload and offload_wait; return the host node of each moved root."""
    graph = forward.graph
    nodes = {n.name: n for n in graph.nodes}
    layouts = {p.root: dense_layout(nodes[p.root].meta["val"]) for p in placements}
    tickets: dict[str, torch.fx.Node] = {}
    for p in placements:
        root = nodes[p.root]
        with graph.inserting_after(root):
            tickets[p.root] = _add_node(graph, ops.OFFLOAD, (root, layouts[p.root]), root)
    tokens = {
        p.root: _wait_tokens(groups[p.root], nodes, nodes[p.wait_after], tickets)
        for p in placements
    }
    host: dict[str, torch.fx.Node] = {}
    for p in reversed(placements):
        anchor = tickets.get(p.wait_after, nodes[p.wait_after])
        args = (tickets[p.root], nodes[p.root], layouts[p.root], tokens[p.root])
        with graph.inserting_after(anchor):
            host[p.root] = _add_node(graph, ops.OFFLOAD_WAIT, args, nodes[p.root])

    output = graph.output_node()
    outputs = list(output.args[0])
    replaced = {m: groups[p.root] for p in placements for m in groups[p.root].members}
    saved = []
    for value in outputs[num_forward_outputs:]:
        group = replaced.get(getattr(value, "name", None))
        if group is None:
            saved.append(value)
        elif value.name == group.members[0]:
            saved.append(host[group.root])
    output.args = (tuple(outputs[:num_forward_outputs] + saved),)
    graph.lint()
    forward.recompile()
    return host


def rewrite_backward(
    backward: torch.fx.GraphModule,
    forward: torch.fx.GraphModule,
    groups: dict[str, SavedGroup],
    placements: Sequence[Placement],
    host: dict[str, torch.fx.Node],
) -> None:
    """Turn saved inputs into host inputs, then insert reload, reload_wait and views."""
    graph = backward.graph
    nodes = {n.name: n for n in graph.nodes}
    fw_nodes = {n.name: n for n in forward.graph.nodes}
    host_inputs = {}
    for p in placements:
        first = nodes[groups[p.root].members[0]]
        with graph.inserting_before(first):
            host_input = graph.placeholder(host[p.root].name)
        host_input.meta["val"] = host[p.root].meta["val"]
        host_inputs[p.root] = host_input

    position = {name: i for i, name in enumerate(nodes)}
    tokens = {p.root: _token_before(nodes[p.reload_before].prev) for p in placements}
    by_first_use = sorted(placements, key=lambda p: position[p.first_use])
    for p in by_first_use:
        root = fw_nodes[p.root]
        device = root.meta["val"].device
        h = host_inputs[p.root]
        with graph.inserting_before(nodes[p.reload_before]):
            ticket = _add_node(graph, ops.RELOAD, (h, device, tokens[p.root]), root)
        with graph.inserting_before(nodes[p.first_use]):
            loaded = _add_node(graph, ops.RELOAD_WAIT, (ticket, h, device), root)
            sizes = SymbolSources.of(graph, root.meta["val"])
            for member in groups[p.root].members:
                view = loaded
                for step in view_chain(fw_nodes[member]):
                    args, kwargs = sizes.derive((step.args[1:], step.kwargs), graph, loaded)
                    view = _add_node(graph, step.target, (view, *args), step, kwargs)
                nodes[member].replace_all_uses_with(view)
                graph.erase_node(nodes[member])
    graph.lint()
    backward.recompile()


def insert_transfers(
    chunk: ChunkGraphs, moved: Sequence[SavedGroup], placements: Sequence[Placement]
) -> None:
    groups = {g.root: g for g in moved}
    host = rewrite_forward(chunk.forward, groups, placements, chunk.num_forward_outputs)
    rewrite_backward(chunk.backward, chunk.forward, groups, placements, host)
