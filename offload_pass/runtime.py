"""What the offload ops do when they run: copy streams, completion events, host buffers.

State is per transfer, never per chunk: each op's copies in flight are named by their own
ticket (a scalar CPU tensor the graph passes from the op that starts the copies to the op
that waits for them) and record their own completion event. The buffers the copies write
stay with the runtime until the wait hands them to the graph, so nothing reads them
early; a reload's device buffers are also recorded on the copy stream, so that if
backward raises before the wait, the allocator does not hand one out again while the
copy still writes it.

Pinned host memory comes from PyTorch's caching host allocator, which keeps freed blocks
for reuse (no new pinned allocation in steady state) and hands a block out again only
after the copies recorded against it have completed.

Every op runs on the host between the kernels of a compiled step, and where the host is
what bounds the step its time is the step's: each part here is the cheapest call that
does what it must (one reused event to order a copy stream behind compute, weak
references rather than finalizers), as ``benchmarks.op_overhead`` measures.

On a device other than CUDA every copy runs synchronously on the current thread and every
wait is a no-op, so CPU tests run the same graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
    them all done. ``ticket`` is a weak reference to the ticket naming them, which drops
    the entry if the ticket dies unwaited."""

    buffers: tuple[torch.Tensor, ...]
    done: torch.cuda.Event | None
    ticket: weakref.ref[torch.Tensor]


_lock = threading.Lock()
_streams: dict[int, CopyStreams] = {}
# Copies in flight, by ticket number. An entry leaves at its wait, or when its ticket
# dies unwaited (forward or backward raised in between).
_pending_offloads: dict[int, _PendingCopy] = {}
_pending_reloads: dict[int, _PendingCopy] = {}
# Completion events of the offloads, by the data pointer of the live host buffer each
# fills, beside a weak reference to that buffer whose callback removes the entry.
_offload_done: dict[int, tuple[torch.cuda.Event | None, weakref.ref[torch.Tensor]]] = {}
# Per thread and device, the event that orders a copy stream behind compute; recorded and
# waited for at once, so one serves every op of that thread on that device.
_fences = threading.local()
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


def copy_streams(device: torch.device) -> CopyStreams:
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _streams.get(index)
    if streams is not None:
        return streams
    with _lock:
        if index not in _streams:
            with torch.cuda.device(index):
                _streams[index] = CopyStreams(torch.cuda.Stream(), torch.cuda.Stream())
        return _streams[index]


def new_ticket_like() -> torch.Tensor:
    """A ticket's shape and type: a scalar int64 CPU tensor."""
    return torch.empty((), dtype=torch.int64)


def _issue(
    table: dict[int, _PendingCopy],
    buffers: tuple[torch.Tensor, ...],
    done: torch.cuda.Event | None,
) -> torch.Tensor:
    number = next(_ticket_numbers)
    ticket = torch.tensor(number)
    forget = functools.partial(_forget_ticket, table, number)
    table[number] = _PendingCopy(buffers, done, weakref.ref(ticket, forget))
    return ticket


def _forget_ticket(table: dict[int, _PendingCopy], number: int, _: object) -> None:
    table.pop(number, None)


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
def _behind_compute(stream: torch.cuda.Stream, name: str) -> Iterator[None]:
    """Enqueue on ``stream`` within the block, after all the work already queued on its
    device's current stream; then on that stream again. What ``torch.cuda.stream`` with
    ``wait_stream`` does, without the lookups and the new event that cost each op
    microseconds of host time. The block is an NVTX range ``offload_pass::<name>`` for
    Nsight traces (torch.profiler names the op itself)."""
    index = stream.device_index
    previous_device = torch.cuda.current_device()
    if previous_device != index:
        torch.cuda.set_device(index)
    torch.cuda.nvtx.range_push(name)
    current = _compat.current_stream(index)
    fence = _fence(index)
    fence.record(current)
    stream.wait_event(fence)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(current)
        torch.cuda.nvtx.range_pop()
        if previous_device != index:
            torch.cuda.set_device(previous_device)


def _fence(device_index: int) -> torch.cuda.Event:
    """This thread's event for ordering a copy stream of device ``device_index`` behind
    compute: a wait takes the event as last recorded, so recording it again later
    changes no earlier wait."""
    by_device = _fences.__dict__.setdefault("by_device", {})
    fence = by_device.get(device_index)
    if fence is None:
        fence = by_device[device_index] = torch.cuda.Event()
    return fence


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


def _track(h: torch.Tensor, done: torch.cuda.Event | None) -> None:
    """Keep ``done`` for reloads of host buffer ``h`` while ``h`` lives."""
    key = h.untyped_storage().data_ptr()
    _offload_done[key] = (done, weakref.ref(h, functools.partial(_forget_host_buffer, key)))


def _forget_host_buffer(key: int, buffer: weakref.ref[torch.Tensor]) -> None:
    entry = _offload_done.get(key)
    if entry is not None and entry[1] is buffer:
        del _offload_done[key]


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
    if any(t.device != device for t in tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise OffloadError(f"{op}: one call moves tensors of one device, got {devices}")
    return device


def offload(tensors: Sequence[torch.Tensor], layouts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Copy each of ``tensors`` into a new host buffer laid out as its entry of ``layouts``
    says, one after another on the device-to-host stream; the ticket naming them."""
    device = _one_device(tensors, "offload")
    hosts = tuple(_host_buffer(a, layout) for a, layout in zip(tensors, layouts, strict=True))
    event = None
    if device.type == "cuda":
        stream = copy_streams(device).device_to_host
        with _behind_compute(stream, "offload_pass::offload"):
            for h, a in zip(hosts, tensors, strict=True):
                h.copy_(_in_layout_of(h, a), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
    else:
        for h, a in zip(hosts, tensors, strict=True):
            h.copy_(a)
    for h in hosts:
        _track(h, event)
    _totals["offloads"] += len(hosts)
    _totals["bytes"] += sum(h.numel() * h.element_size() for h in hosts)
    return _issue(_pending_offloads, hosts, event)


def offload_wait(ticket: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """The compute stream waits for the copies ``ticket`` names; after this the device
    tensors they read may be freed."""
    return _wait(_redeem(_pending_offloads, ticket, "offload_wait"), device)


def offload_release(ticket: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The host buffers of the copies ``ticket`` names, handed on without making compute
    wait for them: their copies go on under the compute that follows (other forwards of
    the chunk). Each of ``tensors``, the device tensors they read, is recorded on the
    device-to-host stream, so that the allocator hands its memory out again only once the
    copy has read it; a reload waits for the copy whoever issues it
    (:func:`wait_for_offload`)."""
    device = _one_device(tensors, "offload_release")
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
    event = offload_done(h)
    if event is not None:
        stream.wait_event(event)


def offload_done(h: torch.Tensor) -> torch.cuda.Event | None:
    """The event recorded after the offload that fills host buffer ``h`` (None off CUDA,
    or where ``h`` was not filled by an offload)."""
    entry = _offload_done.get(h.untyped_storage().data_ptr())
    return None if entry is None else entry[0]


def reload(hosts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Copy each host tensor into a new buffer on ``device``, one after another on the
    host-to-device stream; the ticket naming them. Each buffer is an allocation of its
    own, never a view into a shared one: Inductor compiles the kernels reading them as
    for aligned buffers (``_compat.lower_with_aligned_outputs``)."""
    _one_device(hosts, "reload")
    loaded = tuple(
        torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device) for h in hosts
    )
    event = None
    if device.type == "cuda":
        stream = copy_streams(device).host_to_device
        with _behind_compute(stream, "offload_pass::reload"):
            for h in hosts:
                wait_for_offload(stream, h)
            for g, h in zip(loaded, hosts, strict=True):
                g.copy_(h, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for g in loaded:
            g.record_stream(stream)
    else:
        for g, h in zip(loaded, hosts, strict=True):
            g.copy_(h)
    return _issue(_pending_reloads, loaded, event)


def reload_wait(ticket: torch.Tensor) -> list[torch.Tensor]:
    copy = _redeem(_pending_reloads, ticket, "reload_wait")
    return _wait(copy, copy.buffers[0].device)
