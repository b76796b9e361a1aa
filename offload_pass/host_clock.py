"""The host's price, measured: how long the host takes to issue a compiled chunk's forward
on its first steps, against what its plan predicted.

The cost model prices each kernel launch at the profile's ``kernel_launch_seconds``, one
host's average over a few models. Hosts of one kind, and models on one host, differ from
it by a third or more (docs/gpu-validation.md, runs 47 to 53). Where the host is slower
than planned, a step the plan counted as the device's is the host's, and each transfer
op lengthens it: ``auto``'s promise to stay within the stall tolerance no longer holds.
:class:`ForwardHostClock` times a compiled chunk's forward calls after their warm-up;
:func:`host_scale` turns the time into a factor on the profile's host costs,
:func:`priced_at` predicts the plan again at that price, and its prediction says whether
it still stays within the tolerance (``Prediction.within``). The backend keeps the plan so priced,
or, where it breaks the tolerance, plans the chunk again at the measured price and
compiles it once more (``backend.OffloadBackend``).

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


def is_timed(plan: Plan) -> bool:
    """Whether the host's price matters to ``plan`` and can be read off its forward calls:
    the host issues its kernels one by one (not replayed from CUDA graphs, whose profile
    prices no launch), and on a CUDA device a call returns once the host has issued its
    work (on the CPU it returns when the work is done), as long as it launches fewer
    than :data:`LAUNCH_QUEUE` kernels after the device was synchronized."""
    return (
        plan.profile.kernel_launch_seconds > 0
        and plan.prediction.forward_host_seconds > 0
        and sum(plan.costs.forward_launches) < LAUNCH_QUEUE
        and forward_device(plan.forward).type == "cuda"
    )


def host_scale(plan: Plan, forward_host_seconds: float) -> float:
    """How many times the plan's predicted host time the forward took to issue."""
    return forward_host_seconds / plan.prediction.forward_host_seconds


def priced_at(plan: Plan, scale: float, in_flight: int) -> Plan:
    """``plan`` with its host costs, and so its prediction, at ``scale`` times its
    profile's (``in_flight``: the microbatches its peak counts)."""
    costs = dataclasses.replace(plan.costs, profile=plan.profile.with_host_measured(scale))
    prediction = simulate(costs, plan.planned.transfers, in_flight)
    planned = dataclasses.replace(plan.planned, prediction=prediction)
    return dataclasses.replace(plan, costs=costs, planned=planned)


class ForwardHostClock:
    """A compiled chunk's forward, calling ``on_measured`` once with the median seconds
    its calls took from its third step on (:data:`WARMUP_STEPS`, :data:`TIMED_CALLS`),
    and the most warm-up calls in flight at once (:attr:`forwards_in_flight`); then only
    the forward. On CUDA a call returns once the host has issued the work, so its wall
    time is the host's.

    A step is counted where a backward of an earlier call has run since the call before:
    a chunk may be called several times a step (each block compiled on its own shares
    one), and its first step's calls all compile, pin host memory or grow the device's
    pool. A call inside a backward (a checkpointed region run again) is neither timed nor
    counted. ``drain`` runs before each timed call (the device's synchronize): a host
    running ahead of a busy device waits whenever the launch queue is full, and its
    time would then be the device's."""

    def __init__(
        self,
        forward: Callable[..., Any],
        on_measured: Callable[[float, int], None],
        drain: Callable[[], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.forward = forward
        self.on_measured = on_measured
        self.drain = drain
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
        if len(self.samples) == TIMED_CALLS:
            samples, self.samples = self.samples, None
            self.on_measured(statistics.median(samples), self.forwards_in_flight)
        return outputs

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
