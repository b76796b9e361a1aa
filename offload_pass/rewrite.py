"""Rewrite: insert the transfer ops where the plan says. Decides nothing.

Forward: ``ticket = offload(a)`` after ``a``'s producer, ``h = offload_wait(ticket, a)``
where placed, and ``h`` replaces the saved values of ``a``'s storage in the outputs.
Backward: the saved-value inputs become one host input, ``ticket = reload(h)`` and
``g = reload_wait(ticket, h)`` go where placed, and each saved view is applied again to
``g`` (with symbolic sizes computed from backward's own values).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx

from offload_pass import _compat, ops
from offload_pass.analysis import SavedGroup
from offload_pass.graphs import ChunkGraphs, materializes, view_chain
from offload_pass.layout import dense_layout
from offload_pass.simulate import Transfer
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
    values, kwarg_values = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    if target in ops.NODE_VALUES:
        node.meta["val"] = ops.NODE_VALUES[target](*values)
    else:
        node.meta["val"] = _compat.run_on_fakes(target, values, kwarg_values)
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


@dataclasses.dataclass(frozen=True)
class _Sites:
    """One moved storage's nodes: its producer, the kernels reading it and the node its
    wait follows, in forward; the node its reload precedes, its first use, and the
    inputs receiving its saved values, in backward."""

    group: SavedGroup
    root: torch.fx.Node
    readers: tuple[torch.fx.Node, ...]
    wait_after: torch.fx.Node
    reload_before: torch.fx.Node
    first_use: torch.fx.Node
    members: tuple[torch.fx.Node, ...]
    received: tuple[torch.fx.Node, ...]


def _resolve(
    chunk: ChunkGraphs, moved: Sequence[SavedGroup], transfers: Sequence[Transfer]
) -> list[_Sites]:
    """The planner's positions as nodes, read before either graph changes."""
    forward = list(chunk.forward.graph.nodes)
    backward = list(chunk.backward.graph.nodes)
    by_name = {n.name: n for n in forward}
    inputs = chunk.backward_inputs()
    groups = {g.root: g for g in moved}
    sites = []
    for t in transfers:
        members = tuple(by_name[m] for m in groups[t.root].members)
        sites.append(
            _Sites(
                groups[t.root],
                forward[t.offload_at],
                tuple(by_name[r] for r in groups[t.root].forward_readers),
                forward[t.wait_at],
                backward[t.reload_at],
                backward[t.need_at],
                members,
                tuple(inputs[m] for m in members),
            )
        )
    return sites


def _wait_tokens(
    site: _Sites,
    tickets: dict[torch.fx.Node, torch.fx.Node],
    order: dict[torch.fx.Node, int],
) -> list[torch.fx.Node]:
    """What an offload_wait must come after: every kernel reading the storage, and the
    point the planner chose. (Depending on the readers' results keeps a compiler from
    computing a fused read after the wait.) A moved storage stands in by its ticket, so
    its own wait stays its last use. ``order``: each forward node's position."""
    tensors = [_as_tensor(r) for r in site.readers]
    candidates = [t for t in [*tensors, *_token_before(site.wait_after)] if t is not None]
    found = [tickets.get(t, t) for t in candidates]
    return [
        t for t in dict.fromkeys(found) if t is not site.root and order[t] <= order[site.wait_after]
    ]


def rewrite_forward(
    forward: torch.fx.GraphModule, sites: Sequence[_Sites], num_forward_outputs: int
) -> dict[torch.fx.Node, torch.fx.Node]:
    """Insert offload and offload_wait; return the host node of each moved root."""
    graph = forward.graph
    layouts = {s.root: dense_layout(s.root.meta["val"]) for s in sites}
    tickets: dict[torch.fx.Node, torch.fx.Node] = {}
    for s in sites:
        with graph.inserting_after(s.root):
            tickets[s.root] = _add_node(graph, ops.OFFLOAD, (s.root, layouts[s.root]), s.root)
    order = {n: i for i, n in enumerate(graph.nodes)}
    tokens = {s.root: _wait_tokens(s, tickets, order) for s in sites}
    host: dict[torch.fx.Node, torch.fx.Node] = {}
    for s in reversed(sites):
        anchor = tickets.get(s.wait_after, s.wait_after)
        args = (tickets[s.root], s.root, layouts[s.root], tokens[s.root])
        with graph.inserting_after(anchor):
            host[s.root] = _add_node(graph, ops.OFFLOAD_WAIT, args, s.root)

    output = graph.output_node()
    outputs = list(output.args[0])
    replaced = {m: s for s in sites for m in s.members}
    saved = []
    for value in outputs[num_forward_outputs:]:
        site = replaced.get(value)
        if site is None:
            saved.append(value)
        elif value is site.members[0]:
            saved.append(host[site.root])
    output.args = (tuple(outputs[:num_forward_outputs] + saved),)
    graph.lint()
    forward.recompile()
    return host


def rewrite_backward(
    backward: torch.fx.GraphModule,
    sites: Sequence[_Sites],
    host: dict[torch.fx.Node, torch.fx.Node],
) -> None:
    """Turn saved inputs into host inputs, then insert reload, reload_wait and views."""
    graph = backward.graph
    host_inputs = {}
    for s in sites:
        with graph.inserting_before(s.received[0]):
            host_input = graph.placeholder(host[s.root].name)
        host_input.meta["val"] = host[s.root].meta["val"]
        host_inputs[s.root] = host_input

    position = {n: i for i, n in enumerate(graph.nodes)}
    tokens = {s.root: _token_before(s.reload_before.prev) for s in sites}
    size_inputs = SymbolSources.inputs_of(graph)
    for s in sorted(sites, key=lambda s: position[s.first_use]):
        device = s.root.meta["val"].device
        h = host_inputs[s.root]
        with graph.inserting_before(s.reload_before):
            ticket = _add_node(graph, ops.RELOAD, (h, device, tokens[s.root]), s.root)
        with graph.inserting_before(s.first_use):
            loaded = _add_node(graph, ops.RELOAD_WAIT, (ticket, h, device), s.root)
            sizes = SymbolSources.of(size_inputs, s.root.meta["val"])
            for member, received in zip(s.members, s.received, strict=True):
                view = loaded
                for step in view_chain(member):
                    args, kwargs = sizes.derive((step.args[1:], step.kwargs), graph, loaded)
                    view = _add_node(graph, step.target, (view, *args), step, kwargs)
                received.replace_all_uses_with(view)
                graph.erase_node(received)
    graph.lint()
    backward.recompile()


def insert_transfers(
    chunk: ChunkGraphs, moved: Sequence[SavedGroup], transfers: Sequence[Transfer]
) -> None:
    """Insert the transfer ops where ``transfers`` (the planner's, by node position in
    the graphs as they are now) place them."""
    sites = _resolve(chunk, moved, transfers)
    host = rewrite_forward(chunk.forward, sites, chunk.num_forward_outputs)
    rewrite_backward(chunk.backward, sites, host)
