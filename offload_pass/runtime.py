"""What the offload ops do when they run: copy streams, completion events, host buffers.

State is per transfer, never per chunk: each offload returns its own host tensor and
records its own completion event, and that event travels with the host tensor until the
tensor dies. Pinned host buffers come from PyTorch's caching host allocator, which keeps
freed blocks for reuse (no new pinned allocation in steady state) and hands a block out
again only after the copies recorded against it have completed.

On a device other than CUDA every copy runs synchronously on the current thread and every
wait is a no-op, so CPU tests run the same graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator, Sequence

import torch


class OffloadError(RuntimeError):
    """Raised when an offload or reload cannot be carried out correctly."""


@dataclasses.dataclass(frozen=True)
class CopyStreams:
    device_to_host: torch.cuda.Stream
    host_to_device: torch.cuda.Stream


@dataclasses.dataclass(frozen=True)
class TransferCounts:
    """Live runtime objects; all return to their baseline once saved tensors are freed."""

    host_buffers: int
    pending_reloads: int
    offloads: int
    bytes_offloaded: int


_lock = threading.Lock()
_streams: dict[int, CopyStreams] = {}
# Keyed by the data pointer of a live host tensor (or reloaded device tensor). An entry
# is removed by a finalizer when that tensor dies, so a key never outlives its storage.
_offload_done: dict[int, torch.cuda.Event | None] = {}
_reload_done: dict[int, torch.cuda.Event | None] = {}
_totals = {"offloads": 0, "bytes": 0}


def counts() -> TransferCounts:
    return TransferCounts(
        host_buffers=len(_offload_done),
        pending_reloads=len(_reload_done),
        offloads=_totals["offloads"],
        bytes_offloaded=_totals["bytes"],
    )


@contextlib.contextmanager
def _named(name: str, device: torch.device) -> Iterator[None]:
    """A range named ``offload_pass::<name>`` in torch.profiler traces, and in Nsight
    traces (NVTX) on CUDA."""
    label = f"offload_pass::{name}"
    with torch.profiler.record_function(label):
        if device.type != "cuda":
            yield
            return
        torch.cuda.nvtx.range_push(label)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


def copy_streams(device: torch.device) -> CopyStreams:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _streams:
            with torch.cuda.device(index):
                _streams[index] = CopyStreams(torch.cuda.Stream(), torch.cuda.Stream())
        return _streams[index]


def _track(table: dict, tensor: torch.Tensor, event: torch.cuda.Event | None) -> None:
    key = tensor.untyped_storage().data_ptr()
    table[key] = event
    weakref.finalize(tensor, table.pop, key, None)


def _host_buffer(a: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    pin = a.device.type == "cuda"
    try:
        return torch.empty_strided(a.shape, stride, dtype=a.dtype, device="cpu", pin_memory=pin)
    except RuntimeError as error:
        nbytes = a.numel() * a.element_size()
        raise OffloadError(
            f"could not allocate {nbytes} bytes of {'pinned ' if pin else ''}host memory "
            f"to offload a {tuple(a.shape)} {a.dtype} activation; lower the offload "
            "fraction or raise min_bytes"
        ) from error


def offload(a: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    with _named("offload", a.device):
        return _offload(a, stride)


def _offload(a: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    h = _host_buffer(a, stride)
    event = None
    if a.device.type == "cuda":
        streams = copy_streams(a.device)
        streams.device_to_host.wait_stream(torch.cuda.current_stream(a.device))
        with torch.cuda.stream(streams.device_to_host):
            h.copy_(a, non_blocking=True)
            event = torch.cuda.Event()
            event.record(streams.device_to_host)
    else:
        h.copy_(a)
    _track(_offload_done, h, event)
    _totals["offloads"] += 1
    _totals["bytes"] += h.numel() * h.element_size()
    return h


def _offload_event(h: torch.Tensor) -> torch.cuda.Event | None:
    key = h.untyped_storage().data_ptr()
    if key not in _offload_done:
        raise OffloadError(
            "host tensor was not produced by offload_pass.offload (or was already freed)"
        )
    return _offload_done[key]


def offload_wait(h: torch.Tensor, a: torch.Tensor) -> None:
    with _named("offload_wait", a.device):
        event = _offload_event(h)
        if event is not None:
            torch.cuda.current_stream(a.device).wait_event(event)


def wait_for_offload(stream: torch.cuda.Stream, h: torch.Tensor) -> None:
    """The reload's copy stream never reads a host buffer still being filled."""
    event = _offload_event(h)
    if event is not None:
        stream.wait_event(event)


def reload(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    with _named("reload", device):
        return _reload(h, device)


def _reload(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    g = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)
    event = None
    if device.type == "cuda":
        streams = copy_streams(device)
        streams.host_to_device.wait_stream(torch.cuda.current_stream(device))
        wait_for_offload(streams.host_to_device, h)
        with torch.cuda.stream(streams.host_to_device):
            g.copy_(h, non_blocking=True)
            event = torch.cuda.Event()
            event.record(streams.host_to_device)
    else:
        _offload_event(h)
        g.copy_(h)
    _track(_reload_done, g, event)
    return g


def reload_wait(g: torch.Tensor) -> None:
    key = g.untyped_storage().data_ptr()
    if key not in _reload_done:
        raise OffloadError("reload_wait on a tensor that no pending reload produced")
    event = _reload_done.pop(key)
    if event is not None:
        with _named("reload_wait", g.device):
            torch.cuda.current_stream(g.device).wait_event(event)
