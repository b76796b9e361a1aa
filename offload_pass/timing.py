"""Matrix products, convolutions and attention timed on the CUDA device a chunk runs on.

One matrix rate prices these nodes badly: the rate a product reaches depends on its shape
(a 2048-wide projection runs well below an 8192^3 product's rate), and attention's
kernels reach a fraction of it, less in backward than in forward. So each node of a CUDA
chunk that torch's FLOP formulas count runs on random values of its shapes, strides and
dtypes, and the cost model prices it at the time measured. Timings are cached per op and
signature for the process, so a shape met again (the next block, the next compile) is
not timed again. The values are random: a node whose work depends on the values it
reads (an integer tensor of offsets or indices) is not timed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.fx

from offload_pass import _compat
from offload_pass.profiles import CALIBRATE, DeviceProfile

REPEATS = 3
NodeTimer = Callable[[torch.fx.Node], "float | None"]
"""Seconds one node's kernel takes on the device, or None where it was not timed."""


def timer_for(profile: DeviceProfile | str | None, device: torch.device) -> NodeTimer | None:
    """The timer of a chunk on ``device`` planned with ``profile`` (the option): a CUDA
    device is timed where the profile describes the device present (``None`` or
    ``"calibrate"``), not where a named or given profile plans for another one. The CPU
    is not timed: its copies do not overlap compute, so there is nothing to hide."""
    if device.type != "cuda" or profile not in (None, CALIBRATE):
        return None
    return functools.partial(measured_seconds, device=device)


def measured_seconds(node: torch.fx.Node, device: torch.device) -> float | None:
    """Seconds ``node`` takes on ``device``; None where it has no FLOPs or cannot run."""
    if not _compat.flop_count(node):  # FLOPs are counted for ATen ops alone
        return None
    values = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        signature = _signature(values)
    except _Untimeable:
        return None
    return _timed(node.target, signature, device)


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype

    def materialize(self, device: torch.device) -> torch.Tensor:
        out = torch.empty_strided(self.sizes, self.strides, dtype=self.dtype, device=device)
        return out.normal_() if self.dtype.is_floating_point else out.zero_()


@dataclasses.dataclass(frozen=True)
class _DictSpec:
    items: tuple[tuple[str, Hashable], ...]


class _Untimeable(Exception):
    """An argument the op's time depends on and random values cannot stand for."""


def _signature(value: Any) -> Hashable:
    """A hashable description of an argument tree, each tensor as a :class:`_TensorSpec`;
    raises :class:`_Untimeable` where a size has no hint or an integer tensor's values
    (offsets, indices) decide the work."""
    if isinstance(value, torch.Tensor):
        sizes = tuple(_compat.concrete_int(s) for s in value.shape)
        strides = tuple(_compat.concrete_int(s) for s in value.stride())
        if None in sizes or None in strides:
            raise _Untimeable("a size without a hint")
        if not value.dtype.is_floating_point and value.numel() > 1:
            raise _Untimeable("an integer tensor whose values decide the work")
        return _TensorSpec(sizes, strides, value.dtype)  # type: ignore[arg-type]
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return _DictSpec(tuple((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, torch.SymInt):
        hint = _compat.concrete_int(value)
        if hint is None:
            raise _Untimeable("a size without a hint")
        return hint
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    raise _Untimeable(f"an argument of type {type(value).__name__}")


def _materialize(signature: Hashable, device: torch.device) -> Any:
    if isinstance(signature, _TensorSpec):
        return signature.materialize(device)
    if isinstance(signature, _DictSpec):
        return {k: _materialize(v, device) for k, v in signature.items}
    if isinstance(signature, tuple):
        return tuple(_materialize(v, device) for v in signature)
    return signature


@functools.lru_cache(maxsize=4096)
def _timed(target: Callable[..., Any], signature: Hashable, device: torch.device) -> float | None:
    """Mean seconds of ``REPEATS`` calls after a warm-up (library heuristics, autotuning);
    None where the op fails on random values or the device is out of memory."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    try:
        with _compat.outside_fake_mode(), torch.no_grad():
            args, kwargs = _materialize(signature, device)
            target(*args, **kwargs)
            synchronize()
            start = time.perf_counter()
            for _ in range(REPEATS):
                target(*args, **kwargs)
            synchronize()
            return (time.perf_counter() - start) / REPEATS
    except (RuntimeError, TypeError, ValueError):
        return None
