"""Simulate one step of a chunk under a set of transfers: the host, the compute stream,
the two copy queues, and the device memory timeline.

Each copy queue is one FIFO stream. An offload starts when both its producer has run and
the device-to-host queue is free; a reload when it is issued, the host-to-device queue is
free and its offload has finished. The compute stream stalls at a wait whose copy has not
finished; a released copy (``Transfer.released``) makes it wait for nothing, and its
reload starts no earlier than it ends. Where copies do not overlap compute (CPU) each copy
stalls compute for its whole duration. The host issues every kernel and transfer op in
graph order, each at its cost in the device profile; nothing starts on the device before
the host has issued it, so where the host is slower than the device (short kernels),
each transfer op lengthens the step by its host cost.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence

from offload_pass.costs import ChunkCosts
from offload_pass.profiles import DeviceProfile
from offload_pass.ranges import RangeAddMax
from offload_pass.units import format_bytes, format_seconds


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One moved storage, by position: offload after forward node ``offload_at``,
    offload_wait after forward node ``wait_at``, reload before backward node ``reload_at``,
    reload_wait before backward node ``need_at``.

    A ``released`` storage's copy outlives its forward: at forward's end (``wait_at``) an
    offload_release, not an offload_wait, hands its host buffer on without making compute
    wait, and the allocator reuses the storage once the copy has read it. Only where other
    forwards of the chunk run before its backward (``in_flight`` above 1: a pipeline
    stage's microbatches, blocks compiled each on their own), under whose compute the copy
    ends."""

    root: str
    nbytes: int
    offload_at: int
    wait_at: int
    reload_at: int
    need_at: int
    released: bool = False


@dataclasses.dataclass(frozen=True)
class CopyPrediction:
    """Times in seconds from the start of forward."""

    root: str
    nbytes: int
    offload_start: float
    offload_end: float
    reload_start: float
    reload_end: float
    stall: float

    @property
    def copy_seconds(self) -> float:
        return self.offload_end - self.offload_start + self.reload_end - self.reload_start

    @property
    def hidden_share(self) -> float:
        """The share of this storage's copy time that compute did not wait for."""
        if self.copy_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.stall / self.copy_seconds)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One step as simulated; times in seconds from the start of forward.
    ``stall_seconds``: compute waiting for copies; ``host_wait_seconds``: compute waiting
    for the host to issue its kernels; ``host_seconds``: what the host takes to issue the
    step, had it never to wait for the device, ``forward_host_seconds`` what it takes to
    issue forward (``backward_host_seconds`` backward). ``forward_starts`` and
    ``backward_starts``: when each node starts computing."""

    forward_seconds: float
    backward_seconds: float
    stall_seconds: float
    host_wait_seconds: float
    host_seconds: float
    peak_bytes: int
    baseline_seconds: float
    baseline_peak_bytes: int
    copies: tuple[CopyPrediction, ...] = dataclasses.field(repr=False)
    forward_starts: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    backward_starts: tuple[float, ...] = dataclasses.field(default=(), repr=False)
    forward_host_seconds: float = 0.0

    @property
    def step_seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    @property
    def backward_host_seconds(self) -> float:
        """What the host takes to issue backward."""
        return self.host_seconds - self.forward_host_seconds

    @property
    def peak_saved_bytes(self) -> int:
        return self.baseline_peak_bytes - self.peak_bytes

    def within(self, stall_tolerance: float) -> bool:
        """Whether the step is within ``stall_tolerance`` of the step with nothing moved."""
        return self.step_seconds <= (1 + stall_tolerance) * self.baseline_seconds

    def __str__(self) -> str:
        moved = sum(c.nbytes for c in self.copies)
        return (
            f"step {format_seconds(self.baseline_seconds)} -> "
            f"{format_seconds(self.step_seconds)} (stall {format_seconds(self.stall_seconds)}), "
            f"peak {format_bytes(self.baseline_peak_bytes)} -> {format_bytes(self.peak_bytes)}, "
            f"{len(self.copies)} storages moved ({format_bytes(moved)})"
        )


@dataclasses.dataclass
class _Copy:
    transfer: Transfer
    offload_start: float = 0.0
    offload_end: float = 0.0
    reload_start: float = 0.0
    reload_end: float = 0.0
    stall: float = 0.0


@dataclasses.dataclass
class CopyQueue:
    """One copy stream: copies run one at a time, in the order they are issued."""

    free_at: float = 0.0

    def start_of(self, ready: float) -> float:
        """When a copy ready at ``ready`` would start, issued now."""
        return max(ready, self.free_at)

    def push(self, ready: float, seconds: float) -> tuple[float, float]:
        """Issue a copy ready at ``ready``; its start and end."""
        start = self.start_of(ready)
        self.free_at = start + seconds
        return start, self.free_at


@dataclasses.dataclass
class DeadlineChain:
    """The same queue planned backwards from each copy's deadline, latest deadline first:
    each copy starts as late as it can and still ends by its deadline and before the copy
    after it starts."""

    next_start: float = float("inf")

    def start_of(self, deadline: float, seconds: float) -> float:
        """The latest start of a copy due at ``deadline``, queued before the others."""
        return min(self.next_start, deadline) - seconds

    def push(self, deadline: float, seconds: float) -> float:
        self.next_start = self.start_of(deadline, seconds)
        return self.next_start


class _Streams:
    """The host's clock (how far it has issued work), the compute stream's clock, and
    what compute waited for: copies (``stall``) and the host (``host_wait``).

    A kernel starts once the compute stream is free and the host has issued it; a copy
    once its queue is free, the compute stream has reached the point it was issued at,
    and the host has issued it. Where copies cannot overlap compute, compute waits for
    each copy."""

    def __init__(self, profile: DeviceProfile) -> None:
        self.profile = profile
        self.host = 0.0
        self.clock = 0.0
        self.stall = 0.0
        self.host_wait = 0.0

    def run(self, seconds: float, host_seconds: float) -> float:
        """Issue (taking the host ``host_seconds``) and run one node; when it starts."""
        self.host += host_seconds
        start = max(self.clock, self.host)
        self.host_wait += start - self.clock
        self.clock = start + seconds
        return start

    def issue(
        self, queue: CopyQueue, ready: float, seconds: float, host_seconds: float
    ) -> tuple[float, float]:
        """A copy issued now, which may start once ``ready``."""
        self.host += host_seconds
        start, end = queue.push(max(self.clock, self.host, ready), seconds)
        if not self.profile.copies_overlap_compute:
            self.wait_for(end)
        return start, end

    def wait_for(self, done: float) -> float:
        stall = max(0.0, done - self.clock)
        self.clock += stall
        self.stall += stall
        return stall


def _by(transfers: Sequence[Transfer], key: str) -> dict[int, list[Transfer]]:
    buckets: dict[int, list[Transfer]] = defaultdict(list)
    for t in transfers:
        buckets[getattr(t, key)].append(t)
    return buckets


def _with_host_seconds(
    issued_at: dict[int, list[Transfer]],
    op_of: Callable[[Transfer], Hashable],
    alone: float,
    added: float,
) -> dict[int, list[tuple[Transfer, float]]]:
    """The transfers issued at each position, in order, each with what it costs the host
    (``_op_host_seconds``)."""
    return {
        at: list(zip(issued, _op_host_seconds(issued, op_of, alone, added), strict=True))
        for at, issued in issued_at.items()
    }


def _op_host_seconds(
    issued: Sequence[Transfer], op_of: Callable[[Transfer], Hashable], alone: float, added: float
) -> list[float]:
    """What each of ``issued`` (transfers issued at one position) costs the host. Those
    of one op (``op_of``: what else the rewrite joins them by) cost ``alone`` for its
    first storage and ``added`` for each further one."""
    seen: set[Hashable] = set()
    seconds = []
    for t in issued:
        op = op_of(t)
        seconds.append(added if op in seen else alone)
        seen.add(op)
    return seconds


def _offload_op(t: Transfer) -> tuple[int, bool]:
    """An offload op moves the storages placed at one node that are waited for at one
    node, and released or not alike."""
    return t.wait_at, t.released


def _reload_op(t: Transfer) -> int:
    """A reload op moves the storages placed at one node that are needed at one node."""
    return t.need_at


Hold = tuple[int, int, int]
"""Positions ``[start, stop)`` (forward's, then backward's after them) over which
``nbytes`` more are held: (start, stop, nbytes)."""


class MemoryTimeline:
    """Bytes live at each position of one step under a set of transfers; it answers what
    the peak would be with one of them kept on the device instead, without building the
    timeline again.

    The peak counts ``in_flight - 1`` other forwards of the chunk done and their
    backwards pending (a pipeline stage's warm-up, blocks compiled each on their own),
    each holding what this one holds between its forward and backward, what it returned
    included (``ChunkCosts.returned_bytes``), less its released storages: their copies
    end under the next forward's compute. So while this forward runs, the forward before
    it still holds its released storages (counted over all of this forward: their copies
    end somewhere in it). This one's own released storages count as held throughout: it
    may be the last forward before its backward, whose copies have nothing after them to
    end under.

    Inductor's buffer reuse holds buffers longer (``ChunkCosts.reuse_holds``) only where
    nothing moves: graphs that hold transfers are compiled with it off. What the timeline
    answers for one transfer kept assumes the others still move; with the last one kept,
    nothing moves, and the peak is the step's with the reuse on.
    """

    def __init__(
        self, costs: ChunkCosts, transfers: Sequence[Transfer], in_flight: int = 1
    ) -> None:
        allocated = list(costs.allocated)
        freed = list(costs.freed)
        if not transfers:  # Inductor's buffer reuse is on
            for hold in costs.reuse_holds:
                freed[hold.freed_at] -= hold.nbytes
                allocated[hold.reused_at] -= hold.nbytes
        for t in transfers:
            if not t.released:
                freed[t.wait_at] += t.nbytes
                allocated[costs.num_forward + t.reload_at] += t.nbytes
        net = (a - f for a, f in zip(allocated, freed, strict=True))
        held = list(itertools.accumulate(net, initial=0))
        live = [before + a for before, a in zip(held, allocated, strict=False)]
        released = sum(t.nbytes for t in transfers if t.released)
        if in_flight > 1:
            live[: costs.num_forward] = [b + released for b in live[: costs.num_forward]]
        self.live = RangeAddMax(live)
        self.top = max(live, default=0)
        self.held_between = held[costs.num_forward] - released + costs.returned_bytes
        self.resident = costs.resident_bytes
        self.in_flight = in_flight
        self.num_forward = costs.num_forward
        self.costs = costs
        self.moving = {t.root for t in transfers}
        self.reuse_off = bool(transfers)

    @property
    def peak(self) -> int:
        if self.reuse_off and not self.moving:
            return self.unmoved_peak
        return self.peak_of(self.top)

    @functools.cached_property
    def unmoved_peak(self) -> int:
        """The step's peak with nothing moved and Inductor's buffer reuse on: built only
        where every transfer may be kept, not on each timeline the planner makes."""
        return MemoryTimeline(self.costs, (), self.in_flight).peak

    def _add_kept(self, t: Transfer, nbytes: int) -> None:
        """Add ``nbytes`` wherever keeping ``t`` on the device holds it and moving it
        does not (``-nbytes`` takes that back): in this forward's own timeline from its
        wait to its reload (a released storage is held there either way); by each other
        forward between its forward and backward; and, released, less by the forward
        before this one over this one's forward, where its copy would run."""
        if not t.released:
            self.live.add(t.wait_at + 1, self.num_forward + t.reload_at, nbytes)
        elif self.in_flight > 1:
            self.live.add(0, self.num_forward, -nbytes)
        self.held_between += nbytes

    def peak_without(self, t: Transfer) -> int:
        if self.moving == {t.root}:
            return self.unmoved_peak
        self._add_kept(t, t.nbytes)
        peak = self.peak_of(self.live.max(0, len(self.live)))
        self._add_kept(t, -t.nbytes)
        return peak

    def peak_of(self, top: int) -> int:
        """The peak where this forward's own timeline tops at ``top``."""
        return self.resident + (self.in_flight - 1) * self.held_between + top

    def keep(self, t: Transfer) -> None:
        """Count ``t``'s storage as held on the device throughout."""
        self.moving.discard(t.root)
        self._add_kept(t, t.nbytes)
        self.top = self.live.max(0, len(self.live))

    def pass_top(self, position: int) -> int:
        """The most bytes live at once in the pass (forward or backward) of ``position``."""
        if position < self.num_forward:
            return self.live.max(0, self.num_forward)
        return self.live.max(self.num_forward, len(self.live))

    def hold_if_fits(self, holds: Sequence[Hold]) -> bool:
        """Count each hold's bytes as held over its positions, and say so, where that
        leaves the top of each pass where it is; else change nothing and say not.

        Each pass is held to its own top, not the step's: the two are compiled apart, and
        one pass's peak predicted too high must not make room in the other. (Inductor
        holds less in Qwen2's backward than counted here; forward's buckets, held up to
        that backward peak, raised the measured peak at forward's end by 0.22 GiB:
        docs/gpu-validation.md, run 117)."""
        segments = [
            piece
            for start, stop, level in _levels(holds)
            for piece in (
                (start, min(stop, self.num_forward), level),
                (max(start, self.num_forward), stop, level),
            )
            if piece[0] < piece[1]
        ]
        tops = [self.pass_top(start) for start, _, _ in segments]
        if any(
            self.live.max(start, stop) + level > top
            for (start, stop, level), top in zip(segments, tops, strict=True)
        ):
            return False
        for start, stop, level in segments:
            self.live.add(start, stop, level)
        return True


def _levels(holds: Sequence[Hold]) -> Iterator[Hold]:
    """``holds`` summed: the positions between consecutive starts and stops, each with
    the bytes all holds add there (where that is not zero)."""
    change: dict[int, int] = defaultdict(int)
    for start, stop, nbytes in holds:
        if start < stop:
            change[start] += nbytes
            change[stop] -= nbytes
    positions = sorted(change)
    level = 0
    for start, stop in itertools.pairwise(positions):
        level += change[start]
        if level:
            yield start, stop, level


def peak_bytes(costs: ChunkCosts, transfers: Sequence[Transfer], in_flight: int = 1) -> int:
    """The device peak of one step (see ``MemoryTimeline``)."""
    return MemoryTimeline(costs, transfers, in_flight).peak


@dataclasses.dataclass(frozen=True)
class _Timeline:
    streams: _Streams
    forward_end: float
    forward_host: float
    copies: tuple[_Copy, ...]
    forward_starts: tuple[float, ...]
    backward_starts: tuple[float, ...]


def _run(costs: ChunkCosts, transfers: Sequence[Transfer], backlog: float = 0.0) -> _Timeline:
    """The step, the device-to-host queue busy until ``backlog`` into forward."""
    streams = _Streams(costs.profile)
    profile = costs.profile
    copies = {t.root: _Copy(t) for t in transfers}
    waits = _by([t for t in transfers if not t.released], "wait_at")
    needs = _by(transfers, "need_at")
    offloads = _with_host_seconds(
        _by(transfers, "offload_at"),
        _offload_op,
        profile.offload_host_seconds,
        profile.bucketed_offload_host_seconds,
    )
    reloads = _with_host_seconds(
        {j: sorted(ts, key=lambda t: t.need_at) for j, ts in _by(transfers, "reload_at").items()},
        _reload_op,
        profile.reload_host_seconds * profile.backward_host_scale,
        profile.bucketed_reload_host_seconds * profile.backward_host_scale,
    )

    device_to_host = CopyQueue(free_at=backlog)
    forward_starts = []
    forward = zip(costs.forward_seconds, costs.forward_launches, strict=True)
    for i, (seconds, launches) in enumerate(forward):
        forward_starts.append(streams.run(seconds, launches * profile.kernel_launch_seconds))
        for t, host_seconds in offloads.get(i, ()):
            c = copies[t.root]
            c.offload_start, c.offload_end = streams.issue(
                device_to_host, 0.0, costs.offload_seconds(t.nbytes), host_seconds
            )
        for t in waits.get(i, ()):
            copies[t.root].stall += streams.wait_for(copies[t.root].offload_end)
    forward_end, forward_host = streams.clock, streams.host

    host_to_device = CopyQueue()
    backward_starts = []
    backward = zip(costs.backward_seconds, costs.backward_launches, strict=True)
    for j, (seconds, launches) in enumerate(backward):
        for t, host_seconds in reloads.get(j, ()):
            c = copies[t.root]
            c.reload_start, c.reload_end = streams.issue(
                host_to_device, c.offload_end, costs.reload_seconds(t.nbytes), host_seconds
            )
        for t in needs.get(j, ()):
            copies[t.root].stall += streams.wait_for(copies[t.root].reload_end)
        backward_starts.append(streams.run(seconds, launches * profile.backward_launch_seconds))
    return _Timeline(
        streams,
        forward_end,
        forward_host,
        tuple(copies.values()),
        tuple(forward_starts),
        tuple(backward_starts),
    )


@functools.lru_cache(maxsize=4)
def _unhindered(costs: ChunkCosts) -> _Timeline:
    """The step with nothing moved; planning asks for it many times of the same chunk."""
    return _run(costs, ())


@functools.lru_cache(maxsize=4)
def _unhindered_peak(costs: ChunkCosts, in_flight: int) -> int:
    return peak_bytes(costs, (), in_flight)


def unhindered_starts(costs: ChunkCosts) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """When each forward and each backward node starts with nothing moved."""
    timeline = _unhindered(costs)
    return timeline.forward_starts, timeline.backward_starts


def _run_after_released(costs: ChunkCosts, transfers: Sequence[Transfer]) -> _Timeline:
    """The step as it runs after a forward of the same chunk: where copies are released,
    the queue is still busy with the forward before's as long as they outlast its end,
    and this forward's copies queue behind them. One more run finds that backlog where
    the copies take the queue no longer than forward, as the planner releases them
    only then (then the backlog does not change the last copy's end)."""
    timeline = _run(costs, transfers)
    ends = [c.offload_end for c in timeline.copies if c.transfer.released]
    backlog = max(ends, default=0.0) - timeline.forward_end
    return _run(costs, transfers, backlog) if backlog > 0 else timeline


def simulate(costs: ChunkCosts, transfers: Sequence[Transfer], in_flight: int = 1) -> Prediction:
    timeline = _run_after_released(costs, transfers)
    streams = timeline.streams
    return Prediction(
        forward_seconds=timeline.forward_end,
        backward_seconds=streams.clock - timeline.forward_end,
        stall_seconds=streams.stall,
        host_wait_seconds=streams.host_wait,
        host_seconds=streams.host,
        peak_bytes=peak_bytes(costs, transfers, in_flight),
        baseline_seconds=_unhindered(costs).streams.clock,
        baseline_peak_bytes=_unhindered_peak(costs, in_flight),
        copies=tuple(
            CopyPrediction(
                c.transfer.root,
                c.transfer.nbytes,
                c.offload_start,
                c.offload_end,
                c.reload_start,
                c.reload_end,
                c.stall,
            )
            for c in timeline.copies
        ),
        forward_starts=timeline.forward_starts,
        backward_starts=timeline.backward_starts,
        forward_host_seconds=timeline.forward_host,
    )
