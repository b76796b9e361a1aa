"""Fitting a memory budget to the measured peak: plan, run, measure, plan again.

The cost model's peak is a prediction from the FX graphs, and the compiled code may hold
more than the graphs show (values the compiler realizes together, a library's workspace)
or less (buffers it frees earlier than the graphs say). :func:`fit_memory_budget` runs
the user's steps under ``memory_budget``, reads the peak they reach, and plans again for
a budget moved by the miss: lowered by an overshoot, raised by a shortfall larger than
``slack``, since a plan that holds less than it may moves or recomputes more than it
must. Each trial compiles afresh, so fitting costs a compile per trial. The returned
:class:`BudgetFit` says whether the target was met, and its ``planned_bytes`` is the
budget to pass to :func:`offload_pass.backend`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

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
    to keep (``chosen``) is, of those whose peak met the target, the one planned for the
    highest budget (it holds back least); where none met it, the one with the lowest peak
    (of equal peaks the first)."""

    target_bytes: int
    trials: tuple[BudgetTrial, ...]

    @property
    def chosen(self) -> BudgetTrial:
        """The trial to keep (class docstring)."""
        met = [t for t in self.trials if t.peak_bytes <= self.target_bytes]
        if met:
            return max(met, key=lambda t: t.planned_bytes)
        return min(self.trials, key=lambda t: t.peak_bytes)

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


def next_budget(target_bytes: int, trials: Sequence[BudgetTrial], slack: float) -> int | None:
    """The budget to plan for after ``trials``, or None where the fit is done.

    The last trial's budget moves by its miss (the plan at the new budget is assumed to
    miss by as much again), kept strictly between the highest budget that met the target
    and the lowest that overshot it (the middle of the two where the move leaves them). Done:
    a peak met within ``slack`` of the target, an overshoot no lower than an earlier
    trial's peak before any trial met (a floor a lower budget does not move), a bracket
    too narrow to split, or no budget left above zero.
    """
    last = trials[-1]
    shortfall = target_bytes - last.peak_bytes
    if 0 <= shortfall <= slack * target_bytes:
        return None
    met = [t.planned_bytes for t in trials if t.peak_bytes <= target_bytes]
    over = [t.planned_bytes for t in trials if t.peak_bytes > target_bytes]
    if not met and any(t.peak_bytes <= last.peak_bytes for t in trials[:-1]):
        return None
    low, high = max(met, default=None), min(over, default=None)
    budget = last.planned_bytes + shortfall
    if low is not None and high is not None and not low < budget < high:
        budget = (low + high) // 2
    too_low = budget <= 0 or (low is not None and budget <= low)
    if too_low or (high is not None and budget >= high):
        return None
    return budget


def fit_memory_budget(
    run_at: RunAtBudget, target_bytes: int, attempts: int = 3, slack: float = 0.02
) -> BudgetFit:
    """Plan for ``target_bytes``, measure with ``run_at``, and plan again for the budget
    moved by what the measured peak missed (:func:`next_budget`), at most ``attempts``
    trials in all: lowered by an overshoot, raised by a shortfall of more than ``slack``
    (a share of the target).

    ``run_at(budget)`` must compile afresh (``torch.compiler.reset()`` first, or a new
    model), since a compiled step keeps the plan it was compiled with;
    :func:`cuda_peak` measures the peak of a function run on a CUDA device.
    """
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes <= 0:
        raise ValueError(f"target_bytes must be a positive number of bytes, got {target_bytes!r}")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be an int of at least 1, got {attempts!r}")
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack < 1:
        raise ValueError(f"slack must be a share of the target in [0, 1), got {slack!r}")
    trials = [BudgetTrial(target_bytes, _checked_peak(run_at(target_bytes)))]
    while len(trials) < attempts:
        budget = next_budget(target_bytes, trials, slack)
        if budget is None:
            break
        trials.append(BudgetTrial(budget, _checked_peak(run_at(budget))))
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
