"""Measure a CUDA device's copy bandwidths, matrix rates and memory bandwidth, once per
process and device."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch

from offload_pass.profiles import DeviceProfile

COPY_BYTES = 256 * 2**20
MATMUL_SIZE = 8192
REPEATS = 5


def _seconds(work: Callable[[], None]) -> float:
    """Median seconds of ``work`` on ``device``'s current stream, after one warm-up."""
    work()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _both_directions_seconds(
    source: torch.Tensor, host: torch.Tensor, host_source: torch.Tensor, target: torch.Tensor
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

    return _seconds(copy_both_ways)


def _matmul_rate(device: torch.device, dtype: torch.dtype, size: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / _seconds(lambda: torch.mm(a, b))


@functools.cache
def calibrate(device_index: int) -> DeviceProfile:
    """Measure ``cuda:device_index`` (a few seconds; cached for the process)."""
    device = torch.device("cuda", device_index)
    with torch.cuda.device(device):
        on_device = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        other = torch.empty_like(on_device)
        host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
        second_host = torch.empty_like(host).pin_memory()
        d2h = COPY_BYTES / _seconds(lambda: host.copy_(on_device, non_blocking=True))
        h2d = COPY_BYTES / _seconds(lambda: other.copy_(second_host, non_blocking=True))
        both = 2 * COPY_BYTES / _both_directions_seconds(on_device, host, second_host, other)
        memory = 2 * COPY_BYTES / _seconds(lambda: other.copy_(on_device))
        bf16 = _matmul_rate(device, torch.bfloat16, MATMUL_SIZE)
        fp32 = _matmul_rate(device, torch.float32, MATMUL_SIZE // 2)
    name = f"calibrated {torch.cuda.get_device_name(device)}"
    return DeviceProfile(name, bf16, fp32, memory, d2h, h2d, both)


def calibrate_unknown(device_index: int) -> DeviceProfile:
    name = torch.cuda.get_device_name(device_index)
    warnings.warn(
        f"offload_pass has no built-in profile for {name!r}; measuring it once "
        "(pass profile=... to choose one instead)",
        stacklevel=2,
    )
    return calibrate(device_index)
