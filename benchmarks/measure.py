"""Run one configuration for a few steps and measure it."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import offload_pass
from benchmarks.configs import Config, Unavailable
from offload_pass import _compat, host_clock

SETTLING_STEPS = host_clock.SETTLING_STEPS
"""Steps each configuration runs before its counted ones: ``auto`` on CUDA measures the
host on its first steps and may compile once more at the price measured."""
FIRST_TIMED_STEP = 2  # benchmarks/README.md: the median of steps 3..8 after settling
HEAD_START_CYCLES = 1_000_000_000
"""What the device spins before the step whose host time is measured (about 0.5 s at
2 GHz), longer than any step here takes the host to issue."""
HOST_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Measurement:
    config: str
    family: str
    status: str
    step_ms: float | None = None
    forward_ms: float | None = None
    first_step_s: float | None = None
    settling_s: float | None = None
    """The settling steps' time, the first step's compile and any second one included."""
    peak_bytes: int | None = None
    active_peak_bytes: int | None = None
    """The most memory the allocator could not hand out (CUDA): ``peak_bytes`` and the
    tensors freed while a copy on another stream still reads them (a released offload),
    which leave ``peak_bytes`` at once but are handed out again only once the copy has
    read them."""
    held_bytes: int | None = None
    bytes_moved: int | None = None
    pinned_allocations_after_warmup: int | None = None
    predicted_step_ms: float | None = None
    predicted_forward_ms: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_peak_saved_bytes: int | None = None
    moved_names: tuple[str, ...] = ()
    split: str | None = None
    """How the plans' graphs were split (``Plan.split_name``), each distinct one once."""
    transfer_ops: int | None = None
    """Offload and reload ops a step issues (each moves a bucket of storages)."""
    host_ms: float | None = None
    """What the host takes to issue one step while the device is still busy (CUDA only;
    the median of ``HOST_STEPS`` more steps)."""
    predicted_host_ms: float | None = None
    """The plans' host time, without a step's fixed host time (guards, wrappers)."""
    paired_step_ratio: float | None = None
    """The step time over the baseline's, the two compiled side by side and stepped in
    turns (:func:`steps_in_turns`); None where not measured."""
    paired_step_ms: float | None = None
    """The median step in those turns: measured in the same stretch of the process as
    the baseline's, not in a stretch of its own."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass
class _Step:
    seconds: float
    forward_seconds: float
    peak_bytes: int | None
    active_peak_bytes: int | None
    held_bytes: int | None
    bytes_moved: int


def pinned_allocations() -> int | None:
    """Pinned host allocations the CUDA host allocator has made so far (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.host_memory_stats()
    return stats.get("num_host_alloc", stats.get("allocations.allocated"))


def _run_step(forward: Any, x: Any, device: torch.device) -> _Step:
    cuda = device.type == "cuda"
    moved_before = offload_pass.counts().bytes_offloaded
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
    start = time.perf_counter()
    loss = forward(x)
    if cuda:
        events[1].record()
        held = torch.cuda.memory_allocated() - before
    middle = time.perf_counter()
    loss.backward()
    if cuda:
        events[2].record()
        torch.cuda.synchronize()
        seconds = events[0].elapsed_time(events[2]) / 1e3
        forward_seconds = events[0].elapsed_time(events[1]) / 1e3
        peak = torch.cuda.max_memory_allocated()
        active = torch.cuda.memory_stats()["active_bytes.all.peak"]
    else:
        seconds, forward_seconds = time.perf_counter() - start, middle - start
        peak = active = held = None
    moved = offload_pass.counts().bytes_offloaded - moved_before
    return _Step(seconds, forward_seconds, peak, active, held, moved)


def host_seconds(forward: Any, x: Any, device: torch.device) -> float | None:
    """The host's time to issue one more step, with the device kept busy by a head start
    so that the host never waits for it; None without CUDA, or where the host did wait
    (something in the step synchronized, or it took longer than the head start)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    _compat.spin_device(device, HEAD_START_CYCLES)
    spun = torch.cuda.Event()
    spun.record(torch.cuda.current_stream(device))
    start = time.perf_counter()
    forward(x).backward()
    seconds = time.perf_counter() - start
    waited = spun.query()  # the head start ended before the host was done
    torch.cuda.synchronize()
    return None if waited else seconds


def drained_host_seconds(forward: Any, x: Any) -> float:
    """The host's time to issue a step's forward and its backward, the device synchronized
    before each (``offload_pass.host_clock.HostClock`` samples them so). CUDA only."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = forward(x)
    forward_seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss.backward()
    backward_seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return forward_seconds + backward_seconds


@dataclasses.dataclass(frozen=True)
class PassSeconds:
    """The device's seconds for a step's forward and for its backward."""

    forward: float
    backward: float


def pass_device_seconds(forward: Any, x: Any, head_start_cycles: int) -> PassSeconds:
    """Each pass's time on the device, from an event recorded before the host issues it
    to its last kernel, the device synchronized before each and then kept busy for
    ``head_start_cycles`` (none where 0). With a head start longer than the host takes
    to issue the pass, the time is the device's own; with none, it also counts the
    device waiting for the host, as a step timed from an idle device does. CUDA only."""
    device = torch.device("cuda", torch.cuda.current_device())

    def on_device(issue: Callable[[], Any]) -> tuple[float, Any]:
        torch.cuda.synchronize()
        if head_start_cycles:
            _compat.spin_device(device, head_start_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = issue()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, result

    forward_seconds, loss = on_device(lambda: forward(x))
    backward_seconds, _ = on_device(loss.backward)
    return PassSeconds(forward_seconds, backward_seconds)


def _predictions(shared: dict[str, Any]) -> dict[str, Any]:
    """What the plans predict, where they cover the whole step. One chunk's plan run once
    per block (``shared["whole_step"]`` False) times only that block, and predicts the
    peak of the blocks' part of the step alone; its saving counts every block's forward
    (the plan's ``in_flight``), and is the step's where the rest of the model holds as
    much at that peak with or without offloading."""
    backend = shared.get("backend")
    if backend is None or not backend.plans:
        return {}
    plans = backend.plans
    saving = {
        "predicted_peak_saved_bytes": max(p.prediction.baseline_peak_bytes for p in plans)
        - max(p.prediction.peak_bytes for p in plans),
        "moved_names": tuple(d.group.root for p in plans for d in p.moved),
        "split": "; ".join(dict.fromkeys(p.split_name for p in plans)),
    }
    if not shared.get("whole_step", True):
        return saving
    return {
        "predicted_step_ms": sum(p.prediction.step_seconds for p in plans) * 1e3,
        "predicted_forward_ms": sum(p.prediction.forward_seconds for p in plans) * 1e3,
        "predicted_peak_bytes": max(p.prediction.peak_bytes for p in plans),
        **saving,
        "transfer_ops": sum(p.offload_ops + p.reload_ops for p in plans),
        "predicted_host_ms": sum(p.prediction.host_seconds for p in plans) * 1e3,
    }


Build = Callable[[], tuple[torch.nn.Module, Any]]
"""A fresh model and the batch each step feeds it."""


def _root_cause(error: BaseException) -> str:
    """The innermost exception's type and first line: a compile failure wraps the real one
    (Dynamo's ``BackendCompilerFailed`` holds it as ``inner_exception``, raised from None)."""
    while (inner := error.__cause__ or getattr(error, "inner_exception", None)) is not None:
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"


def measure(
    config: Config, build: Build, device: torch.device, steps: int, shared: dict[str, Any]
) -> Measurement:
    if config.cuda_only and device.type != "cuda":
        return Measurement(config.name, config.family, "needs a CUDA device")
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    shared.pop("backend", None)
    shared.pop("whole_step", None)
    try:
        model, x = build()
        forward = config.prepare(model, shared)
        records = []
        pinned = None
        started = time.perf_counter()
        for step in range(SETTLING_STEPS + steps):
            if step == SETTLING_STEPS + FIRST_TIMED_STEP:
                pinned = pinned_allocations()
            record = _run_step(forward, x, device)
            if step >= SETTLING_STEPS:
                records.append(record)
            model.zero_grad(set_to_none=True)
            if step == 0:
                first_step = time.perf_counter() - started
            if step == SETTLING_STEPS - 1:
                settling = time.perf_counter() - started
        after = pinned_allocations()
        hosts = []
        for _ in range(HOST_STEPS):
            hosts.append(host_seconds(forward, x, device))
            model.zero_grad(set_to_none=True)
    except Unavailable as why:
        return Measurement(config.name, config.family, str(why))
    except Exception as error:  # a peer that fails is a result, not a crash
        traceback.print_exception(error, file=sys.stderr)
        return Measurement(config.name, config.family, f"fails: {_root_cause(error)}")
    timed = records[FIRST_TIMED_STEP:] or records
    host = None if None in hosts else statistics.median(hosts)
    return Measurement(
        config.name,
        config.family,
        "ok",
        step_ms=statistics.median(r.seconds for r in timed) * 1e3,
        forward_ms=statistics.median(r.forward_seconds for r in timed) * 1e3,
        first_step_s=first_step,
        settling_s=settling,
        peak_bytes=None if timed[0].peak_bytes is None else max(r.peak_bytes for r in timed),
        active_peak_bytes=None
        if timed[0].active_peak_bytes is None
        else max(r.active_peak_bytes for r in timed),
        held_bytes=None if timed[0].held_bytes is None else max(r.held_bytes for r in timed),
        # offload_pass counts what it moves; what a peer moves is not measured here
        bytes_moved=timed[-1].bytes_moved if config.family == "offload_pass" else None,
        pinned_allocations_after_warmup=None if after is None or pinned is None else after - pinned,
        host_ms=None if host is None else host * 1e3,
        **_predictions(shared),
    )


@dataclasses.dataclass(frozen=True)
class StepsInTurns:
    """Two configurations stepped in turns: the median of the rounds' ratios of
    ``other``'s step to ``baseline``'s, and the median of each one's steps."""

    ratio: float
    baseline_ms: float
    other_ms: float


def steps_in_turns(
    baseline: Config, other: Config, build: Build, device: torch.device, rounds: int
) -> StepsInTurns:
    """``other``'s steps against ``baseline``'s, measured in turns: both built and
    compiled side by side, warmed up, then ``rounds`` rounds of one step of each, in
    alternating order.

    Measured one after the other, two configurations of a host-bound model (the host
    issues its kernels no faster than the device runs them) differ also by what the
    host's speed drifts between them: on one H200 machine the host took 21.4 ms for a
    ViT's stock step and 26.2 ms under the pass moving nothing, and Mixtral's ``auto``,
    moving nothing, stepped at 0.725 of stock's (docs/gpu-validation.md, runs 111 and
    109). Steps taken in turns see the same drift."""
    torch.compiler.reset()
    gc.collect()
    prepared = []
    for config in (baseline, other):
        model, x = build()
        prepared.append((model, config.prepare(model, {}), x))
    for model, forward, x in prepared:  # compile, then warm up as measure() does
        for _ in range(SETTLING_STEPS + FIRST_TIMED_STEP + 1):
            _run_step(forward, x, device)
            model.zero_grad(set_to_none=True)
    # A frame compiled again (the host clock's replan) drops the code the other model
    # compiled for the same function: each compiles again here, untimed.
    for model, forward, x in prepared:
        _run_step(forward, x, device)
        model.zero_grad(set_to_none=True)
    rounds_seconds = []
    for turn in range(rounds):
        seconds = {}
        for i in (0, 1) if turn % 2 == 0 else (1, 0):
            model, forward, x = prepared[i]
            seconds[i] = _run_step(forward, x, device).seconds
            model.zero_grad(set_to_none=True)
        rounds_seconds.append(seconds)
    return StepsInTurns(
        ratio=statistics.median(s[1] / s[0] for s in rounds_seconds),
        baseline_ms=statistics.median(s[0] for s in rounds_seconds) * 1e3,
        other_ms=statistics.median(s[1] for s in rounds_seconds) * 1e3,
    )
