"""What is alive at a step's measured peak on CUDA, and which line of code allocated it.

The cost model predicts the peak from the FX graphs; the compiled code may allocate
differently. This replays the caching allocator's events for one step and names, for each
block alive at the peak, the first frame outside torch that allocated it: a line of
Inductor's generated code, of offload_pass's runtime, or of the model.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tabulate
import torch

from offload_pass import _compat
from offload_pass.units import format_bytes

TORCH_DIR = os.path.dirname(torch.__file__)
FREE = "free_requested"
"""The event at which the allocator stops counting a block as allocated (its memory may
be reused later, once the streams that used it are done)."""


@dataclasses.dataclass(frozen=True)
class AllocationSite:
    where: str
    code: str
    nbytes: int
    blocks: int


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
    """``peak_bytes``: allocated at the step's peak, including ``before_bytes`` (what was
    allocated when the step began); ``sites``: what the step added, largest first."""

    peak_bytes: int
    before_bytes: int
    sites: tuple[AllocationSite, ...]
    reached_at: str

    def format(self, top: int = 20) -> str:
        rows = [(s.where, s.code, format_bytes(s.nbytes), s.blocks) for s in self.sites[:top]]
        table = tabulate.tabulate(
            rows, headers=("allocated at", "code", "live", "blocks"), disable_numparse=True
        )
        return (
            f"peak {format_bytes(self.peak_bytes)}: {format_bytes(self.before_bytes)} from "
            f"before the step, the rest allocated by the step; reached at {self.reached_at}\n"
            f"{table}"
        )

    def __str__(self) -> str:
        return self.format()


def _outside_torch(frames: Sequence[Mapping[str, Any]], torch_dir: str) -> Mapping[str, Any] | None:
    """The innermost frame outside torch's own sources."""
    return next(
        (f for f in frames if not f["filename"].startswith((torch_dir, "<"))),
        None,
    )


def allocation_site(frames: Sequence[Mapping[str, Any]], torch_dir: str = TORCH_DIR) -> str:
    """``file:line function`` of the innermost frame outside torch's own sources."""
    frame = _outside_torch(frames, torch_dir)
    return (
        "torch internals"
        if frame is None
        else f"{frame['filename']}:{frame['line']} {frame['name']}"
    )


def _source_line(frames: Sequence[Mapping[str, Any]], torch_dir: str) -> str:
    frame = _outside_torch(frames, torch_dir)
    return "" if frame is None else linecache.getline(frame["filename"], frame["line"]).strip()


def breakdown_from_trace(
    entries: Sequence[Mapping[str, Any]], before_bytes: int, torch_dir: str = TORCH_DIR
) -> PeakBreakdown:
    """Replay alloc and free events; what was live when the total was highest."""
    _, totals = _replay(entries)
    index = max(range(len(totals)), key=totals.__getitem__, default=-1)
    peak = totals[index] if index >= 0 else 0
    live, _ = _replay(entries[: index + 1])
    sizes: dict[str, list[int]] = {}
    code: dict[str, str] = {}
    for entry in live.values():
        where = allocation_site(entry["frames"], torch_dir)
        sizes.setdefault(where, []).append(entry["size"])
        code.setdefault(where, _source_line(entry["frames"], torch_dir))
    ranked = sorted(sizes.items(), key=lambda item: -sum(item[1]))
    return PeakBreakdown(
        before_bytes + peak,
        before_bytes,
        tuple(AllocationSite(w, code[w], sum(s), len(s)) for w, s in ranked),
        allocation_site(entries[index]["frames"], torch_dir) if index >= 0 else "before the step",
    )


def _replay(
    entries: Sequence[Mapping[str, Any]],
) -> tuple[dict[int, Mapping[str, Any]], list[int]]:
    """The blocks the step holds after the last event, and its bytes after each event
    (frees of blocks from before the step count for neither)."""
    live: dict[int, Mapping[str, Any]] = {}
    total, totals = 0, []
    for entry in entries:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
            total += entry["size"]
        elif entry["action"] == FREE and live.pop(entry["addr"], None) is not None:
            total -= entry["size"]
        totals.append(total)
    return live, totals


def peak_breakdown(step: Callable[[], None], device: int | None = None) -> PeakBreakdown:
    """Run ``step`` once (warm it up first) and break down its peak CUDA memory."""
    if not torch.cuda.is_available():
        raise RuntimeError("peak_breakdown reads the CUDA caching allocator; no CUDA device")
    index = torch.cuda.current_device() if device is None else device
    torch.cuda.synchronize(index)
    before = torch.cuda.memory_allocated(index)
    return breakdown_from_trace(_compat.cuda_allocation_trace(step, index), before)
