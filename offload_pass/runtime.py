"""What the offload ops do when they run: copy streams, completion events, host buffers.

State is per transfer, never per chunk: each op's copies in flight are named by their own
ticket (a scalar CPU tensor the graph passes from the op that starts the copies to the op
that waits for them) and record their own completion event. The buffers the copies write
stay with the runtime until the wait hands them to the graph, so nothing reads them
early; a reload's device buffers are also recorded on the copy stream, so that if
backward raises before the wait, the allocator does not hand one out again while the
copy still writes it.

Pinned host buffers come from PyTorch's caching host allocator, which keeps freed blocks
for reuse (no new pinned allocation in steady state) and hands a block out again only
after the copies recorded against it have completed.

On a device other than CUDA every copy runs synchronously on the current thread and every
wait is a no-op, so CPU tests run the same graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence

import torch

from offload_pass import _compat


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
    pending_offloads: int
    pending_reloads: int
    offloads: int
    bytes_offloaded: int


@dataclasses.dataclass(frozen=True)
class _PendingCopy:
    """One op's copies in flight: the buffers they write, in order, and the event
    recorded after the last (None off CUDA); the stream runs them in order, so it marks
    them all done."""

    buffers: tuple[torch.Tensor, ...]
    done: torch.cuda.Event | None


_lock = threading.Lock()
_streams: dict[int, CopyStreams] = {}
# Copies in flight, by ticket number. An entry leaves at its wait, or when its ticket
# dies unwaited (forward or backward raised in between).
_pending_offloads: dict[int, _PendingCopy] = {}
_pending_reloads: dict[int, _PendingCopy] = {}
# Completion events of the offloads, by the data pointer of the live host tensor; an
# entry is removed by a finalizer when that tensor dies.
_offload_done: dict[int, torch.cuda.Event | None] = {}
_ticket_numbers = itertools.count()
_totals = {"offloads": 0, "bytes": 0}


def counts() -> TransferCounts:
    return TransferCounts(
        host_buffers=len(_offload_done),
        pending_offloads=len(_pending_offloads),
        pending_reloads=len(_pending_reloads),
        offloads=_totals["offloads"],
        bytes_offloaded=_totals["bytes"],
    )


@contextlib.contextmanager
def _nvtx_range(name: str, device: torch.device) -> Iterator[None]:
    """An NVTX range ``offload_pass::<name>`` for Nsight traces, on CUDA. (torch.profiler
    names the op itself: the dispatcher records each call of ``offload_pass::<name>``.)"""
    if device.type != "cuda":
        yield
        return
    torch.cuda.nvtx.range_push(f"offload_pass::{name}")
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


def new_ticket_like() -> torch.Tensor:
    """A ticket's shape and type: a scalar int64 CPU tensor."""
    return torch.empty((), dtype=torch.int64)


def _issue(table: dict[int, _PendingCopy], copy: _PendingCopy) -> torch.Tensor:
    number = next(_ticket_numbers)
    ticket = torch.tensor(number)
    table[number] = copy
    weakref.finalize(ticket, table.pop, number, None)
    return ticket


def _redeem(table: dict[int, _PendingCopy], ticket: torch.Tensor, op: str) -> _PendingCopy:
    copy = table.pop(int(ticket), None)
    if copy is None:
        raise OffloadError(
            f"{op}: ticket {int(ticket)} names no copy in flight (it was waited for already, "
            "or was not produced by offload_pass)"
        )
    return copy


def _wait(copy: _PendingCopy, device: torch.device) -> list[torch.Tensor]:
    if copy.done is not None:
        _compat.current_stream(device.index).wait_event(copy.done)
    return list(copy.buffers)


@contextlib.contextmanager
def _behind_compute(stream: torch.cuda.Stream) -> Iterator[None]:
    """Enqueue on ``stream`` within the block, after all the work already queued on its
    device's current stream; then on that stream again. What ``torch.cuda.stream`` does,
    without the lookups that cost each op several microseconds of host time."""
    with torch.cuda.device(stream.device_index):
        current = _compat.current_stream(stream.device_index)
        stream.wait_stream(current)
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(current)


def _host_buffer(a: torch.Tensor, layout: Sequence[int]) -> torch.Tensor:
    pin = a.device.type == "cuda"
    try:
        return torch.empty_permuted(a.shape, layout, dtype=a.dtype, device="cpu", pin_memory=pin)
    except RuntimeError as error:
        nbytes = a.numel() * a.element_size()
        raise OffloadError(
            f"could not allocate {nbytes} bytes of {'pinned ' if pin else ''}host memory "
            f"to offload a {tuple(a.shape)} {a.dtype} activation; lower the offload "
            "fraction or raise min_bytes"
        ) from error


def _same_layout(a: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether ``a`` and ``h`` lay their elements out alike (dimensions of one element
    have any stride): then one flat copy moves ``a`` into ``h``."""
    return all(n <= 1 or x == y for n, x, y in zip(a.shape, a.stride(), h.stride(), strict=True))


def _in_layout_of(h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``a``, or a copy of it on the device laid out as ``h`` is where they differ (the
    compiler chose another layout for ``a`` than the one backward was compiled for).

    torch copies between devices with one flat copy only where both sides are laid out
    alike; otherwise it stages through pageable host memory, and the copy blocks the
    host. Reordering on the device first keeps the copy asynchronous."""
    if _same_layout(a, h):
        return a
    return torch.empty_strided(a.shape, h.stride(), dtype=a.dtype, device=a.device).copy_(a)


def _one_device(tensors: Sequence[torch.Tensor], op: str) -> torch.device:
    if not tensors:
        raise OffloadError(f"{op}: no tensors given")
    device = tensors[0].device
    devices = {str(t.device) for t in tensors}
    if len(devices) > 1:
        raise OffloadError(f"{op}: one call moves tensors of one device, got {sorted(devices)}")
    return device


def offload(tensors: Sequence[torch.Tensor], layouts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Copy each of ``tensors`` into a new host buffer laid out as its entry of ``layouts``
    says, one after another on the device-to-host stream; the ticket naming them."""
    device = _one_device(tensors, "offload")
    with _nvtx_range("offload", device):
        hosts = tuple(_host_buffer(a, layout) for a, layout in zip(tensors, layouts, strict=True))
        event = None
        if device.type == "cuda":
            streams = copy_streams(device)
            with _behind_compute(streams.device_to_host):
                for h, a in zip(hosts, tensors, strict=True):
                    h.copy_(_in_layout_of(h, a), non_blocking=True)
                event = torch.cuda.Event()
                event.record(streams.device_to_host)
        else:
            for h, a in zip(hosts, tensors, strict=True):
                h.copy_(a)
        for h in hosts:
            key = h.untyped_storage().data_ptr()
            _offload_done[key] = event
            weakref.finalize(h, _offload_done.pop, key, None)
            _totals["offloads"] += 1
            _totals["bytes"] += h.numel() * h.element_size()
        return _issue(_pending_offloads, _PendingCopy(hosts, event))


def offload_wait(ticket: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """The compute stream waits for the copies ``ticket`` names; after this the device
    tensors they read may be freed."""
    with _nvtx_range("offload_wait", device):
        return _wait(_redeem(_pending_offloads, ticket, "offload_wait"), device)


def offload_release(ticket: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The host buffers of the copies ``ticket`` names, handed on without making compute
    wait for them: their copies go on under the compute that follows (other forwards of
    the chunk). Each of ``tensors``, the device tensors they read, is recorded on the
    device-to-host stream, so that the allocator hands its memory out again only once the
    copy has read it; a reload waits for the copy whoever issues it
    (:func:`wait_for_offload`)."""
    device = _one_device(tensors, "offload_release")
    with _nvtx_range("offload_release", device):
        copy = _redeem(_pending_offloads, ticket, "offload_release")
        if device.type == "cuda":
            stream = copy_streams(device).device_to_host
            for a in tensors:
                a.record_stream(stream)
        return list(copy.buffers)


def wait_for_offload(stream: torch.cuda.Stream, h: torch.Tensor) -> None:
    """The reload's copy stream never reads a host buffer still being filled.

    After an offload_wait this holds already (``h`` exists only after it, and the copy
    stream waits for compute); after an offload_release it holds only by this event,
    which makes it hold for any caller.
    """
    event = _offload_done.get(h.untyped_storage().data_ptr())
    if event is not None:
        stream.wait_event(event)


def reload(hosts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Copy each host tensor into a new buffer on ``device``, one after another on the
    host-to-device stream; the ticket naming them. Each buffer is an allocation of its
    own, never a view into a shared one: Inductor compiles the kernels reading them as
    for aligned buffers (``_compat.lower_with_aligned_outputs``)."""
    _one_device(hosts, "reload")
    with _nvtx_range("reload", device):
        loaded = tuple(
            torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device) for h in hosts
        )
        event = None
        if device.type == "cuda":
            streams = copy_streams(device)
            with _behind_compute(streams.host_to_device):
                for h in hosts:
                    wait_for_offload(streams.host_to_device, h)
                for g, h in zip(loaded, hosts, strict=True):
                    g.copy_(h, non_blocking=True)
                event = torch.cuda.Event()
                event.record(streams.host_to_device)
            for g in loaded:
                g.record_stream(streams.host_to_device)
        else:
            for g, h in zip(loaded, hosts, strict=True):
                g.copy_(h)
        return _issue(_pending_reloads, _PendingCopy(loaded, event))


def reload_wait(ticket: torch.Tensor) -> list[torch.Tensor]:
    copy = _redeem(_pending_reloads, ticket, "reload_wait")
    device = copy.buffers[0].device
    with _nvtx_range("reload_wait", device):
        return _wait(copy, device)
