"""The four graph ops of the offload contract (see docs/design.md).

Every op is functional: none declares a mutation, and each returns a tensor that the
next one consumes, so a compiler orders them by data edges alone and no functionalization
pass ever clones a tensor whose copy is in flight.

    ticket = offload(a, layout)                   # copy a to a new host buffer
    h      = offload_wait(ticket, a, layout, after)  # compute waits; the last use of a
    ticket = reload(h, device, after)             # copy h to a new device buffer
    g      = reload_wait(ticket, h)               # compute waits; g is read from here on

A ticket is a scalar CPU tensor naming one copy in flight; the buffer being written
stays with the runtime until the wait returns it. ``after`` holds values computed where
the planner placed the op, so no compiler pass moves it earlier than that point.
"""

import functools
from collections.abc import Callable, Sequence

import torch
import torch.fx
from torch import Tensor

from offload_pass import _compat, runtime

_LIBRARY = torch.library.Library("offload_pass", "DEF")
_TAGS = (
    torch.Tag.pt2_compliant_tag,
    *_compat.flexible_layout_tags(),
    *_compat.cudagraph_unsafe_tags(),
)


def _define(schema: str, kernel: Callable[..., Tensor], fake: Callable[..., Tensor]) -> None:
    """Define ``offload_pass::<schema>`` with one Python kernel for every device.

    A plain library definition, not ``torch.library.custom_op``: the ops run only in
    graphs already split into forward and backward, so they need no autograd, and without
    custom_op's Python autograd layer each call costs the host a few microseconds less.
    """
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema, tags=_TAGS)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"offload_pass::{name}", fake, lib=_LIBRARY)


def offload(a: Tensor, layout: Sequence[int]) -> Tensor:
    """Start copying ``a`` into a host buffer whose dimensions are laid out, outermost
    first, in the order ``layout`` gives.

    The layout is fixed when the graph is rewritten, so the host tensor has the strides
    the backward graph was compiled for, whatever layout the compiler chose for ``a``.
    """
    return runtime.offload(a, layout)


def _offload_fake(a: Tensor, layout: Sequence[int]) -> Tensor:
    return runtime.new_ticket_like()


def offload_wait(
    ticket: Tensor, a: Tensor, layout: Sequence[int], after: Sequence[Tensor]
) -> Tensor:
    """Make the compute stream wait until the host buffer holds ``a``, and return it."""
    return runtime.offload_wait(ticket, a)


def _offload_wait_fake(
    ticket: Tensor, a: Tensor, layout: Sequence[int], after: Sequence[Tensor]
) -> Tensor:
    return torch.empty_permuted(a.shape, layout, dtype=a.dtype, device="cpu")


def reload(h: Tensor, device: torch.device, after: Sequence[Tensor]) -> Tensor:
    """Start copying ``h`` back to ``device``."""
    return runtime.reload(h, device)


def _reload_fake(h: Tensor, device: torch.device, after: Sequence[Tensor]) -> Tensor:
    return runtime.new_ticket_like()


def reload_wait(ticket: Tensor, h: Tensor, device: torch.device) -> Tensor:
    """Make the compute stream wait until the reload of ``h`` has landed, and return it."""
    return runtime.reload_wait(ticket)


def _reload_wait_fake(ticket: Tensor, h: Tensor, device: torch.device) -> Tensor:
    return torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)


_define("offload(Tensor a, SymInt[] layout) -> Tensor", offload, _offload_fake)
_define(
    "offload_wait(Tensor ticket, Tensor a, SymInt[] layout, Tensor[] after) -> Tensor",
    offload_wait,
    _offload_wait_fake,
)
_define("reload(Tensor h, Device device, Tensor[] after) -> Tensor", reload, _reload_fake)
_define(
    "reload_wait(Tensor ticket, Tensor h, Device device) -> Tensor",
    reload_wait,
    _reload_wait_fake,
)

OFFLOAD = torch.ops.offload_pass.offload.default
OFFLOAD_WAIT = torch.ops.offload_pass.offload_wait.default
RELOAD = torch.ops.offload_pass.reload.default
RELOAD_WAIT = torch.ops.offload_pass.reload_wait.default
TRANSFERS = frozenset({OFFLOAD, OFFLOAD_WAIT, RELOAD, RELOAD_WAIT})
TICKETS = frozenset({OFFLOAD, RELOAD})
_CPU = torch.device("cpu")


def _ticket_value(like: Tensor) -> Tensor:
    make = functools.partial(torch.empty, (), dtype=torch.int64, device="meta")
    return _compat.fake_from_meta(like.fake_mode, make, _CPU)


def _host_value(ticket: Tensor, a: Tensor, layout: Sequence[int], after: object) -> Tensor:
    make = functools.partial(torch.empty_permuted, a.shape, layout, dtype=a.dtype, device="meta")
    return _compat.fake_from_meta(a.fake_mode, make, _CPU)


def _reloaded_value(ticket: Tensor, h: Tensor, device: torch.device) -> Tensor:
    make = functools.partial(torch.empty_strided, h.shape, h.stride(), dtype=h.dtype, device="meta")
    return _compat.fake_from_meta(h.fake_mode, make, device)


NODE_VALUES: dict[object, Callable[..., Tensor]] = {
    OFFLOAD: lambda a, layout: _ticket_value(a),
    OFFLOAD_WAIT: _host_value,
    RELOAD: lambda h, device, after: _ticket_value(h),
    RELOAD_WAIT: _reloaded_value,
}
"""The value of a new node of each op, from its arguments' fake values: what the op's
fake implementation returns in their fake mode, built directly (the rewrite adds four
nodes per storage moved)."""


def holds_transfers(gm: torch.fx.GraphModule) -> bool:
    return any(node.target in TRANSFERS for node in gm.graph.nodes)
