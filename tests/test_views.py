"""Saved views of one storage: the storage crosses once and comes back viewed the same way."""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

import offload_pass
from offload_pass import analysis, ops
from offload_pass.analysis import find_saved_groups
from offload_pass.driver import offload_chunk
from offload_pass.graphs import ChunkGraphs
from offload_pass.options import OffloadOptions


def _forward(x, w):
    y = torch.mm(x, w)
    return y.sum(), y[:, ::2], y.t()[1:]


def _backward(left, right, tangent):
    return (left.sum(dim=1, keepdim=True) * right[0] * tangent,)


def _chunk(x, w, forward_fn=_forward, backward_fn=_backward) -> ChunkGraphs:
    """One chunk whose forward returns a loss and the values ``backward_fn`` reads."""
    forward = make_fx(forward_fn, tracing_mode="fake")(x, w)
    saved = list(forward.graph.output_node().args[0][1:])
    backward = make_fx(backward_fn, tracing_mode="fake")(*forward_fn(x, w)[1:], torch.tensor(1.0))
    for placeholder, node in zip(backward.graph.find_nodes(op="placeholder"), saved, strict=False):
        placeholder.name = placeholder.target = node.name
    backward.recompile()
    return ChunkGraphs(forward, backward, num_forward_outputs=1)


def test_views_of_one_storage_form_one_group():
    x, w = torch.randn(6, 4), torch.randn(4, 8)
    (group,) = find_saved_groups(_chunk(x, w))
    assert group.op == "aten.mm.default"
    assert len(group.members) == 2
    assert group.nbytes == 6 * 8 * 4
    assert group.fixed_reason is None


def test_storage_crosses_once_and_views_share_one_storage_after_reload():
    x, w = torch.randn(6, 4), torch.randn(4, 8)
    chunk = _chunk(x, w)
    options = OffloadOptions(fraction=1.0, min_bytes=0)
    plan = offload_chunk(chunk, options, options.fraction_rule(), "views")
    assert len(plan.forward.graph.find_nodes(op="call_function", target=ops.OFFLOAD)) == 1

    before = offload_pass.counts().bytes_offloaded
    total, host = plan.forward(x, w)
    assert offload_pass.counts().bytes_offloaded - before == 6 * 8 * 4
    assert host.device.type == "cpu"

    interpreter = torch.fx.Interpreter(plan.backward, garbage_collect_values=False)
    (grad,) = interpreter.run(host, torch.tensor(1.0))
    left, right = _forward(x, w)[1:]
    assert torch.equal(grad, _backward(left, right, torch.tensor(1.0))[0])

    (wait,) = plan.backward.graph.find_nodes(op="call_function", target=ops.RELOAD_WAIT)
    (loaded,) = wait.users
    views = [
        n for n in plan.backward.graph.nodes if n.op == "call_function" and n.args[:1] == (loaded,)
    ]
    storages = set()
    for node in plan.backward.graph.nodes:
        value = interpreter.env.get(node)
        if isinstance(value, torch.Tensor) and node.target in (
            torch.ops.aten.slice.Tensor,
            torch.ops.aten.t.default,
        ):
            storages.add(value.untyped_storage().data_ptr())
    assert views
    assert storages == {interpreter.env[loaded].untyped_storage().data_ptr()}


def _forward_with_scalar(x, w):
    y = torch.mm(x, w)
    return y.sum(), y, y.amax()


def _backward_with_scalar(y, peak, tangent):
    return (y / peak * tangent,)


def test_a_saved_scalar_never_moves():
    """CUDA attention returns its RNG seed on the host though the trace says the device;
    a 0-dim storage stays where it is, with its reason."""
    x, w = torch.randn(6, 4), torch.randn(4, 8)
    groups = find_saved_groups(_chunk(x, w, _forward_with_scalar, _backward_with_scalar))
    reasons = {g.op: g.fixed_reason for g in groups}
    assert reasons == {"aten.mm.default": None, "aten.amax.default": analysis.SCALAR}
