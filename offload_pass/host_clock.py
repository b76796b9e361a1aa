"""The host's price, measured: how long the host takes to issue a compiled chunk's
forward and its backward on its first steps, against what its plan predicted.

The cost model prices each kernel launch at the profile's ``kernel_launch_seconds``, one
host's average over a few models. Hosts of one kind, and models on one host, differ from
it by a third or more (docs/gpu-validation.md, runs 47 to 53), and backward costs the
host more per kernel than forward: its autograd engine runs the compiled backward, then
accumulates each parameter's gradient (ViT-B/16 has 152). Where the host is slower than
planned, a step the plan counted as the device's is the host's, and each transfer op
lengthens it: ``auto``'s promise to stay within the stall tolerance no longer holds.
:class:`HostClock` times a compiled chunk's forward calls after their warm-up, and the
backward of each (:class:`BackwardSpans`); :func:`host_scale` turns the times into
factors on the profile's host costs, :func:`priced_at` predicts the plan again at that
price, and its prediction says whether it still stays within the tolerance
(``Prediction.within``). The backend keeps the plan so priced, or, where it breaks the
tolerance, plans the chunk again at the measured price and compiles it once more
(``backend.OffloadBackend``).

The same first steps say how many forwards of the chunk run before a backward: one for a
model compiled whole, as many as its blocks where each block is compiled on its own (they
share one chunk), a pipeline stage's warm-up depth. The plan counts that many forwards'
saved memory in its peak, and lets copies end under the forwards after their own
(``Transfer.released``); where it counted another number, the backend plans it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from offload_pass import _compat
from offload_pass.graphs import forward_device
from offload_pass.plan import Plan
from offload_pass.profiles import HostScale
from offload_pass.simulate import simulate

WARMUP_STEPS = 2
"""Steps whose forward calls are not timed: the first compiles, autotunes, pins host
memory and grows the device's pool."""
TIMED_CALLS = 5
"""Forward calls timed after the warm-up; their median is the measurement."""
LAUNCH_QUEUE = 1000
"""About how many kernels CUDA queues on a stream before the host waits for the device
to run one: a forward launching more may be paced by the device, not the host."""
SETTLING_STEPS = WARMUP_STEPS + TIMED_CALLS + 1
"""Steps after which a chunk compiled whole runs the plan it keeps (the last one may
compile it again)."""


@dataclasses.dataclass(frozen=True)
class HostTimes:
    """What the host took to issue a chunk's forward and its backward (each the median
    of the timed calls), and the most forwards of it that ran before a backward."""

    forward_seconds: float
    backward_seconds: float
    forwards_in_flight: int


def is_timed(plan: Plan) -> bool:
    """Whether the host's price matters to ``plan`` and can be read off its forward calls
    and their backwards: the host issues its kernels one by one (not replayed from CUDA
    graphs, whose profile prices no launch), and on a CUDA device a call returns once the
    host has issued its work (on the CPU it returns when the work is done), as long as
    forward and backward each launch fewer than :data:`LAUNCH_QUEUE` kernels after the
    device was synchronized."""
    return (
        plan.profile.kernel_launch_seconds > 0
        and plan.prediction.forward_host_seconds > 0
        and plan.prediction.backward_host_seconds > 0
        and sum(plan.costs.forward_launches) < LAUNCH_QUEUE
        and sum(plan.costs.backward_launches) < LAUNCH_QUEUE
        and forward_device(plan.forward).type == "cuda"
    )


def host_scale(plan: Plan, times: HostTimes) -> HostScale:
    """How many times the plan's predicted host time forward and backward took to issue."""
    prediction = plan.prediction
    return HostScale(
        times.forward_seconds / prediction.forward_host_seconds,
        times.backward_seconds / prediction.backward_host_seconds,
    )


def priced_at(plan: Plan, scale: HostScale, in_flight: int) -> Plan:
    """``plan`` with its host costs, and so its prediction, at ``scale`` times its
    profile's (``in_flight``: the microbatches its peak counts)."""
    costs = dataclasses.replace(plan.costs, profile=plan.profile.with_host_measured(scale))
    prediction = simulate(costs, plan.planned.transfers, in_flight)
    planned = dataclasses.replace(plan.planned, prediction=prediction)
    return dataclasses.replace(plan, costs=costs, planned=planned)


class BackwardSpans:
    """The host's time for each timed chunk's backward in one backward pass: from the
    moment its first node starts to the moment the next timed chunk's does, or the pass
    ends. The span holds what the engine runs between them: the chunk's compiled
    backward, then the gradients it accumulates into parameters (the engine runs those
    as soon as they are ready), and any backward of uncompiled code after it. The device
    is drained before each span (``drain``, as :class:`HostClock` takes it). One per
    backend: its chunks' spans end where each other's begin."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._open: Callable[[float], None] | None = None
        self._started = 0.0

    def start(self, report: Callable[[float], None], drain: Callable[[], None]) -> None:
        """A timed chunk's backward begins; ``report`` gets its span once it ends."""
        now = self.clock()
        if self._open is None:
            _compat.at_backward_end(self._end)
        else:
            self._open(now - self._started)
        drain()
        self._open, self._started = report, self.clock()

    def _end(self) -> None:
        report, self._open = self._open, None
        if report is not None:
            report(self.clock() - self._started)


class HostClock:
    """A compiled chunk's forward, calling ``on_measured`` once with :class:`HostTimes`:
    the median seconds its first :data:`TIMED_CALLS` forward calls took from its third
    step on (:data:`WARMUP_STEPS`), the median of as many backwards' (``spans``), and
    the most warm-up calls in flight at once (:attr:`forwards_in_flight`); then only the
    forward. On CUDA a call returns once the host has issued the work, so its wall time
    is the host's.

    A step is counted where a backward of an earlier call has run since the call before:
    a chunk may be called several times a step (each block compiled on its own shares
    one), and its first step's calls all compile, pin host memory or grow the device's
    pool. A call inside a backward (a checkpointed region run again) is neither timed nor
    counted. ``drain`` runs before each timed call and backward (the device's
    synchronize): a host running ahead of a busy device waits whenever the launch queue
    is full, and its time would then be the device's."""

    def __init__(
        self,
        forward: Callable[..., Any],
        on_measured: Callable[[HostTimes], None],
        drain: Callable[[], None],
        spans: BackwardSpans,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.forward = forward
        self.on_measured = on_measured
        self.drain = drain
        self.spans = spans
        self.clock = clock
        self.steps = 0
        self.backwards = 0
        self._backwards_seen = 0
        self._events = itertools.count()
        self._backward_of: dict[int, int | None] = {}
        """For each warm-up call with a backward to come (by its event), the event of its
        backward, once run; a call leaves where its autograd nodes die without one."""
        self._nodes_alive: dict[int, int] = {}
        self.samples: list[float] | None = []
        self.backward_samples: list[float] = []
        # Dynamo calls a compiled function with its inputs boxed in a list where it says so.
        self._boxed_call = getattr(forward, "_boxed_call", False)

    def __call__(self, *args: Any) -> Any:
        if self.samples is None or _compat.in_backward():
            return self.forward(*args)
        if self.backwards > self._backwards_seen:
            self.steps += 1
            self._backwards_seen = self.backwards
        if self.steps >= WARMUP_STEPS:
            self.drain()
        start = self.clock()
        outputs = self.forward(*args)
        seconds = self.clock() - start
        if self.steps < WARMUP_STEPS:
            self._hear_backward_of(outputs)
            return outputs
        self.samples.append(seconds)
        self._time_backward_of(outputs)
        return outputs

    def _time_backward_of(self, outputs: Any) -> None:
        """Time the backward that runs ``outputs``' nodes, from the first of them to run."""
        nodes = {t.grad_fn for t in outputs if isinstance(t, torch.Tensor)} - {None}
        started = [False]

        def start(*grads: Any) -> None:
            if not started[0] and self.samples is not None:
                started[0] = True
                self.spans.start(self._backward_took, self.drain)

        for node in nodes:
            node.register_prehook(start)

    def _backward_took(self, seconds: float) -> None:
        if self.samples is None:
            return
        self.backward_samples.append(seconds)
        if len(self.backward_samples) < TIMED_CALLS:
            return
        forward, self.samples = self.samples[:TIMED_CALLS], None
        backward = statistics.median(self.backward_samples)
        self.on_measured(HostTimes(statistics.median(forward), backward, self.forwards_in_flight))

    def _hear_backward_of(self, outputs: Any) -> None:
        """Hear of the backward that runs one of ``outputs``' nodes (whichever of them
        the loss reads), and of their death without one (an evaluation with gradients
        on, its outputs dropped). A call under ``no_grad`` has no nodes."""
        nodes = {t.grad_fn for t in outputs if isinstance(t, torch.Tensor)} - {None}
        if not nodes:
            return
        call = next(self._events)
        self._backward_of[call] = None
        self._nodes_alive[call] = 0
        for node in nodes:
            node.register_hook(functools.partial(self._backward_ran, call))
            with contextlib.suppress(TypeError):  # torch's own nodes take no weak reference
                weakref.finalize(node, self._node_died, call)
                self._nodes_alive[call] += 1
        if not self._nodes_alive[call]:
            del self._nodes_alive[call]

    def _backward_ran(self, call: int, *grads: Any) -> None:
        if self._backward_of[call] is None:
            self._backward_of[call] = next(self._events)
            self.backwards += 1

    def _node_died(self, call: int) -> None:
        """Forget a call whose nodes all died without a backward: it held nothing."""
        self._nodes_alive[call] -= 1
        if self._nodes_alive[call]:
            return
        del self._nodes_alive[call]
        if self._backward_of[call] is None:
            del self._backward_of[call]

    @property
    def forwards_in_flight(self) -> int:
        """The most warm-up calls alive at once between a call and its backward, a call
        whose backward has yet to run counted as alive still (a pipeline's warm-up may
        outlast the measurement). A call whose nodes died without a backward held
        nothing for one."""
        edges = sorted(
            edge
            for call, backward in self._backward_of.items()
            for edge in ((call, 1), (math.inf if backward is None else backward, -1))
        )
        return max(itertools.accumulate(step for _, step in edges), default=0)
