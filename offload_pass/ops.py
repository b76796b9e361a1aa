"""The graph ops of the offload contract (see docs/design.md).

Every op is functional: none declares a mutation, and each returns what the next one
consumes, so a compiler orders them by data edges alone and no functionalization pass
ever clones a tensor whose copy is in flight.

    ticket = offload([a, ...], layouts)                      # copy each to a new host buffer
    [h, ...] = offload_wait(ticket, [a, ...], layouts, after)  # compute waits; last use of a
    [h, ...] = offload_release(ticket, [a, ...], layouts, after)
                                # at forward's end, compute does not wait; a is freed
                                # to the allocator once the copy has read it
    ticket = reload([h, ...], device, after)                 # copy each to a new device buffer
    [g, ...] = reload_wait(ticket, [h, ...], device)         # compute waits; g read from here

One op moves every storage the planner placed at the same point (a bucket), one after
another on its copy stream: a bucket of several costs the device what as many ops would,
and the host one call. ``layouts`` holds each tensor's dimension order, outermost first,
one after another (a schema takes no list of lists).

A ticket is a scalar CPU tensor naming one bucket's copies in flight; the buffers being
written stay with the runtime until the wait returns them. ``after`` holds values
computed where the planner placed the op, so no compiler pass moves it earlier than that
point.
"""

import functools
import itertools
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


def _define(schema: str, kernel: Callable[..., object], fake: Callable[..., object]) -> None:
    """Define ``offload_pass::<schema>`` with one Python kernel for every device.

    A plain library definition, not ``torch.library.custom_op``: the ops run only in
    graphs already split into forward and backward, so they need no autograd, and without
    custom_op's Python autograd layer each call costs the host a few microseconds less.
    """
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema, tags=_TAGS)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"offload_pass::{name}", fake, lib=_LIBRARY)


def joined_layouts(layouts: Sequence[Sequence[int]]) -> list[int]:
    """Each tensor's dimension order, one after another, as the ops take them."""
    return [d for layout in layouts for d in layout]


def split_layouts(tensors: Sequence[Tensor], layouts: Sequence[int]) -> list[Sequence[int]]:
    """``joined_layouts`` undone: one dimension order per tensor."""
    ends = list(itertools.accumulate(t.dim() for t in tensors))
    if (ends[-1] if ends else 0) != len(layouts):
        raise ValueError(
            f"layouts: {len(layouts)} dimensions given for tensors of "
            f"{[t.dim() for t in tensors]} dimensions"
        )
    return [layouts[end - t.dim() : end] for t, end in zip(tensors, ends, strict=True)]


def offload(tensors: Sequence[Tensor], layouts: Sequence[int]) -> Tensor:
    """Start copying each tensor into a host buffer whose dimensions are laid out,
    outermost first, in the order its entry of ``layouts`` gives.

    The layouts are fixed when the graph is rewritten, so each host tensor has the
    strides the backward graph was compiled for, whatever layout the compiler chose.
    """
    return runtime.offload(tensors, split_layouts(tensors, layouts))


def _offload_fake(tensors: Sequence[Tensor], layouts: Sequence[int]) -> Tensor:
    return runtime.new_ticket_like()


def offload_wait(
    ticket: Tensor, tensors: Sequence[Tensor], layouts: Sequence[int], after: Sequence[Tensor]
) -> list[Tensor]:
    """Make the compute stream wait until the host buffers hold ``tensors``; return them."""
    return runtime.offload_wait(ticket, tensors[0].device)


def _offload_wait_fake(
    ticket: Tensor, tensors: Sequence[Tensor], layouts: Sequence[int], after: Sequence[Tensor]
) -> list[Tensor]:
    return [
        torch.empty_permuted(a.shape, layout, dtype=a.dtype, device="cpu")
        for a, layout in zip(tensors, split_layouts(tensors, layouts), strict=True)
    ]


def offload_release(
    ticket: Tensor, tensors: Sequence[Tensor], layouts: Sequence[int], after: Sequence[Tensor]
) -> list[Tensor]:
    """Return the host buffers receiving ``tensors`` without making compute wait; the
    allocator reuses ``tensors``' memory once the copies have read it."""
    return runtime.offload_release(ticket, tensors)


def reload(hosts: Sequence[Tensor], device: torch.device, after: Sequence[Tensor]) -> Tensor:
    """Start copying each host tensor back to ``device``."""
    return runtime.reload(hosts, device)


def _reload_fake(hosts: Sequence[Tensor], device: torch.device, after: Sequence[Tensor]) -> Tensor:
    return runtime.new_ticket_like()


def reload_wait(ticket: Tensor, hosts: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """Make the compute stream wait until the reloads have landed; return them."""
    return runtime.reload_wait(ticket)


def _reload_wait_fake(
    ticket: Tensor, hosts: Sequence[Tensor], device: torch.device
) -> list[Tensor]:
    return [torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device) for h in hosts]


_define("offload(Tensor[] tensors, int[] layouts) -> Tensor", offload, _offload_fake)
_define(
    "offload_wait(Tensor ticket, Tensor[] tensors, int[] layouts, Tensor[] after) -> Tensor[]",
    offload_wait,
    _offload_wait_fake,
)
_define(
    "offload_release(Tensor ticket, Tensor[] tensors, int[] layouts, Tensor[] after) -> Tensor[]",
    offload_release,
    _offload_wait_fake,
)
_define("reload(Tensor[] hosts, Device device, Tensor[] after) -> Tensor", reload, _reload_fake)
_define(
    "reload_wait(Tensor ticket, Tensor[] hosts, Device device) -> Tensor[]",
    reload_wait,
    _reload_wait_fake,
)

OFFLOAD = torch.ops.offload_pass.offload.default
OFFLOAD_WAIT = torch.ops.offload_pass.offload_wait.default
OFFLOAD_RELEASE = torch.ops.offload_pass.offload_release.default
RELOAD = torch.ops.offload_pass.reload.default
RELOAD_WAIT = torch.ops.offload_pass.reload_wait.default
TRANSFERS = frozenset({OFFLOAD, OFFLOAD_WAIT, OFFLOAD_RELEASE, RELOAD, RELOAD_WAIT})
TICKETS = frozenset({OFFLOAD, RELOAD})
_CPU = torch.device("cpu")


def _ticket_value(tensors: Sequence[Tensor]) -> Tensor:
    make = functools.partial(torch.empty, (), dtype=torch.int64, device="meta")
    return _compat.fake_from_meta(tensors[0].fake_mode, make, _CPU)


def _host_values(
    ticket: Tensor, tensors: Sequence[Tensor], layouts: Sequence[int], after: object
) -> list[Tensor]:
    return [
        _compat.fake_from_meta(
            a.fake_mode,
            functools.partial(torch.empty_permuted, a.shape, layout, dtype=a.dtype, device="meta"),
            _CPU,
        )
        for a, layout in zip(tensors, split_layouts(tensors, layouts), strict=True)
    ]


def _reloaded_values(ticket: Tensor, hosts: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    return [
        _compat.fake_from_meta(
            h.fake_mode,
            functools.partial(
                torch.empty_strided, h.shape, h.stride(), dtype=h.dtype, device="meta"
            ),
            device,
        )
        for h in hosts
    ]


NODE_VALUES: dict[object, Callable[..., object]] = {
    OFFLOAD: lambda tensors, layouts: _ticket_value(tensors),
    OFFLOAD_WAIT: _host_values,
    OFFLOAD_RELEASE: _host_values,
    RELOAD: lambda hosts, device, after: _ticket_value(hosts),
    RELOAD_WAIT: _reloaded_values,
}
"""The value of a new node of each op, from its arguments' fake values: what the op's
fake implementation returns in their fake mode, built directly (the rewrite adds four
nodes per bucket moved)."""


def holds_transfers(gm: torch.fx.GraphModule) -> bool:
    return any(node.target in TRANSFERS for node in gm.graph.nodes)
