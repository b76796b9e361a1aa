"""Layouts the transfers keep: a copy is one flat memcpy when the tensor is dense."""

from __future__ import annotations

import torch

from offload_pass import _compat


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly, in some dimension order."""
    dims = [
        (_compat.concrete_int(stride), _compat.concrete_int(size))
        for size, stride in zip(t.shape, t.stride(), strict=True)
        if _compat.concrete_int(size) != 1
    ]
    if any(stride is None or size is None for stride, size in dims):
        return False
    expected = 1
    for stride, size in sorted(dims):
        if stride != expected:
            return False
        expected *= size
    return True


def dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides a copy of ``t`` keeps: ``t``'s own when dense, else contiguous."""
    if is_dense(t):
        return tuple(t.stride())
    return torch.empty(t.shape, device="meta").stride()
