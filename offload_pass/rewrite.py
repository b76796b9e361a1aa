"""Rewrite: insert the transfer ops where the plan says. Decides nothing.

Forward: ``ticket = offload([a, ...])`` after the last producer of a bucket (the storages
the plan places at the same nodes), ``[h, ...] = offload_wait(ticket, [a, ...])`` where
placed (``offload_release`` at forward's end for a released bucket), and each ``h``
replaces the saved values of its storage in the outputs.
Backward: the saved-value inputs become one host input per storage, ``ticket =
reload([h, ...])`` and ``[g, ...] = reload_wait(ticket, [h, ...])`` go where placed, and
each saved view is applied again to its ``g`` (with symbolic sizes computed from
backward's own values).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch
import torch.fx

from offload_pass import _compat, ops
from offload_pass.analysis import SavedGroup
from offload_pass.graphs import ChunkGraphs, materializes, tensor_values, view_chain
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
    """A call of ``target`` with its value: the rewrite adds transfer ops and saved views
    (an element of a multi-output view such as ``unbind`` among them), nothing else."""
    node = graph.call_function(target, args, kwargs)
    values, kwarg_values = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    if target in ops.NODE_VALUES:
        node.meta["val"] = ops.NODE_VALUES[target](*values)
    elif target is operator.getitem:
        node.meta["val"] = operator.getitem(*values)
    else:
        node.meta["val"] = _compat.view_of_fakes(target, values, kwarg_values)
    node.meta.update({k: like.meta[k] for k in _COPIED_META if k in like.meta})
    return node


def _is_token(node: torch.fx.Node) -> bool:
    """Whether ``node`` can order a transfer op: a tensor the compiled code writes to
    memory whether or not the op reads it. A value copied into a graph input does not
    qualify: it is an input's update (a batch norm's running mean), which Inductor writes
    in place into the input, and a read of it made Inductor write it out a second time
    (a ResNet's batch norm kernels on CUDA stored each running mean twice). Nor does a
    generator state saved for backward (``_compat.is_saved_random_state``): Inductor
    hands it on as a real tensor, which no op of the pass may take."""
    return (
        node.target not in ops.TICKETS
        and not _compat.is_saved_random_state(node)
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
    """``node`` as a token, or for an op returning several tensors one taken from it,
    through nested results (a random-state wrapper returns the state and its op's
    results)."""
    pending = [node]
    while pending:
        found = pending.pop(0)
        if _is_token(found):
            return found
        pending.extend(u for u in found.users if u.target is operator.getitem)
    return None


@dataclasses.dataclass(frozen=True)
class _Sites:
    """One moved storage's nodes: its producer, the kernels reading it, the node its
    bucket's offload follows and the node its wait (or release) follows, in forward; the
    node its bucket's reload precedes and the node its wait precedes, and the inputs
    receiving its saved values, in backward."""

    group: SavedGroup
    root: torch.fx.Node
    readers: tuple[torch.fx.Node, ...]
    offload_after: torch.fx.Node
    wait_after: torch.fx.Node
    released: bool
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
        group = groups[t.root]
        members = tuple(by_name[m] for m in group.members)
        sites.append(
            _Sites(
                group,
                by_name[t.root],
                tuple(by_name[r] for r in group.forward_readers),
                forward[t.offload_at],
                forward[t.wait_at],
                t.released,
                backward[t.reload_at],
                backward[t.need_at],
                members,
                tuple(inputs[m] for m in members),
            )
        )
    return sites


def _buckets(sites: Sequence[_Sites], *where: str) -> list[list[_Sites]]:
    """The sites one op moves: those of one device the planner placed at the same nodes
    ``where`` names, in the order of their first site."""
    buckets: dict[tuple[object, ...], list[_Sites]] = {}
    for s in sites:
        key = (s.root.meta["val"].device, *(getattr(s, w) for w in where))
        buckets.setdefault(key, []).append(s)
    return list(buckets.values())


def _unpacked(
    graph: torch.fx.Graph, node: torch.fx.Node, likes: Sequence[torch.fx.Node]
) -> list[torch.fx.Node]:
    """The tensors of ``node``'s list, one node each, right after it."""
    items = []
    for i, like in reversed(list(enumerate(likes))):
        with graph.inserting_after(node):
            item = graph.call_function(operator.getitem, (node, i))
        item.meta["val"] = node.meta["val"][i]
        item.meta.update({k: like.meta[k] for k in _COPIED_META if k in like.meta})
        items.append(item)
    return items[::-1]


def _wait_tokens(
    bucket: Sequence[_Sites],
    tickets: dict[torch.fx.Node, torch.fx.Node],
    order: dict[torch.fx.Node, int],
) -> list[torch.fx.Node]:
    """What a bucket's offload_wait must come after: every kernel reading its storages,
    and the point the planner chose. (Depending on the readers' results keeps a compiler
    from computing a fused read after the wait.) A moved storage stands in by its ticket,
    so its own wait stays its last use; tokens the others already imply are left out.
    ``tickets``: each moved root's offload; ``order``: each forward node's position."""
    wait_after = bucket[0].wait_after
    placed = order[_past_offloads(wait_after)]
    ticket = tickets[bucket[0].root]
    readers = [_as_tensor(r) for s in bucket for r in s.readers]
    candidates = [t for t in [*readers, *_token_before(wait_after)] if t is not None]
    own = {s.root for s in bucket}
    found = [_stand_in(t, tickets, order, placed) for t in candidates if t not in own]
    tokens = [t for t in dict.fromkeys(found) if t is not ticket and order[t] <= placed]
    return _without_implied(tokens, order)


def _without_implied(
    tokens: list[torch.fx.Node], order: dict[torch.fx.Node, int]
) -> list[torch.fx.Node]:
    """``tokens`` less each that data dependence alone orders before a wait taking the
    rest: one whose value is read only by the others and their ancestors. A token keeps
    its buffer alive until the wait, so each one more than needed holds memory the cost
    model does not count (on W2, ten layer norms' outputs held until a late wait)."""
    lowest = min((order[t] for t in tokens), default=0)
    covered: set[torch.fx.Node] = set()
    kept: set[torch.fx.Node] = set()
    for token in sorted(tokens, key=order.__getitem__, reverse=True):
        if token in covered and all(u in covered for u in token.users):
            continue
        kept.add(token)
        _cover(token, lowest, order, covered)
    return [t for t in tokens if t in kept]


def _cover(
    node: torch.fx.Node, lowest: int, order: dict[torch.fx.Node, int], covered: set[torch.fx.Node]
) -> None:
    """Add ``node`` and its ancestors from position ``lowest`` on to ``covered``, through
    tensor values only: a size taken from a tensor (``sym_size``) does not wait for the
    kernel computing it."""
    stack = [node]
    while stack:
        current = stack.pop()
        if current in covered or order[current] < lowest:
            continue
        covered.add(current)
        if tensor_values(current.meta.get("val")):
            stack.extend(current.all_input_nodes)


def _stand_in(
    token: torch.fx.Node,
    tickets: dict[torch.fx.Node, torch.fx.Node],
    order: dict[torch.fx.Node, int],
    placed: int,
) -> torch.fx.Node:
    """A moved token's ticket where it comes before ``placed`` (so that the token's own
    wait stays its last use), else the token itself: its own wait comes later still."""
    ticket = tickets.get(token)
    return ticket if ticket is not None and order[ticket] <= placed else token


def _past_offloads(node: torch.fx.Node) -> torch.fx.Node:
    """The last of the offloads inserted right after ``node``, or ``node``."""
    while node.next.target is ops.OFFLOAD:
        node = node.next
    return node


def rewrite_forward(
    forward: torch.fx.GraphModule, sites: Sequence[_Sites], num_forward_outputs: int
) -> dict[torch.fx.Node, torch.fx.Node]:
    """Insert offload and offload_wait (or offload_release), one of each per bucket;
    return the host node of each moved root."""
    graph = forward.graph
    buckets = _buckets(sites, "offload_after", "wait_after", "released")
    tickets: dict[torch.fx.Node, torch.fx.Node] = {}
    for bucket in buckets:
        roots = [s.root for s in bucket]
        layouts = ops.joined_layouts([dense_layout(r.meta["val"]) for r in roots])
        with graph.inserting_after(bucket[0].offload_after):
            ticket = _add_node(graph, ops.OFFLOAD, (roots, layouts), roots[0])
        tickets.update(dict.fromkeys(roots, ticket))
    order = {n: i for i, n in enumerate(graph.nodes)}
    tokens = [_wait_tokens(b, tickets, order) for b in buckets]
    host: dict[torch.fx.Node, torch.fx.Node] = {}
    for bucket, after in reversed(list(zip(buckets, tokens, strict=True))):
        roots = [s.root for s in bucket]
        ticket = tickets[roots[0]]
        args = (ticket, roots, ticket.args[1], after)
        op = ops.OFFLOAD_RELEASE if bucket[0].released else ops.OFFLOAD_WAIT
        with graph.inserting_after(_past_offloads(bucket[0].wait_after)):
            wait = _add_node(graph, op, args, roots[0])
        host.update(zip(roots, _unpacked(graph, wait, roots), strict=True))

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
    """Turn saved inputs into host inputs, then insert reload and reload_wait, one of
    each per bucket, and each saved view."""
    graph = backward.graph
    host_inputs = {}
    for s in sites:
        with graph.inserting_before(s.received[0]):
            host_input = graph.placeholder(host[s.root].name)
        host_input.meta["val"] = host[s.root].meta["val"]
        host_inputs[s.root] = host_input

    position = {n: i for i, n in enumerate(graph.nodes)}
    buckets = sorted(
        _buckets(sites, "reload_before", "first_use"), key=lambda b: position[b[0].first_use]
    )
    tokens = [_token_before(b[0].reload_before.prev) for b in buckets]
    size_inputs = SymbolSources.inputs_of(graph)
    for bucket, after in zip(buckets, tokens, strict=True):
        device = bucket[0].root.meta["val"].device
        hosts = [host_inputs[s.root] for s in bucket]
        like = bucket[0].root
        with graph.inserting_before(bucket[0].reload_before):
            ticket = _add_node(graph, ops.RELOAD, (hosts, device, after), like)
        with graph.inserting_before(bucket[0].first_use):
            loaded = _add_node(graph, ops.RELOAD_WAIT, (ticket, hosts, device), like)
        storages = _unpacked(graph, loaded, [s.root for s in bucket])
        for s, storage in zip(bucket, storages, strict=True):
            sizes = SymbolSources.of(size_inputs, s.root.meta["val"])
            with graph.inserting_before(bucket[0].first_use):
                _replay_views(graph, s, storage, sizes)
    graph.lint()
    backward.recompile()


def _replay_views(
    graph: torch.fx.Graph, site: _Sites, storage: torch.fx.Node, sizes: SymbolSources
) -> None:
    """Apply each saved view of ``site``'s storage to ``storage`` again, in place of the
    backward input that received it."""
    for member, received in zip(site.members, site.received, strict=True):
        view = storage
        for step in view_chain(member):
            args, kwargs = sizes.derive((step.args[1:], step.kwargs), graph, storage)
            view = _add_node(graph, step.target, (view, *args), step, kwargs)
        received.replace_all_uses_with(view)
        graph.erase_node(received)


def split_bias_adds(graph: torch.fx.Graph) -> None:
    """Split each biased product that Inductor would split (``_compat.inductor_splits_bias_add``)
    as Inductor does: the node becomes the product, and an add after it, which its uses
    now read, adds the bias. Done before any transfer op reads a product as a token: the
    read would keep Inductor from splitting it, and so change the kernels it fuses: the
    forward of an 8-block fp32 stack on CUDA defined 12 kernels where stock defined 8, and
    9 once split."""
    products = graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)
    for node in [n for n in products if _compat.inductor_splits_bias_add(n)]:
        _split_bias_add(graph, node)


def _split_bias_add(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    bias, mat1, mat2 = node.args
    with graph.inserting_after(node):
        biased = graph.call_function(torch.ops.aten.add.Tensor, (bias, node))
    node.replace_all_uses_with(biased, delete_user_cb=lambda user: user is not biased)
    biased.meta.update(node.meta)
    node.target = torch.ops.aten.mm.default
    node.args = (mat1, mat2)
    node.meta["val"] = _compat.call_on_fakes(node.target, (mat1.meta["val"], mat2.meta["val"]))


def insert_transfers(
    chunk: ChunkGraphs, moved: Sequence[SavedGroup], transfers: Sequence[Transfer]
) -> None:
    """Insert the transfer ops where ``transfers`` (the planner's, by node position in
    the graphs as they are now) place them."""
    sites = _resolve(chunk, moved, transfers)
    if sites:
        split_bias_adds(chunk.forward.graph)
        split_bias_adds(chunk.backward.graph)
    host = rewrite_forward(chunk.forward, sites, chunk.num_forward_outputs)
    rewrite_backward(chunk.backward, sites, host)
