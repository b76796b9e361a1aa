"""Measure a CUDA device's copy bandwidths, matrix rates, memory bandwidth and least time
per kernel, and the host's time for the transfer ops, once per device model (kept for
the process and in the device cache, device_cache.py); or, with every local rank
copying at once, the copy bandwidths each rank of a host actually gets
(``calibrate_shared``). ``profile_for`` picks the profile a chunk is planned with,
measuring the device where no built-in one fits.

A compiled kernel's host cost is not measured here (that takes compiling code, and
calibration runs inside a compile): it is the built-in figure, which
``python -m benchmarks.op_overhead`` measures."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from offload_pass import _compat, device_cache, ops
from offload_pass.profiles import (
    BUILT_IN,
    CALIBRATE,
    CUDA_HOST,
    DeviceProfile,
    built_in_for_name,
)

COPY_BYTES = 256 * 2**20
MATMUL_SIZE = 8192
REPEATS = 5
HOST_CALLS = 200
HOST_BUCKET = 8
"""Storages per op where the host time a further storage adds is measured."""
FLOOR_KERNELS = 1000
FLOOR_SPIN_CYCLES = 100_000_000
"""About 60 ms at 1.7 GHz: longer than any host takes to launch the chain."""
CALIBRATED_PROFILE = "calibrated profile"
MEASURED = "measured"
"""The device cache's section and key of the profile ``calibrate`` measured."""


def _seconds(work: Callable[[], None], align: Callable[[], None] = lambda: None) -> float:
    """Median seconds of ``work`` on the current stream, after one warm-up; ``align`` runs
    before each timed repeat (a barrier, so that every rank copies at the same time)."""
    work()
    times = []
    for _ in range(REPEATS):
        align()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _both_directions_seconds(
    source: torch.Tensor,
    host: torch.Tensor,
    host_source: torch.Tensor,
    target: torch.Tensor,
    align: Callable[[], None],
) -> float:
    streams = (torch.cuda.Stream(source.device), torch.cuda.Stream(source.device))

    def copy_both_ways() -> None:
        current = torch.cuda.current_stream()
        for stream in streams:
            stream.wait_stream(current)
        with torch.cuda.stream(streams[0]):
            host.copy_(source, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            target.copy_(host_source, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)

    return _seconds(copy_both_ways, align)


@dataclasses.dataclass(frozen=True)
class CopyBandwidths:
    """Bytes per second: device to host, host to device, both at once (their sum)."""

    device_to_host: float
    host_to_device: float
    both_directions: float


def _copy_bandwidths(device: torch.device, align: Callable[[], None]) -> CopyBandwidths:
    on_device = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    other = torch.empty_like(on_device)
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    second_host = torch.empty_like(host).pin_memory()
    return CopyBandwidths(
        COPY_BYTES / _seconds(lambda: host.copy_(on_device, non_blocking=True), align),
        COPY_BYTES / _seconds(lambda: other.copy_(second_host, non_blocking=True), align),
        2 * COPY_BYTES / _both_directions_seconds(on_device, host, second_host, other, align),
    )


def _matmul_rate(device: torch.device, dtype: torch.dtype, size: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / _seconds(lambda: torch.mm(a, b))


@dataclasses.dataclass(frozen=True)
class TransferHostSeconds:
    """Host seconds per storage moved: an offload with its wait, a reload with its wait."""

    offload: float
    reload: float


def _host_seconds(call: Callable[[], object], calls: int) -> float:
    """Host seconds per call of ``call``, after as many calls to warm up."""
    for _ in range(calls):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def transfer_host_seconds(
    device: torch.device, calls: int = HOST_CALLS, per_op: int = 1
) -> TransferHostSeconds:
    """The host's time for the transfer ops, on tensors small enough that the copies
    themselves cost nothing: what each storage moved adds to the host's side of a step,
    ``per_op`` storages moved by each op. Each buffer dies before the next call, as in
    training, so pinned blocks are reused."""
    a = [torch.randn(256, device=device) for _ in range(per_op)]
    layouts = [0] * per_op
    h = ops.OFFLOAD_WAIT(ops.OFFLOAD(a, layouts), a, layouts, [])
    seconds = TransferHostSeconds(
        offload=_host_seconds(
            lambda: ops.OFFLOAD_WAIT(ops.OFFLOAD(a, layouts), a, layouts, []), calls
        )
        / per_op,
        reload=_host_seconds(lambda: ops.RELOAD_WAIT(ops.RELOAD(h, device, []), h, device), calls)
        / per_op,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return seconds


@dataclasses.dataclass(frozen=True)
class BucketedHostSeconds:
    """Host seconds of an offload and a reload pair moving one storage (``alone``), and
    what each further storage adds to such a pair (``added``)."""

    alone: TransferHostSeconds
    added: TransferHostSeconds


def bucketed_host_seconds(
    device: torch.device, calls: int = HOST_CALLS, bucket: int = HOST_BUCKET
) -> BucketedHostSeconds:
    """Ops moving one storage against ops moving ``bucket``: a pair of ops costs the
    host a fixed part and a part per storage, and the two timings give both."""
    alone = transfer_host_seconds(device, calls)
    full = transfer_host_seconds(device, calls, per_op=bucket)

    def added(one: float, per_storage: float) -> float:
        return max(0.0, (bucket * per_storage - one) / (bucket - 1))

    return BucketedHostSeconds(
        alone,
        TransferHostSeconds(added(alone.offload, full.offload), added(alone.reload, full.reload)),
    )


@functools.cache
def calibrate(device_index: int) -> DeviceProfile:
    """The profile of ``cuda:device_index`` as measured (a few seconds) on the first
    calibration of its model; kept for the process and in the device cache."""
    device = torch.device("cuda", device_index)
    kept = _kept_profile(device)
    if kept is not None:
        return kept
    profile = _measured_profile(device)
    device_cache.record(device, CALIBRATED_PROFILE, MEASURED, dataclasses.asdict(profile))
    return profile


def _kept_profile(device: torch.device) -> DeviceProfile | None:
    """The profile the device cache keeps for ``device``; None where it keeps none, or one
    that no longer describes a ``DeviceProfile`` (a field added since goes unmeasured)."""
    fields = device_cache.read(device).get(CALIBRATED_PROFILE, {}).get(MEASURED)
    names = {field.name for field in dataclasses.fields(DeviceProfile)}
    if not isinstance(fields, dict) or set(fields) != names:
        return None
    try:
        return DeviceProfile(**fields)
    except (TypeError, ValueError):
        return None


def _measured_profile(device: torch.device) -> DeviceProfile:
    with torch.cuda.device(device), _compat.outside_compile():
        copies = _copy_bandwidths(device, lambda: None)
        on_device = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        other = torch.empty_like(on_device)
        memory = 2 * COPY_BYTES / _seconds(lambda: other.copy_(on_device))
        bf16 = _matmul_rate(device, torch.bfloat16, MATMUL_SIZE)
        fp32 = _matmul_rate(device, torch.float32, MATMUL_SIZE // 2)
        host = bucketed_host_seconds(device)
        floor = kernel_floor_seconds(device)
    name = f"calibrated {torch.cuda.get_device_name(device)}"
    return DeviceProfile(
        name,
        bf16,
        fp32,
        memory,
        copies.device_to_host,
        copies.host_to_device,
        copies.both_directions,
        kernel_launch_seconds=CUDA_HOST["kernel_launch_seconds"],
        offload_host_seconds=host.alone.offload,
        reload_host_seconds=host.alone.reload,
        bucketed_offload_host_seconds=host.added.offload,
        bucketed_reload_host_seconds=host.added.reload,
        kernel_floor_seconds=floor,
    )


def kernel_floor_seconds(device: torch.device, kernels: int = FLOOR_KERNELS) -> float:
    """The device's time per kernel in a chain of ``kernels`` one-element in-place adds,
    each timed chain queued behind a spin, so that the host has launched it before the
    device reaches it and the device waits on nothing but itself."""
    one = torch.zeros(1, device=device)

    def chain() -> None:
        for _ in range(kernels):
            one.add_(1)

    return _seconds(chain, lambda: _compat.spin_device(device, FLOOR_SPIN_CYCLES)) / kernels


def calibrate_shared(group: dist.ProcessGroup | None = None) -> DeviceProfile:
    """This rank's device profile with the copy bandwidths it gets while every rank of
    ``group`` (default: the world) copies at the same time.

    Ranks on one host share its PCIe switches and host memory, so each gets a share of
    what one GPU measures alone. Call it on every rank of ``group`` (a collective), after
    ``init_process_group`` and ``torch.cuda.set_device``; pass the result as
    ``backend(profile=...)``. Every rank gets the slowest rank's bandwidths, so that all
    stages plan with the same figures. Compute rates come from the built-in profile of
    the device, or are measured where there is none.
    """
    if not dist.is_initialized():
        raise RuntimeError("calibrate_shared is a collective: call init_process_group first")
    if not torch.cuda.is_available():
        raise RuntimeError("calibrate_shared measures CUDA copies; no CUDA device is available")
    index = torch.cuda.current_device()
    device = torch.device("cuda", index)
    base = built_in_for_name(torch.cuda.get_device_name(device)) or calibrate(index)

    def align() -> None:
        torch.cuda.synchronize(device)
        dist.barrier(group)
        torch.cuda.synchronize(device)

    copies = _copy_bandwidths(device, align)
    on = device if dist.get_backend(group) == dist.Backend.NCCL else torch.device("cpu")
    slowest = torch.tensor(dataclasses.astuple(copies), dtype=torch.float64, device=on)
    dist.all_reduce(slowest, dist.ReduceOp.MIN, group=group)
    ranks = dist.get_world_size(group)
    return dataclasses.replace(
        base,
        name=f"{base.name} shared by {ranks} ranks",
        **dict(zip((f.name for f in dataclasses.fields(copies)), slowest.tolist(), strict=True)),
    )


def calibrate_unknown(device_index: int) -> DeviceProfile:
    name = torch.cuda.get_device_name(device_index)
    warnings.warn(
        f"offload_pass has no built-in profile for {name!r}; measuring it once "
        "(pass profile=... to choose one instead)",
        stacklevel=2,
    )
    return calibrate(device_index)


def profile_for(spec: DeviceProfile | str | None, device: torch.device) -> DeviceProfile:
    """The profile a chunk on ``device`` is planned with.

    ``None`` picks from the device: the CPU profile, the built-in one whose name the CUDA
    device carries, or, for an unknown CUDA device, a calibration (with a warning).
    """
    if isinstance(spec, DeviceProfile):
        return spec
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    if spec == CALIBRATE:
        if device.type != "cuda":
            raise ValueError(
                f"profile='calibrate' measures a CUDA device; the graph is on {device}"
            )
        return calibrate(_index(device))
    if device.type != "cuda":
        return BUILT_IN["cpu"]
    known = built_in_for_name(torch.cuda.get_device_name(device))
    return known if known is not None else calibrate_unknown(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
