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
the device busy, and its clock settles lower under the power limit, by how much depends
on the power the step's own kernels draw (a wide product's more than attention's). So
every time measured is scaled by its chunk's settled slowdown (``settled_slowdown``):
the chunk's timed kernels queued back to back in their order, once the device has run
them so for ``SETTLE_SECONDS``, over the sum of their times alone; kept per set of
kernels like the kernels' times. Where that sequence cannot run (out of memory) or the
host cannot launch it as fast as the device runs it, a large reference product's
slowdown stands in (``sustained_slowdown``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
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
"""How long the reference product, or a chunk's timed kernels, run back to back before
their settled time is read."""
SETTLED_CALLS = 20
"""How many reference products are timed once settled."""
SETTLED_SECONDS = 0.25
"""How long a chunk's settled kernels are timed, after ``SETTLE_SECONDS`` of the same."""
LAUNCH_BOUND_SHARE = 0.5
"""A kernel sequence whose launch takes the host more than this share of the device's
time for it is launch-bound: the device waits on the host, and its clock is not read."""
LAUNCH_PROBE_CALLS = 128
"""How many of a sequence's calls its launch time is read from, scaled to all of them:
few enough that their kernels fit the device's launch queue, so that the host never
waits for the device to make room (a sequence of thousands of kernels would)."""
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
SETTLED_SLOWDOWN = "settled slowdown"
"""The device cache's section of chunks' settled slowdowns, keyed by kernel sequence."""
SEQUENCE_SETTINGS = f"settled for {SETTLE_SECONDS} s, timed for {SETTLED_SECONDS} s"

_kept_by_device: dict[tuple[torch.device, str], dict[str, float]] = {}


@dataclasses.dataclass(frozen=True)
class _Call:
    """One timed node as its kernel runs alone: the op and its arguments' description."""

    key: str
    target: Callable[..., Any]
    signature: Hashable

    @classmethod
    def of(cls, node: torch.fx.Node) -> _Call | None:
        """None where ``node`` has no FLOPs or reads values random ones cannot stand for."""
        if not _compat.flop_count(node):  # FLOPs are counted for ATen ops alone
            return None
        try:
            signature = _signature(_named_values(node))
        except Exception:  # noqa: BLE001  (advisory: any argument it cannot describe)
            return None
        target = _compat.computed_op(node).target
        key = repr((str(target), signature, _precision_settings()))
        return cls(key, target, signature)


@dataclasses.dataclass(frozen=True)
class SettledTimer:
    """Times a chunk's nodes on ``device``, each time alone scaled by ``slowdown``, the
    chunk's settled slowdown (``settled_slowdown``). A :data:`NodeTimer`."""

    device: torch.device
    slowdown: float

    def __call__(self, node: torch.fx.Node) -> float | None:
        seconds = measured_seconds(node, self.device)
        return None if seconds is None else seconds * self.slowdown


def timer_for(
    profile: DeviceProfile | str | None, device: torch.device, nodes: Sequence[torch.fx.Node]
) -> SettledTimer | None:
    """The timer of the chunk of ``nodes`` on ``device`` planned with ``profile`` (the
    option): a CUDA device is timed where the profile describes the device present
    (``None`` or ``"calibrate"``), not where a named or given profile plans for another
    one; each time at the chunk's settled clock. The CPU is not timed: its copies do not
    overlap compute, so there is nothing to hide."""
    if not _times_kernels(profile, device):
        return None
    return SettledTimer(device, settled_slowdown(nodes, device))


def alone_timer_for(
    profile: DeviceProfile | str | None, device: torch.device
) -> SettledTimer | None:
    """A timer of nodes on ``device`` to be weighed against one another (which of them
    the partitioner recomputes), where ``timer_for`` would time them: each at the clock
    of an idle device, since one settled slowdown would scale them all alike."""
    return SettledTimer(device, 1.0) if _times_kernels(profile, device) else None


def _times_kernels(profile: DeviceProfile | str | None, device: torch.device) -> bool:
    return device.type == "cuda" and profile in (None, CALIBRATE)


def measured_seconds(node: torch.fx.Node, device: torch.device) -> float | None:
    """Seconds ``node`` takes on ``device`` timed alone; None where it has no FLOPs,
    reads values random ones cannot stand for, or fails to run."""
    call = _Call.of(node)
    return None if call is None else _alone_seconds(call, device)


def _alone_seconds(call: _Call, device: torch.device) -> float | None:
    kept = _kept(device, KERNEL_SECONDS)
    if call.key not in kept:
        seconds = _timed(call.target, call.signature, device)
        if seconds is None:
            return None
        kept[call.key] = seconds
        device_cache.record(device, KERNEL_SECONDS, call.key, seconds)
    return kept[call.key]


def _kept(device: torch.device, section: str) -> dict[str, float]:
    """The numbers known for ``device`` in ``section``: read from the device cache on
    first use, and kept for the process where the cache is off."""
    if (device, section) not in _kept_by_device:
        _kept_by_device[device, section] = device_cache.numbers(device, section)
    return _kept_by_device[device, section]


def settled_slowdown(nodes: Sequence[torch.fx.Node], device: torch.device) -> float:
    """How much longer the timed kernels of ``nodes`` take queued back to back in their
    order, once the device has run them so for ``SETTLE_SECONDS``, than the sum of their
    times alone (below 1 where they run faster so); 1 where none is timed; the reference
    product's slowdown where the host launches them too slowly to keep the device busy.
    Kept per device for the process and on disk, per set of kernels with their counts:
    another split of the same graph, or its backward in another order, draws the same
    power. Not kept where they fail to run (out of memory), so that a later compile may."""
    calls = [c for c in map(_Call.of, nodes) if c is not None]
    alone = {c.key: _alone_seconds(c, device) for c in calls}
    timed = {key: seconds for key, seconds in alone.items() if seconds is not None}
    calls = [c for c in calls if c.key in timed]
    if not calls:
        return 1.0
    alone_seconds = sum(timed[c.key] for c in calls)
    kernels = f"{SEQUENCE_SETTINGS}\n{sorted(c.key for c in calls)}"
    key = hashlib.sha256(kernels.encode()).hexdigest()
    kept = _kept(device, SETTLED_SLOWDOWN)
    if key not in kept:
        slowdown = _sequence_slowdown(calls, alone_seconds, device)
        if slowdown is None:
            return sustained_slowdown(device)
        kept[key] = slowdown
        device_cache.record(device, SETTLED_SLOWDOWN, key, slowdown)
    return kept[key]


def _sequence_slowdown(
    calls: Sequence[_Call], alone_seconds: float, device: torch.device
) -> float | None:
    """The mean seconds of one pass of ``calls`` queued back to back after
    ``SETTLE_SECONDS`` of the same, over ``alone_seconds``; the reference product's
    slowdown where their launch bounds them (``launch_bound``); None where they fail to
    run."""
    if device.type != "cuda":
        return None  # the CPU has no settled clock to read
    try:
        with _compat.outside_compile(), torch.no_grad(), torch.random.fork_rng([device]):
            inputs = {c.key: _materialize(c.signature, device) for c in calls}

            def run(some: Sequence[_Call] = calls) -> None:
                for call in some:
                    args, kwargs = inputs[call.key]
                    call.target(*args, **kwargs)

            run()  # kernels first run in this process (library heuristics, handles)
            torch.cuda.synchronize(device)
            probe = calls[:LAUNCH_PROBE_CALLS]
            start = time.perf_counter()
            run(probe)  # onto an empty queue: the host's time to launch them
            probe_seconds = time.perf_counter() - start
            if launch_bound(probe_seconds * len(calls) / len(probe), alone_seconds):
                settled = None
            else:
                passes = math.ceil(SETTLED_SECONDS / alone_seconds)
                settled = _settled_seconds(run, device, passes)
    except Exception:  # noqa: BLE001  (advisory: the reference product stands in)
        return None
    return sustained_slowdown(device) if settled is None else settled / alone_seconds


def launch_bound(launch_seconds: float, device_seconds: float) -> bool:
    """Whether a kernel sequence the host takes ``launch_seconds`` to launch and the
    device ``device_seconds`` to run keeps the device waiting on the host: its clock
    would then be read with the device partly idle, unlike in the step."""
    return launch_seconds > LAUNCH_BOUND_SHARE * device_seconds


def _settled_seconds(run: Callable[[], object], device: torch.device, calls: int) -> float:
    """Mean seconds of ``calls`` calls of ``run`` queued back to back on ``device``, once
    it has run so for ``SETTLE_SECONDS``."""
    deadline = time.perf_counter() + SETTLE_SECONDS
    while time.perf_counter() < deadline:
        run()
        torch.cuda.synchronize(device)
    return _train_seconds(run, device, calls)


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
            settled = _settled_seconds(product, device, SETTLED_CALLS)
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
    """The arguments of the op the node computes (``_compat.computed_op``) as values,
    random-number state already described as specs."""
    op = _compat.computed_op(node)
    names = _compat.argument_names(op.target)

    def value(arg: Any, name: str | None) -> Any:
        found = torch.fx.node.map_arg(arg, lambda n: n.meta.get("val"))
        if name in RANDOM_STATE_ARGUMENTS and isinstance(found, torch.Tensor):
            return _TensorSpec.of(found)
        return found

    args = tuple(value(a, names[i] if i < len(names) else None) for i, a in enumerate(op.args))
    return args, {k: value(v, k) for k, v in op.kwargs.items()}


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
