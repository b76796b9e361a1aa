"""The host's price, measured: how long the host takes to issue a compiled chunk's forward
on its first steps, against what its plan predicted.

The cost model prices each kernel launch at the profile's ``kernel_launch_seconds``, one
host's average over a few models. Hosts of one kind, and models on one host, differ from
it by a third or more (docs/gpu-validation.md, runs 47 to 53). Where the host is slower
than planned, a step the plan counted as the device's is the host's, and each transfer
op lengthens it: ``auto``'s promise to stay within the stall tolerance no longer holds.
:class:`ForwardHostClock` times a compiled chunk's forward calls after their warm-up;
:func:`host_scale` turns the time into a factor on the profile's host costs, and
:func:`keeps_its_promise` says whether the plan still stays within the tolerance at that
price. The backend plans such a chunk again at the measured price and compiles it once
more (``backend.OffloadBackend``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from offload_pass.graphs import forward_device
from offload_pass.plan import Plan
from offload_pass.simulate import simulate

WARMUP_CALLS = 3
"""Forward calls not timed: the first compiles, autotunes and pins host memory."""
TIMED_CALLS = 5
"""Forward calls timed after the warm-up; their median is the measurement."""


def is_timed(plan: Plan) -> bool:
    """Whether the host's price matters to ``plan``: it moves something on a CUDA device,
    whose host issues kernels (the profile prices them), and whose forward call returns
    once the host has issued its work."""
    return (
        bool(plan.moved)
        and plan.profile.kernel_launch_seconds > 0
        and forward_device(plan.forward).type == "cuda"
    )


def host_scale(plan: Plan, forward_host_seconds: float) -> float:
    """How many times the plan's predicted host time the forward took to issue."""
    return forward_host_seconds / plan.prediction.forward_host_seconds


def keeps_its_promise(plan: Plan, scale: float, stall_tolerance: float) -> bool:
    """Whether ``plan``'s transfers keep the step within ``stall_tolerance`` of the step
    with nothing moved, on a host ``scale`` times as slow as its profile's."""
    profile = plan.profile.with_host_scaled(scale, "host measured")
    step = simulate(dataclasses.replace(plan.costs, profile=profile), plan.planned.transfers)
    return step.step_seconds <= (1 + stall_tolerance) * step.baseline_seconds


class ForwardHostClock:
    """A compiled chunk's forward, calling ``on_measured`` once with the median seconds
    its calls took after the warm-up (:data:`WARMUP_CALLS`, :data:`TIMED_CALLS`); then
    only the forward. On CUDA a call returns once the host has issued the work, so its
    wall time is the host's."""

    def __init__(
        self,
        forward: Callable[..., Any],
        on_measured: Callable[[float], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.forward = forward
        self.on_measured = on_measured
        self.clock = clock
        self.calls = 0
        self.samples: list[float] | None = []
        # Dynamo calls a compiled function with its inputs boxed in a list where it says so.
        self._boxed_call = getattr(forward, "_boxed_call", False)

    def __call__(self, *args: Any) -> Any:
        if self.samples is None:
            return self.forward(*args)
        start = self.clock()
        outputs = self.forward(*args)
        seconds = self.clock() - start
        self.calls += 1
        if self.calls > WARMUP_CALLS:
            self.samples.append(seconds)
        if len(self.samples) == TIMED_CALLS:
            samples, self.samples = self.samples, None
            self.on_measured(statistics.median(samples))
        return outputs
