"""Kernels timed on the CUDA device a chunk runs on: every node torch's FLOP formulas
count (matrix products, convolutions, attention forward and backward).

One matrix rate prices these nodes badly: the rate a product reaches depends on its shape
(a 2048-wide projection runs well below an 8192^3 product's rate), and attention's
kernels reach a fraction of it, less in backward than in forward. So each such node of a
CUDA chunk runs on random values of its shapes, strides and dtypes, and the cost model
prices it at the time measured. Timings are kept per op, signature and TF32 settings,
for the process and on disk for the device's model (device_cache.py), so a shape met
again (the next block, the next compile, the next process) is not timed again and every
process plans with the same times; a failure (out of memory, say) is not kept. The
values are random, so a node is not timed where values decide the work: an integer or
boolean tensor of offsets, indices or masks (the random-number state of attention with
dropout excepted). Timing is advisory: whatever goes wrong, the node keeps its price by
the rates.

A call timed alone runs at the clock of a device that was idle; a training step keeps
the device busy, and its clock settles lower under the power limit. So every time
measured is scaled by the device's sustained slowdown, measured once per device: a
large product's time once the device has run it back to back for ``SETTLE_SECONDS``,
over its time alone (``sustained_slowdown``), kept like the kernels' times.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.fx

from offload_pass import _compat, device_cache
from offload_pass.profiles import CALIBRATE, DeviceProfile

REPEATS = 5
LAUNCH_COVER_CYCLES = 1_000_000
"""Cycles the device spins before each timed call (about half a millisecond at 2 GHz):
longer than the host takes to launch one op's kernels."""
RANDOM_STATE_ARGUMENTS = frozenset({"philox_seed", "philox_offset", "rng_state"})
"""Integer arguments that seed random numbers rather than decide the work."""
SETTLE_SECONDS = 0.5
"""How long the reference product runs back to back before its settled time is read."""
SETTLED_CALLS = 20
REFERENCE_PRODUCT_SIZE = 8192
"""The reference product is this square, in bf16: long enough per call (about 1.4 ms on
an H200) that the device's power draw, not the host, sets its clock."""
NodeTimer = Callable[[torch.fx.Node], "float | None"]
"""Seconds one node's kernel takes on the device, or None where it was not timed."""
KERNEL_SECONDS = "kernel seconds"
"""The device cache's section of kernel times, keyed by op, signature and settings."""
SUSTAINED_SLOWDOWN = "sustained slowdown"
REFERENCE = f"bf16 product {REFERENCE_PRODUCT_SIZE}^3 settled for {SETTLE_SECONDS} s"
"""The key of the sustained slowdown: what it was measured with."""

_seconds_by_device: dict[torch.device, dict[str, float]] = {}


def timer_for(profile: DeviceProfile | str | None, device: torch.device) -> NodeTimer | None:
    """The timer of a chunk on ``device`` planned with ``profile`` (the option): a CUDA
    device is timed where the profile describes the device present (``None`` or
    ``"calibrate"``), not where a named or given profile plans for another one. The CPU
    is not timed: its copies do not overlap compute, so there is nothing to hide."""
    if device.type != "cuda" or profile not in (None, CALIBRATE):
        return None
    return functools.partial(measured_seconds, device=device)


def measured_seconds(node: torch.fx.Node, device: torch.device) -> float | None:
    """Seconds ``node`` takes on ``device``; None where it has no FLOPs, reads values
    random ones cannot stand for, or fails to run."""
    if not _compat.flop_count(node):  # FLOPs are counted for ATen ops alone
        return None
    try:
        signature = _signature(_named_values(node))
    except Exception:  # noqa: BLE001  (advisory: any argument it cannot describe)
        return None
    key = repr((str(node.target), signature, _precision_settings()))
    kept = _kept_seconds(device)
    if key not in kept:
        seconds = _timed(node.target, signature, device)
        if seconds is None:
            return None
        kept[key] = seconds
        device_cache.record(device, KERNEL_SECONDS, key, seconds)
    return kept[key] * sustained_slowdown(device)


def _kept_seconds(device: torch.device) -> dict[str, float]:
    """The kernel times known for ``device``: read from the device cache on first use."""
    if device not in _seconds_by_device:
        _seconds_by_device[device] = device_cache.numbers(device, KERNEL_SECONDS)
    return _seconds_by_device[device]


@functools.cache
def sustained_slowdown(device: torch.device) -> float:
    """How much longer the reference product takes once the device has run it back to back
    for ``SETTLE_SECONDS`` than timed alone after idling; at least 1, and 1 where it cannot
    be measured. Kept per device for the process and in the device cache."""
    kept = device_cache.numbers(device, SUSTAINED_SLOWDOWN).get(REFERENCE)
    if kept is not None:
        return kept
    measured = _measured_slowdown(device)
    if measured is None:
        return 1.0
    device_cache.record(device, SUSTAINED_SLOWDOWN, REFERENCE, measured)
    return measured


def _measured_slowdown(device: torch.device) -> float | None:
    try:
        with _compat.outside_compile(), torch.no_grad(), torch.random.fork_rng([device]):
            n = REFERENCE_PRODUCT_SIZE
            matrix = torch.randn(n, n, dtype=torch.bfloat16, device=device)

            def product() -> torch.Tensor:
                return matrix @ matrix

            product()
            alone = statistics.median(_elapsed(product, device) for _ in range(REPEATS))
            deadline = time.perf_counter() + SETTLE_SECONDS
            while time.perf_counter() < deadline:
                product()
                torch.cuda.synchronize(device)
            settled = _train_seconds(product, device, SETTLED_CALLS)
    except Exception:  # noqa: BLE001  (advisory: without it, calls are priced as timed)
        return None
    return max(1.0, settled / alone)


def _train_seconds(run: Callable[[], object], device: torch.device, calls: int) -> float:
    """Mean seconds of ``calls`` calls of ``run`` queued back to back on ``device``."""
    stream = torch.cuda.current_stream(device)
    start_event = torch.cuda.Event(enable_timing=True)
    end_event = torch.cuda.Event(enable_timing=True)
    start_event.record(stream)
    for _ in range(calls):
        run()
    end_event.record(stream)
    end_event.synchronize()
    return start_event.elapsed_time(end_event) / 1e3 / calls


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    """Not the device's index: a time is kept for the device's model, whichever one it is."""

    @classmethod
    def of(cls, value: torch.Tensor) -> _TensorSpec:
        sizes = tuple(_compat.concrete_int(s) for s in value.shape)
        strides = tuple(_compat.concrete_int(s) for s in value.stride())
        if None in sizes or None in strides:
            raise _Untimeable("a size without a hint")
        return cls(sizes, strides, value.dtype, value.device.type)  # type: ignore[arg-type]

    def materialize(self, device: torch.device) -> torch.Tensor:
        """Random values (zeros for integers) in these strides, overlapping ones included
        (an expanded bias): filled through the flat buffer they view. On ``device`` where
        it is of this spec's type, else on the spec's type of device (a CPU scalar)."""
        on = device if device.type == self.device_type else torch.device(self.device_type)
        extent = 1 + sum(
            (n - 1) * s for n, s in zip(self.sizes, self.strides, strict=True) if n > 0
        )
        flat = torch.zeros(extent if all(self.sizes) else 0, dtype=self.dtype, device=on)
        if self.dtype.is_floating_point:
            flat.normal_()
        return flat.as_strided(self.sizes, self.strides)


@dataclasses.dataclass(frozen=True)
class _DictSpec:
    items: tuple[tuple[str, Hashable], ...]


class _Untimeable(Exception):
    """An argument the op's time depends on and random values cannot stand for."""


def _named_values(node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The node's arguments as values, random-number state already described as specs."""
    names = _compat.argument_names(node.target)

    def value(arg: Any, name: str | None) -> Any:
        found = torch.fx.node.map_arg(arg, lambda n: n.meta.get("val"))
        if name in RANDOM_STATE_ARGUMENTS and isinstance(found, torch.Tensor):
            return _TensorSpec.of(found)
        return found

    args = tuple(value(a, names[i] if i < len(names) else None) for i, a in enumerate(node.args))
    return args, {k: value(v, k) for k, v in node.kwargs.items()}


def _signature(value: Any) -> Hashable:
    """A hashable description of an argument tree, each tensor as a :class:`_TensorSpec`;
    raises :class:`_Untimeable` where a size has no hint or a tensor's values (offsets,
    indices, masks) decide the work."""
    if isinstance(value, _TensorSpec):
        return value
    if isinstance(value, torch.Tensor):
        if not value.dtype.is_floating_point and value.numel() > 1:
            raise _Untimeable("an integer or boolean tensor whose values decide the work")
        return _TensorSpec.of(value)
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


def _precision_settings() -> tuple[bool, bool]:
    """The settings that change which kernels a product or convolution runs."""
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _timed(target: Callable[..., Any], signature: Hashable, device: torch.device) -> float | None:
    """Median seconds of ``REPEATS`` calls after a warm-up (library heuristics, autotuning);
    None where the op fails on random values or the device is out of memory. The random
    values come from a forked generator, so the compile's random state is untouched."""
    devices = [device] if device.type == "cuda" else []
    try:
        with _compat.outside_compile(), torch.no_grad(), torch.random.fork_rng(devices):
            args, kwargs = _materialize(signature, device)
            target(*args, **kwargs)
            return statistics.median(
                _elapsed(lambda: target(*args, **kwargs), device) for _ in range(REPEATS)
            )
    except Exception:  # noqa: BLE001  (advisory: the rates price what cannot run here)
        return None


def _elapsed(run: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``run`` keeps ``device`` busy: between two events on its
    current stream on CUDA, queued behind a spin so that the host has launched the
    kernels before the device reaches them (a kernel shorter than its launch would
    otherwise be timed at the launch's length); by the host's clock elsewhere."""
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    stream = torch.cuda.current_stream(device)
    start_event = torch.cuda.Event(enable_timing=True)
    end_event = torch.cuda.Event(enable_timing=True)
    _compat.spin_device(device, LAUNCH_COVER_CYCLES)
    start_event.record(stream)
    run()
    end_event.record(stream)
    end_event.synchronize()
    return start_event.elapsed_time(end_event) / 1e3
