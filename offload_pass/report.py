"""Reports: one table row per saved storage, with totals and the prediction, per chunk
and for a whole model."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import tabulate
import torch.fx

from offload_pass import analysis, planner
from offload_pass.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from offload_pass.plan import Plan

HEADERS = ("name", "module", "op", "shape", "dtype", "size", "decision", "copy", "hidden")
OP_WIDTH = 32


REASONS: dict[str, str] = {
    planner.MOVED: "moves to host memory",
    planner.TOO_SMALL: "fewer bytes than min_bytes",
    planner.FRACTION_REACHED: "moving it would exceed its module's share",
    planner.WOULD_NOT_HIDE: "auto: its copy would not finish under compute",
    planner.BUDGET_MET: "memory_budget: the peak is under the budget without it",
    planner.PEAK_NOT_LOWERED: "memory_budget: moving it would not lower the peak, over the budget",
    analysis.INPUT_ALIAS: "the storage belongs to a graph input (parameter, batch)",
    analysis.USER_OUTPUT: "the caller holds it anyway",
    analysis.NON_DENSE: "its elements do not fill its storage span",
    analysis.NOT_REPLAYABLE: "a view on it takes symbolic arguments",
    analysis.NO_SIZE_HINT: "its size has no hint",
    analysis.EMPTY: "zero elements",
    analysis.SCALAR: "a 0-dim tensor: kernels may keep it on the host, and it frees nothing",
    analysis.UNSUPPORTED_DEVICE: "neither CUDA nor CPU",
    analysis.NOT_IN_BACKWARD: "backward does not read it",
}
"""Every reason a decision can carry, with what it means."""


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    module: str
    op: str
    shape: str
    dtype: str
    nbytes: int
    moved: bool
    reason: str
    copy_seconds: float | None
    hidden_share: float | None

    def cells(self) -> tuple[object, ...]:
        return (
            self.name,
            self.module,
            self.op,
            self.shape,
            self.dtype,
            format_bytes(self.nbytes),
            self.reason if self.moved else f"kept: {self.reason}",
            "" if self.copy_seconds is None else format_seconds(self.copy_seconds),
            "" if self.hidden_share is None else f"{self.hidden_share:.0%}",
        )


def plan_rows(plan: Plan) -> list[Row]:
    rows = []
    copies = plan.copies_by_root()
    released = {t.root for t in plan.planned.transfers if t.released}
    for d in plan.decisions:
        copy = copies.get(d.group.root)
        rows.append(
            Row(
                name=d.group.root,
                module=d.group.module_path or "<root>",
                op=d.group.op,
                shape="x".join(map(str, d.group.shape)),
                dtype=str(d.group.dtype).removeprefix("torch."),
                nbytes=d.group.nbytes,
                moved=d.moved,
                reason=_reason(d, d.group.root in released),
                copy_seconds=None if copy is None else copy.copy_seconds,
                hidden_share=None if copy is None else copy.hidden_share,
            )
        )
    return rows


def _reason(d: planner.Decision, released: bool) -> str:
    """The decision's reason, with the share that applied and whether the copy is
    released at forward's end (it ends under the next forward)."""
    notes = []
    if d.moved and d.share is not None:
        notes.append(f"{d.owner or '<root>'}: fraction {d.share:g}")
    if released:
        notes.append("released at forward's end")
    return f"{d.reason} ({'; '.join(notes)})" if notes else d.reason


def why_nothing_moved(plan: Plan) -> str | None:
    """A sentence saying why a plan moved nothing, where one reason explains it all."""
    if plan.moved:
        return None
    if all(d.group.fixed_reason is not None for d in plan.decisions):
        return f"{plan.chunk}: no saved activation can move (each row says why)"
    auto = any(d.reason == planner.WOULD_NOT_HIDE for d in plan.decisions)
    if auto and not plan.profile.copies_overlap_compute:
        return (
            f"{plan.chunk}: auto moves nothing with the {plan.profile.name!r} profile: its "
            "copies overlap no compute (they run on the compute thread, or, under CUDA "
            "graphs, after it), so none can hide (pass fraction= or memory_budget= to move "
            "activations anyway)"
        )
    if any(d.reason == planner.SLOWS_THE_STEP for d in plan.decisions):
        return (
            f"{plan.chunk}: auto moves nothing: the device waits for the host here "
            f"({format_seconds(plan.prediction.host_wait_seconds)} of the step), and the "
            "host's time for the transfer ops would slow the step beyond stall_tolerance"
        )
    return None


def summary(plan: Plan) -> str:
    p = plan.prediction
    ops = f", by {plan.offload_ops} offload and {plan.reload_ops} reload ops" if plan.moved else ""
    lines = [
        f"offload plan for {plan.chunk} ({plan.profile.name}): {len(plan.moved)} of "
        f"{len(plan.decisions)} saved storages moved, {format_bytes(plan.bytes_moved)} of "
        f"{format_bytes(plan.bytes_saved_for_backward)}{ops}",
        f"predicted peak {format_bytes(p.baseline_peak_bytes)} -> {format_bytes(p.peak_bytes)}; "
        f"step {format_seconds(p.baseline_seconds)} -> {format_seconds(p.step_seconds)} "
        f"(stall {format_seconds(p.stall_seconds)}, "
        f"waiting on the host {format_seconds(p.host_wait_seconds)})",
    ]
    if plan.planned.budget_bytes is not None:
        shortfall = plan.planned.budget_shortfall
        met = "met" if not shortfall else f"missed by {format_bytes(shortfall)}"
        lines.append(f"memory budget {format_bytes(plan.planned.budget_bytes)}: {met}")
    if plan.recompute_budget is not None:
        lines.append(
            f"split under activation_memory_budget {plan.recompute_budget:g}: backward "
            "recomputes what the partitioner chose, and the step and peak above are of that "
            "split"
        )
    if plan.checkpointed_blocks:
        lines.append(
            f"{len(plan.checkpointed_blocks)} blocks checkpointed, "
            f"{_span(plan.checkpointed_blocks)}: backward computes them again from their "
            "inputs, and the step and peak above are of that split"
        )
    if plan.recomputed_nodes:
        lines.append(
            f"{len(plan.recomputed_nodes)} forward nodes computed again in backward one by one "
            f"(saved values and what they are computed from), {_span(plan.recomputed_nodes)}: "
            "the step and peak above are of that split"
        )
    if (reason := why_nothing_moved(plan)) is not None:
        lines.append(reason)
    if plan.planned.overlap_depth != planner.OVERLAP_DEPTH:
        lines.append(
            f"copies that cannot keep up run at most {plan.planned.overlap_depth} ahead of "
            f"compute (default {planner.OVERLAP_DEPTH}), the depth the memory budget's plan took"
        )
    return "\n".join(lines)


def _span(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} to {names[-1]}"


def short_op(op: str) -> str:
    """``aten.mm.default`` as ``mm``, ``aten.max_pool2d_with_indices.default[1]`` as
    ``max_pool2d_with_indices[1]``; a name longer than ``OP_WIDTH`` loses its middle."""
    op = re.sub(r"\.default\b", "", op.removeprefix("aten."))
    if len(op) <= OP_WIDTH:
        return op
    half = (OP_WIDTH - 1) // 2
    return f"{op[:half]}~{op[-(OP_WIDTH - 1 - half) :]}"


def _inputs_line(rows: Sequence[Row]) -> str:
    return (
        f"kept: {len(rows)} graph inputs (parameters, buffers, the batch) that backward reads, "
        f"{format_bytes(sum(r.nbytes for r in rows))}"
    )


def format_plan(plan: Plan) -> str:
    """The summary, one line for the graph inputs backward reads, then a row per saved
    storage the chunk makes."""
    rows = plan_rows(plan)
    inputs = [r for r in rows if r.reason == analysis.INPUT_ALIAS]
    made = [dataclasses.replace(r, op=short_op(r.op)) for r in rows if r not in inputs]
    table = tabulate.tabulate([r.cells() for r in made], headers=HEADERS, disable_numparse=True)
    return "\n".join([summary(plan), *([_inputs_line(inputs)] if inputs else []), table])


def format_model(plans: Sequence[Plan]) -> str:
    """Every chunk's report, then the model's totals (chunks run one after another)."""
    moved = sum(p.bytes_moved for p in plans)
    saved = sum(p.bytes_saved_for_backward for p in plans)
    base = sum(p.prediction.baseline_seconds for p in plans)
    step = sum(p.prediction.step_seconds for p in plans)
    stall = sum(p.prediction.stall_seconds for p in plans)
    host_wait = sum(p.prediction.host_wait_seconds for p in plans)
    totals = (
        f"model: {len(plans)} chunks, {format_bytes(moved)} of {format_bytes(saved)} of saved "
        f"activations moved; predicted step {format_seconds(base)} -> {format_seconds(step)} "
        f"(stall {format_seconds(stall)}, waiting on the host {format_seconds(host_wait)})"
    )
    return "\n\n".join([*(format_plan(p) for p in plans), totals])


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """Every chunk's plan; ``print`` shows each chunk's table and the model's totals."""

    plans: tuple[Plan, ...]

    def rows(self) -> list[Row]:
        return [row for plan in self.plans for row in plan_rows(plan)]

    def __str__(self) -> str:
        return format_model(self.plans)


STREAM_NOTES = {
    "offload_pass.offload.default": "device-to-host stream: waits for compute to here, copies",
    "offload_pass.offload_wait.default": "compute waits for that copy; frees the device tensor",
    "offload_pass.offload_release.default": (
        "compute does not wait; the device tensor is freed once its copy has read it"
    ),
    "offload_pass.reload.default": "host-to-device stream: waits for compute and the offload",
    "offload_pass.reload_wait.default": "compute waits for the reload",
}


def annotated_code(graph: torch.fx.GraphModule) -> str:
    """The graph as Python code, each transfer op marked with the stream it runs on."""
    lines = []
    for line in graph.code.splitlines():
        note = next((n for op, n in STREAM_NOTES.items() if op in line), None)
        lines.append(f"{line}  # <<< {note}" if note else line)
    return "\n".join(lines)


def format_graphs(plan: Plan) -> str:
    return (
        f"# {plan.chunk}: forward, as rewritten\n{annotated_code(plan.forward)}\n\n"
        f"# {plan.chunk}: backward, as rewritten\n{annotated_code(plan.backward)}\n"
    )
