"""Fitting a memory budget to the measured peak: plan, run, measure, plan again.

The cost model's peak is a prediction from the FX graphs, and the compiled code may hold
more than the graphs show (values the compiler realizes together, a library's workspace).
:func:`fit_memory_budget` runs the user's steps under ``memory_budget``, reads the peak
they reach, and plans again for a budget lowered by the overshoot, until the measured
peak is at or under the target, the trials run out, or a lower budget stops lowering the
peak. Each trial compiles afresh, so fitting costs a compile per trial. The returned
:class:`BudgetFit` says whether the target was met, and its ``planned_bytes`` is the
budget to pass to :func:`offload_pass.backend`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from offload_pass.units import format_bytes

RunAtBudget = Callable[[int], int]
"""Compiles a fresh model with ``offload_pass.backend(memory_budget=<the argument>)``,
runs steps with it, and returns the peak they reached, in bytes."""


@dataclasses.dataclass(frozen=True)
class BudgetTrial:
    """One trial: the ``memory_budget`` planned for and the peak measured under it."""

    planned_bytes: int
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class BudgetFit:
    """The trials made to bring the measured peak to ``target_bytes``, in order. The trial
    to keep (``chosen``) is the first whose peak met the target, or, where none did, the
    one with the lowest peak (of equal peaks the first, planned highest)."""

    target_bytes: int
    trials: tuple[BudgetTrial, ...]

    @property
    def chosen(self) -> BudgetTrial:
        """The trial to keep (class docstring)."""
        met = [t for t in self.trials if t.peak_bytes <= self.target_bytes]
        return met[0] if met else min(self.trials, key=lambda t: t.peak_bytes)

    @property
    def planned_bytes(self) -> int:
        """The ``memory_budget`` to compile with."""
        return self.chosen.planned_bytes

    @property
    def met(self) -> bool:
        """Whether the chosen trial's measured peak is at or under the target."""
        return self.chosen.peak_bytes <= self.target_bytes

    def __str__(self) -> str:
        steps = ", ".join(
            f"planned {format_bytes(t.planned_bytes)} -> peak {format_bytes(t.peak_bytes)}"
            for t in self.trials
        )
        verdict = "met" if self.met else "missed"
        return (
            f"target {format_bytes(self.target_bytes)} {verdict}: {steps}; "
            f"keep {format_bytes(self.planned_bytes)}"
        )


def next_budget(target_bytes: int, trial: BudgetTrial) -> int:
    """The budget to plan for after ``trial`` overshot the target: lowered by the
    overshoot, which the plan at that budget is assumed to carry again."""
    return trial.planned_bytes - (trial.peak_bytes - target_bytes)


def fit_memory_budget(run_at: RunAtBudget, target_bytes: int, attempts: int = 3) -> BudgetFit:
    """Plan for ``target_bytes``, measure with ``run_at``, and plan again for the budget
    lowered by what the measured peak overshot, at most ``attempts`` trials in all. It
    stops at the first trial that meets the target, and at the first that lowers the peak
    no further than an earlier one did (a floor that a lower budget does not move).

    ``run_at(budget)`` must compile afresh (``torch.compiler.reset()`` first, or a new
    model), since a compiled step keeps the plan it was compiled with;
    :func:`cuda_peak` measures the peak of a function run on a CUDA device.
    """
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes <= 0:
        raise ValueError(f"target_bytes must be a positive number of bytes, got {target_bytes!r}")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int of at least 1, got {attempts!r}")
    trials: list[BudgetTrial] = []
    planned = target_bytes
    while len(trials) < attempts and planned > 0:
        lowest = min((t.peak_bytes for t in trials), default=None)
        trials.append(BudgetTrial(planned, _checked_peak(run_at(planned))))
        if trials[-1].peak_bytes <= target_bytes:
            break
        if lowest is not None and trials[-1].peak_bytes >= lowest:
            break
        planned = next_budget(target_bytes, trials[-1])
    return BudgetFit(target_bytes, tuple(trials))


def _checked_peak(peak: object) -> int:
    if isinstance(peak, bool) or not isinstance(peak, int):
        raise TypeError(f"run_at must return the peak in bytes (an int), got {peak!r}")
    if peak <= 0:
        raise ValueError(f"run_at must return the peak in bytes (positive), got {peak!r}")
    return peak


def cuda_peak(run: Callable[[], object], device: torch.device | int | None = None) -> int:
    """The most ``run()`` had allocated at once on the CUDA ``device``, in bytes,
    including what was allocated before it began."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
