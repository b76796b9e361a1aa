"""The torch.compile backend."""

from __future__ import annotations

import dataclasses
import os
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.fx

from offload_pass import _compat, host_clock, ops
from offload_pass.graphs import forward_device
from offload_pass.options import (
    DEFAULT_MIN_BYTES,
    DEFAULT_STALL_TOLERANCE,
    OffloadOptions,
    record_compiled_frame,
)
from offload_pass.partition import OffloadPartitioner
from offload_pass.plan import Plan
from offload_pass.profiles import UNMEASURED, DeviceProfile, HostScale


def _module_paths(gm: torch.fx.GraphModule) -> set[str]:
    """Every module path under the roots Dynamo traces, or those the graph records."""
    stacks = [_compat.module_stack_sources(node) for node in gm.graph.nodes]
    sources = {source for stack in stacks for source in stack}
    roots = _compat.root_modules_being_compiled()
    paths = {name for s in sources if s in roots for name, _ in roots[s].named_modules()}
    return paths or {p for node in gm.graph.nodes for p, _ in _compat.module_stack(node)}


class OffloadBackend:
    """Pass to ``torch.compile(model, backend=...)``; keeps the :class:`Plan` of each graph
    it compiled, one per Dynamo compile id."""

    def __init__(self, options: OffloadOptions) -> None:
        self.options = options
        self._compiled: dict[str, tuple[types.CodeType | None, Plan]] = {}
        self.host_scales: dict[types.CodeType, HostScale] = {}
        """The host's price over the profile's, by frame, where ``auto`` measured it on
        a chunk's first steps (:mod:`offload_pass.host_clock`); the frame's later
        compiles plan at it, and are not measured again."""
        self.forwards_in_flight: dict[types.CodeType, int] = {}
        """How many forwards of a chunk ran before a backward on its first steps, by
        frame, where ``auto`` measured the host there; the frame's later compiles plan
        for that many in place of ``in_flight_microbatches``."""
        self._with_forwards: dict[int, OffloadBackend] = {}
        self._backward_spans = host_clock.BackwardSpans()

    @property
    def plans(self) -> list[Plan]:
        """One plan per compiled graph, oldest first. A graph compiled again under the
        same Dynamo compile id (after ``torch.compiler.reset()``) replaces its plan, and
        :func:`set_fraction` removes the plans of the frames it makes compile again."""
        return [plan for _, plan in self._compiled.values()]

    def discard_frame(self, code: types.CodeType) -> None:
        """Forget the plans of the graphs compiled for ``code``."""
        for name in [k for k, (compiled, _) in self._compiled.items() if compiled is code]:
            del self._compiled[name]

    def with_forwards_in_flight(self, count: int) -> OffloadBackend:
        """This backend for chunks whose forward runs ``count`` times before a backward,
        as the blocks of one list compiled each on their own share one chunk: its
        ``in_flight_microbatches`` times ``count``. It keeps its plans, and the prices
        and counts it measures, with this backend's. One per count: Dynamo keeps compiled
        code per backend object, so lists of one block class share theirs."""
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be an int >= 1, got {count!r}")
        if count in self._with_forwards:
            return self._with_forwards[count]
        in_flight = self.options.in_flight_microbatches * count
        derived = OffloadBackend(
            dataclasses.replace(self.options, in_flight_microbatches=in_flight)
        )
        derived._compiled = self._compiled
        derived.host_scales = self.host_scales
        derived.forwards_in_flight = self.forwards_in_flight
        derived._backward_spans = self._backward_spans
        self._with_forwards[count] = derived
        return derived

    def partitioner_for(self, gm: torch.fx.GraphModule) -> OffloadPartitioner:
        """The partitioner for one Dynamo graph; its plan is added to ``plans``."""
        self.options.check_patterns_match(_module_paths(gm))
        code = _compat.frame_code_being_compiled()
        if code is not None:
            module_ids = {i for n in gm.graph.nodes for _, i in _compat.module_stack(n)}
            record_compiled_frame(code, module_ids - {None}, self.discard_frame)
        name = f"chunk {gm.meta.get('dynamo_compile_id', len(self._compiled))}"
        rule = self.options.fraction_rule()

        def keep(plan: Plan) -> None:
            self._compiled.pop(name, None)
            self._compiled[name] = (code, plan)

        host_scale = self.host_scales.get(code, UNMEASURED) if code is not None else UNMEASURED
        return OffloadPartitioner(self._options_for(code), rule, name, keep, host_scale)

    def _options_for(self, code: types.CodeType | None) -> OffloadOptions:
        """The options, with the forwards in flight measured for ``code``'s frame."""
        if code not in self.forwards_in_flight:
            return self.options
        return dataclasses.replace(
            self.options, in_flight_microbatches=self.forwards_in_flight[code]
        )

    def _timed_forward(self, compiled: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``compiled``, its host's time measured on its first calls where ``auto`` made
        its plan at a price the host may not keep (``host_clock.is_timed``). Not where
        the partitioner agrees its choices across ranks: a compile then runs collectives,
        and one rank compiling again alone would hang the others."""
        code, plan = self._compiled.get(name, (None, None))
        measure = (
            self.options.mode == "auto"
            and code not in self.host_scales
            and plan is not None
            and host_clock.is_timed(plan)
            and not _compat.partitions_sync_across_ranks()
        )
        if not measure:
            return compiled
        device = forward_device(plan.forward)
        return host_clock.HostClock(
            compiled,
            lambda times: self._price_host(name, times),
            lambda: torch.get_device_module(device).synchronize(device),
            self._backward_spans,
        )

    def _price_host(self, name: str, times: host_clock.HostTimes) -> None:
        """Keep the chunk's plan predicted at the host's measured price and for the
        forwards measured in flight; where its transfers break ``auto``'s stall tolerance
        at that price, or it counted another number of forwards, discard its frame's
        compiled code instead, so that its next call plans and compiles again for them."""
        if name not in self._compiled:
            return  # its frame was discarded meanwhile (set_fraction)
        code, plan = self._compiled[name]
        planned = self.options.in_flight_microbatches
        in_flight = times.forwards_in_flight or planned
        scale = host_clock.host_scale(plan, times)
        priced = host_clock.priced_at(plan, scale, in_flight)
        tolerance = self.options.stall_tolerance
        if code is not None:
            self.host_scales[code] = scale
            # One frame may compile to several chunks, each counted on its own.
            self.forwards_in_flight[code] = max(in_flight, self.forwards_in_flight.get(code, 1))
        reasons = []
        if not priced.prediction.within(tolerance):
            reasons.append(
                f"its forward took the host {times.forward_seconds * 1e3:.2f} ms to issue and "
                f"its backward {times.backward_seconds * 1e3:.2f} ms, {scale.forward:.2f}x "
                f"and {scale.backward:.2f}x what its plan priced; at that price its "
                f"transfers slow the step by more than stall_tolerance={tolerance}"
            )
        if in_flight != planned:
            reasons.append(
                f"{in_flight} of its forwards ran before a backward, where its plan "
                f"counted {planned} (in_flight_microbatches)"
            )
        if code is None or not reasons:
            self._compiled[name] = (code, priced)
            return
        _compat.discard_compiled_code(code)
        self.discard_frame(code)
        warnings.warn(
            f"offload_pass: {name}: {'; and '.join(reasons)}; so its frame is planned again "
            "for what was measured and compiled once more",
            stacklevel=2,
        )

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[object],
        *,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        """Compile one Dynamo graph. ``mode`` and ``options`` are torch.compile's, which
        it passes on to a backend other than its own Inductor: they configure Inductor
        here as they would there."""
        if self.options.compiler == "eager" and (mode or options):
            raise ValueError(
                "torch.compile's mode= and options= configure Inductor; this backend has "
                "compiler='eager', which runs the graphs without Inductor"
            )
        config = _compat.inductor_config(mode, options)
        partitioner = self.partitioner_for(gm)
        if self.options.compiler == "eager":
            compiled = _compat.compile_with_eager(gm, example_inputs, partitioner)
        else:
            _compat.lower_with_aligned_outputs(ops.RELOAD_WAIT)
            compiled = _compat.compile_with_inductor(
                gm, example_inputs, partitioner, ops.holds_transfers, ops.RELOAD, config
            )
        return self._timed_forward(compiled, partitioner.name)

    def __repr__(self) -> str:
        return f"OffloadBackend({self.options})"


def backend(
    *,
    fraction: float | Mapping[str, float] | None = None,
    memory_budget: int | float | None = None,
    stall_tolerance: float = DEFAULT_STALL_TOLERANCE,
    profile: DeviceProfile | str | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
    compiler: str = "inductor",
    dump_dir: str | os.PathLike[str] | None = None,
    in_flight_microbatches: int = 1,
    recompute_budget: float | Literal["search"] | None = None,
) -> OffloadBackend:
    """A torch.compile backend that offloads saved activations to pinned host memory.

    With neither ``fraction`` nor ``memory_budget`` the planner runs in ``auto`` mode: it
    moves every activation whose copies its cost model predicts will hide under compute,
    within ``stall_tolerance`` of the step time.

    Args:
        fraction: share of each module's candidate activation bytes to move, in [0, 1];
            or a mapping from module-path patterns (``"blocks.*.attn"``, relative to the
            module given to ``torch.compile``) to shares, the last listed match deciding.
        memory_budget: the predicted peak to get under, per compiled chunk: bytes (int),
            or a share in (0, 1] of the predicted peak without offloading (float). Where
            moving alone misses it, or meets it only by slowing the predicted step by
            more than ``stall_tolerance``, the graph is also split with the stock
            partitioner recomputing more (:mod:`offload_pass.joint`), and the plan that
            meets the budget predicted fastest, else the nearest, is kept
            (``Plan.recompute_budget`` says which split).
        stall_tolerance: the share of the step that waiting on copies may add, in
            [0, 1]: in ``auto`` mode, what moves; under ``memory_budget``, when recomputing
            is tried. A copy is waited for only where it lowers the predicted peak.
        profile: the device rates to plan with: a :class:`DeviceProfile`, a built-in
            name (``"h200"``, ``"h100"``, ``"a100"``, ``"cpu"``), ``"calibrate"`` to
            measure the CUDA device once per device model (kept on disk; see
            :mod:`offload_pass.device_cache`), or None to pick by device name.
        min_bytes: activations smaller than this stay on the device.
        compiler: ``"inductor"``, or ``"eager"`` to run the rewritten graphs unfused.
        dump_dir: a folder to write each chunk's report, rewritten graphs and predicted
            trace into (``$OFFLOAD_PASS_DUMP`` when not given).
        in_flight_microbatches: how many forwards of a chunk run before its first
            backward: a pipeline stage's warm-up depth (see
            :mod:`offload_pass.pipeline_parallel`), or, where each block is compiled on
            its own, the blocks times that. The predicted peak and ``memory_budget`` count
            that many forwards' saved memory, and where it is above 1 a copy may end under
            the forwards after its own. ``auto`` on CUDA counts them on each chunk's first
            steps where it times the host there (:mod:`offload_pass.host_clock`), and the
            count replaces this one for that chunk's frame.
        recompute_budget: torch's ``activation_memory_budget`` for these graphs, in
            (0, 1]: the stock partitioner first recomputes what is cheapest to recompute
            until the saved activations fit that share, and offload_pass plans what is
            left. None keeps ``torch._functorch.config.activation_memory_budget``, or,
            with ``memory_budget``, lets the pass choose a lower one; giving one fixes the
            split (1.0: the stock split, which recomputes only cheap fusible ops).
            ``"search"`` lets the pass choose in ``auto`` too: the split whose plan
            predicts the lowest peak within ``stall_tolerance`` of the stock split's step
            with nothing moved, so that what is cheaper to recompute than to keep is
            recomputed (each split tried costs a partition; not with ``fraction``).
    """
    options = OffloadOptions(
        fraction=fraction,
        memory_budget=memory_budget,
        stall_tolerance=stall_tolerance,
        profile=profile,
        min_bytes=min_bytes,
        compiler=compiler,  # type: ignore[arg-type]
        dump_dir=dump_dir,
        in_flight_microbatches=in_flight_microbatches,
        recompute_budget=recompute_budget,
    )
    return OffloadBackend(options)


default_backend = OffloadBackend(OffloadOptions())
"""What ``torch.compile(model, backend="offload")`` uses; its plans are kept here."""


def offload(
    gm: torch.fx.GraphModule, example_inputs: Sequence[object], **compile_options: Any
) -> Callable[..., Any]:
    """The ``"offload"`` backend name: :data:`default_backend` (``compile_options``:
    torch.compile's ``mode`` and ``options``)."""
    return default_backend(gm, example_inputs, **compile_options)
