"""A memory budget that moving alone meets only by slowing the step is met by recomputing
as well: the pass chooses the split, and backward computes what the stock compile computes
under that split."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from offload_pass.joint import RECOMPUTE_LEVELS
from offload_pass.profiles import BUILT_IN
from tests import models
from tests.conftest import assert_same_step, compiled_pair, train_step

BUDGET = 0.9
"""A share of the small stack's peak that moving alone meets, and so does recomputing
(nothing the stack saves goes below 0.84: its parameters and gradients)."""


def _copies_at(bandwidth: float, name: str):
    """The CPU's rates with copies at ``bandwidth`` bytes/s each way (on the CPU a copy
    adds its whole time to the step)."""
    return dataclasses.replace(
        BUILT_IN["cpu"],
        name=name,
        device_to_host=bandwidth,
        host_to_device=bandwidth,
        both_directions=2 * bandwidth,
    )


SLOW_COPIES = _copies_at(1e8, "slow copies")
FAST_COPIES = _copies_at(1e15, "fast copies")


def _plan(**options):
    model, _, backend = compiled_pair(models.BlockStack, "eager", **options)
    train_step(model, torch.randn(2, 16, 32))
    (plan,) = backend.plans
    return plan


def test_a_budget_moving_meets_only_slowly_is_met_faster_by_recomputing():
    moving_alone = _plan(memory_budget=BUDGET, recompute_budget=1.0, profile=SLOW_COPIES)
    joint = _plan(memory_budget=BUDGET, profile=SLOW_COPIES)
    assert moving_alone.recompute_budget == 1.0
    assert moving_alone.prediction.step_seconds > moving_alone.prediction.baseline_seconds
    assert joint.recompute_budget in RECOMPUTE_LEVELS
    assert not joint.planned.budget_shortfall
    assert joint.planned.budget_bytes == moving_alone.planned.budget_bytes
    assert joint.prediction.step_seconds < moving_alone.prediction.step_seconds
    assert "split under activation_memory_budget" in str(joint)
    assert list(joint.stage_seconds)[-2:] == ["search", "rewrite"]
    assert joint.stage_seconds["search"] >= 0


def test_a_budget_met_with_nothing_moved_keeps_the_stock_split():
    plan = _plan(memory_budget=1.0)
    assert plan.recompute_budget is None
    assert not plan.moved


def test_a_budget_met_by_moving_within_the_tolerance_keeps_the_stock_split():
    plan = _plan(memory_budget=BUDGET, profile=FAST_COPIES)
    assert plan.recompute_budget is None
    assert plan.moved
    assert not plan.planned.budget_shortfall


def test_a_recompute_budget_given_is_the_split_planned():
    assert _plan(memory_budget=BUDGET, recompute_budget=0.5).recompute_budget == 0.5


def test_auto_and_fractions_keep_the_stock_split():
    assert _plan().recompute_budget is None
    assert _plan(fraction=1.0).recompute_budget is None


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_jointly_planned_steps_equal_the_stock_compile_of_that_split(compiler):
    model, reference, backend = compiled_pair(
        models.BlockStack, compiler, memory_budget=BUDGET, profile=SLOW_COPIES
    )
    x = torch.randn(2, 16, 32)
    steps = [train_step(model, x, seed=step) for step in range(2)]
    (plan,) = backend.plans
    assert plan.recompute_budget is not None
    with torch._functorch.config.patch(activation_memory_budget=plan.recompute_budget):
        expected = [train_step(reference, x, seed=step) for step in range(2)]
    for step, want in zip(steps, expected, strict=True):
        assert_same_step(step, want)
