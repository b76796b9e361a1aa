"""The record of what the pass did to one compiled chunk."""

from __future__ import annotations

import dataclasses

import tabulate
import torch.fx

from offload_pass.planner import Decision, Placement

HEADERS = ("name", "module", "op", "shape", "dtype", "bytes", "decision", "reason")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One chunk's decisions and its rewritten graphs.

    ``forward`` and ``backward`` are the graphs as rewritten, before the compiler
    lowers them; ``print(plan.forward.code)`` shows every offload, wait and reload.
    """

    chunk: str
    decisions: tuple[Decision, ...]
    placements: tuple[Placement, ...]
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule

    @property
    def moved(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.moved)

    @property
    def bytes_moved(self) -> int:
        return sum(d.group.nbytes for d in self.moved)

    @property
    def bytes_saved_for_backward(self) -> int:
        return sum(d.group.nbytes for d in self.decisions)

    def rows(self) -> list[tuple[object, ...]]:
        return [
            (
                d.group.root,
                d.group.module_path or "<root>",
                d.group.op,
                "x".join(map(str, d.group.shape)),
                str(d.group.dtype).removeprefix("torch."),
                d.group.nbytes,
                "moved" if d.moved else "kept",
                d.reason if not d.moved else f"{d.fraction_owner or '<root>'}: {d.fraction:g}",
            )
            for d in self.decisions
        ]

    def __str__(self) -> str:
        table = tabulate.tabulate(self.rows(), headers=HEADERS, intfmt=",")
        return (
            f"offload plan for {self.chunk}: {len(self.moved)} of "
            f"{len(self.decisions)} saved storages moved, {self.bytes_moved:,} of "
            f"{self.bytes_saved_for_backward:,} bytes\n{table}"
        )
