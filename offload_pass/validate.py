"""Hold a plan's prediction against a profiled step on CUDA: each copy's duration, the
step time and the peak memory, predicted and measured side by side."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import tabulate
import torch

from offload_pass.plan import Plan
from offload_pass.units import format_bytes, format_seconds


@dataclasses.dataclass(frozen=True)
class CopyTiming:
    root: str
    direction: str
    nbytes: int
    predicted_seconds: float
    measured_seconds: float | None


@dataclasses.dataclass(frozen=True)
class KernelSpan:
    """One kernel the profile shows on the device: when it ran (seconds), its name and its
    stream."""

    start: float
    end: float
    name: str
    stream: int


@dataclasses.dataclass(frozen=True)
class Gap:
    """A stretch where the compute stream ran nothing, and the kernel that ended it."""

    seconds: float
    next_kernel: str


def compute_gaps(kernels: Sequence[KernelSpan]) -> list[Gap]:
    """Where the compute stream (the stream that ran the most kernels) sat idle between its
    first kernel and its last, longest first: waiting for a copy, or for the host to
    issue the next kernel."""
    if not kernels:
        return []
    streams = collections.Counter(k.stream for k in kernels)
    ((stream, _),) = streams.most_common(1)
    compute = sorted((k for k in kernels if k.stream == stream), key=lambda k: k.start)
    gaps, busy_until = [], compute[0].end
    for kernel in compute[1:]:
        if kernel.start > busy_until:
            gaps.append(Gap(kernel.start - busy_until, kernel.name))
        busy_until = max(busy_until, kernel.end)
    return sorted(gaps, key=lambda g: -g.seconds)


LONGEST_GAPS = 5


@dataclasses.dataclass(frozen=True)
class Comparison:
    copies: tuple[CopyTiming, ...]
    predicted_step_seconds: float
    measured_step_seconds: float
    predicted_stall_seconds: float
    predicted_peak_bytes: int
    measured_peak_bytes: int
    unmatched_copies: int
    predicted_host_wait_seconds: float = 0.0
    gaps: tuple[Gap, ...] = ()
    """The compute stream's idle stretches in the profiled step, longest first."""

    def __str__(self) -> str:
        rows = [
            (
                c.root,
                c.direction,
                format_bytes(c.nbytes),
                format_seconds(c.predicted_seconds),
                "" if c.measured_seconds is None else format_seconds(c.measured_seconds),
            )
            for c in self.copies
        ]
        table = tabulate.tabulate(
            rows,
            headers=("storage", "copy", "size", "predicted", "measured"),
            disable_numparse=True,
        )
        return (
            f"step: predicted {format_seconds(self.predicted_step_seconds)} (stall "
            f"{format_seconds(self.predicted_stall_seconds)}), measured "
            f"{format_seconds(self.measured_step_seconds)}\n"
            f"peak: predicted {format_bytes(self.predicted_peak_bytes)}, measured "
            f"{format_bytes(self.measured_peak_bytes)}\n"
            f"compute idle: measured {format_seconds(sum(g.seconds for g in self.gaps))} "
            f"in {len(self.gaps)} gaps; predicted waits for copies "
            f"{format_seconds(self.predicted_stall_seconds)}, for the host "
            f"{format_seconds(self.predicted_host_wait_seconds)}\n"
            + "".join(
                f"  {format_seconds(g.seconds)} before {g.next_kernel[:80]}\n"
                for g in self.gaps[:LONGEST_GAPS]
            )
            + f"copies the profile shows beyond the plan's: {self.unmatched_copies}\n{table}"
        )


def _memcpy_seconds(profile: torch.profiler.profile, kind: str) -> list[float]:
    """Durations of the device copies of one kind ("DtoH", "HtoD"), in issue order."""
    events = [
        e
        for e in profile.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and f"Memcpy {kind}" in e.name
    ]
    events.sort(key=lambda e: e.time_range.start)
    return [e.time_range.elapsed_us() / 1e6 for e in events]


def _kernels(profile: torch.profiler.profile) -> list[KernelSpan]:
    """The device's kernels in a profile (not its copies or memsets)."""
    return [
        KernelSpan(e.time_range.start / 1e6, e.time_range.end / 1e6, e.name, e.device_resource_id)
        for e in profile.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not e.name.startswith(("Memcpy", "Memset"))
    ]


def _timings(
    plans: Sequence[Plan], offloads: list[float], reloads: list[float]
) -> list[CopyTiming]:
    """Copies matched in issue order: offloads in production order, reloads in the order
    backward issues them."""
    copies = [c for p in plans for c in p.prediction.copies]
    timings = [
        CopyTiming(
            c.root,
            "device-to-host",
            c.nbytes,
            c.offload_end - c.offload_start,
            offloads[i] if i < len(offloads) else None,
        )
        for i, c in enumerate(copies)
    ]
    by_issue = sorted(copies, key=lambda c: c.reload_start)
    timings += [
        CopyTiming(
            c.root,
            "host-to-device",
            c.nbytes,
            c.reload_end - c.reload_start,
            reloads[i] if i < len(reloads) else None,
        )
        for i, c in enumerate(by_issue)
    ]
    return timings


def compare_with_profile(step: Callable[[], object], plans: Sequence[Plan]) -> Comparison:
    """Run ``step`` (one forward and backward of the model the plans belong to) once to
    warm up, then once under ``torch.profiler``, and compare with the plans."""
    if not plans:
        raise ValueError(
            "compare_with_profile: no plans to compare; pass the backend's plans after "
            "the step has compiled (backend.plans is read when it is passed)"
        )
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=activities) as profile:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    offloads = _memcpy_seconds(profile, "DtoH")
    reloads = _memcpy_seconds(profile, "HtoD")
    planned = sum(len(p.prediction.copies) for p in plans)
    return Comparison(
        copies=tuple(_timings(plans, offloads, reloads)),
        predicted_step_seconds=sum(p.prediction.step_seconds for p in plans),
        measured_step_seconds=start.elapsed_time(end) / 1e3,
        predicted_stall_seconds=sum(p.prediction.stall_seconds for p in plans),
        predicted_peak_bytes=max(p.prediction.peak_bytes for p in plans),
        measured_peak_bytes=torch.cuda.max_memory_allocated(),
        unmatched_copies=max(0, len(offloads) - planned) + max(0, len(reloads) - planned),
        predicted_host_wait_seconds=sum(p.prediction.host_wait_seconds for p in plans),
        gaps=tuple(compute_gaps(_kernels(profile))),
    )
