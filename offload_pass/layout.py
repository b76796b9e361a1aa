"""Layouts the transfers keep: a copy is one flat memcpy when the tensor is dense.

A dense layout is named by the order of its dimensions in memory, outermost first (the
``physical_layout`` of ``torch.empty_permuted``). That order holds for every size the
graph may run at, where strides are symbolic and their values change from call to call.
"""

from __future__ import annotations

import torch

from offload_pass import _compat


def dense_layout(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dimension order, outermost first, whose dense strides are ``t``'s; None when
    ``t``'s elements do not fill its storage span exactly, or its strides have no hint.

    Sizes and strides are read from their hints. The stride of a dimension of size 1
    never matters; it goes inside the other dimensions of its stride.
    """
    sizes = [_compat.concrete_int(s) for s in t.shape]
    strides = [_compat.concrete_int(s) for s in t.stride()]
    if None in sizes or None in strides:
        return None
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], sizes[d] == 1, d))
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return tuple(order)


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly, in some dimension order."""
    return dense_layout(t) is not None
