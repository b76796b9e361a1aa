"""Fitting a memory budget to the measured peak: each trial plans lower by what the last
one overshot, or higher by what it fell short, and the fit keeps the highest budget that
met the target."""

from __future__ import annotations

import pytest
import torch

import offload_pass
from offload_pass import BudgetTrial, fit_memory_budget

GIB = 2**30


def _overshooting_by(extra: int, floor: int = 0):
    """A step whose peak is its budget plus ``extra``, and never below ``floor``;
    records the budgets it was compiled for."""
    planned: list[int] = []

    def run_at(budget: int) -> int:
        planned.append(budget)
        return max(budget + extra, floor)

    return run_at, planned


def test_an_overshoot_is_taken_off_the_next_budget():
    run_at, planned = _overshooting_by(GIB // 4)
    fit = fit_memory_budget(run_at, 7 * GIB)
    assert planned == [7 * GIB, 7 * GIB - GIB // 4]
    assert fit.met and fit.planned_bytes == 7 * GIB - GIB // 4
    assert fit.trials[-1] == BudgetTrial(7 * GIB - GIB // 4, 7 * GIB)


def test_a_budget_met_within_the_slack_is_kept_after_one_trial():
    run_at, planned = _overshooting_by(-GIB // 10)
    fit = fit_memory_budget(run_at, 7 * GIB, slack=0.02)
    assert planned == [7 * GIB] and fit.met and fit.planned_bytes == 7 * GIB


def test_a_shortfall_beyond_the_slack_is_added_to_the_next_budget():
    run_at, planned = _overshooting_by(-GIB)
    fit = fit_memory_budget(run_at, 7 * GIB)
    assert planned == [7 * GIB, 8 * GIB]  # the second trial peaks at the target: stop
    assert fit.met and fit.chosen == BudgetTrial(8 * GIB, 7 * GIB)


def test_budgets_stay_between_the_highest_that_met_and_the_lowest_that_overshot():
    planned: list[int] = []

    def run_at(budget: int) -> int:  # 1 GiB under its budget below 8 GiB, 0.5 over from it
        planned.append(budget)
        return budget - GIB if budget < 8 * GIB else budget + GIB // 2

    fit = fit_memory_budget(run_at, 7 * GIB, attempts=4)
    # 7 -> 6 (raise by 1), 8 -> 8.5 (the move to 6.5 leaves the bracket: its middle, 7.5),
    # 7.5 -> 6.5 (the move to 8 reaches the overshooting budget: the middle, 7.75)
    assert planned == [7 * GIB, 8 * GIB, 15 * GIB // 2, 31 * GIB // 4]
    assert fit.met and fit.chosen == BudgetTrial(31 * GIB // 4, 27 * GIB // 4)


def test_a_miss_after_every_attempt_keeps_the_trial_with_the_lowest_peak():
    planned: list[int] = []

    def run_at(budget: int) -> int:  # the peak falls by half of what the budget falls
        planned.append(budget)
        return budget // 2 + 5 * GIB

    fit = fit_memory_budget(run_at, 7 * GIB, attempts=2)
    assert planned == [7 * GIB, 11 * GIB // 2]  # peaks 8.5, then 7.75 GiB
    assert not fit.met and fit.planned_bytes == 11 * GIB // 2
    assert "missed" in str(fit)


def test_a_floor_the_budget_does_not_move_stops_the_fit_at_the_first_plan_reaching_it():
    """Run 68's pattern: every budget peaked at the same floor above the target."""
    run_at, planned = _overshooting_by(GIB, floor=8 * GIB)
    fit = fit_memory_budget(run_at, 7 * GIB, attempts=5)
    assert planned == [7 * GIB, 6 * GIB]  # the second trial lowered nothing: stop
    assert not fit.met and fit.chosen == BudgetTrial(7 * GIB, 8 * GIB)


def test_the_fit_stops_before_planning_for_nothing():
    run_at, planned = _overshooting_by(4 * GIB)
    fit = fit_memory_budget(run_at, 3 * GIB, attempts=5)
    assert planned == [3 * GIB] and not fit.met


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_bytes": 0}, "target_bytes must be a positive"),
        ({"target_bytes": 7.5}, "target_bytes must be a positive"),
        ({"target_bytes": GIB, "attempts": 0}, "attempts must be an int of at least 1"),
        ({"target_bytes": GIB, "slack": 1.0}, "slack must be a share of the target"),
        ({"target_bytes": GIB, "slack": -0.1}, "slack must be a share of the target"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fit_memory_budget(lambda budget: budget, **kwargs)


def test_a_step_that_does_not_return_its_peak_is_refused():
    with pytest.raises(TypeError, match="run_at must return the peak in bytes"):
        fit_memory_budget(lambda budget: None, GIB)
    with pytest.raises(ValueError, match="run_at must return the peak in bytes"):
        fit_memory_budget(lambda budget: 0, GIB)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_counts_what_the_run_allocates_on_top_of_what_was_there():
    held = torch.empty(GIB // 4, dtype=torch.uint8, device="cuda")
    peak = offload_pass.cuda_peak(lambda: torch.empty(GIB // 2, dtype=torch.uint8, device="cuda"))
    assert peak >= held.numel() + GIB // 2
