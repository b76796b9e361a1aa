"""Offloading changes where tensors live, never what backward computes."""

from __future__ import annotations

import pytest
import torch

from tests import models
from tests.conftest import assert_same_step, compiled_pair, train_step

CASES = {
    "mlp": (models.MLP, lambda: torch.randn(8, 64)),
    "w1_blocks": (models.BlockStack, lambda: torch.randn(2, 16, 32)),
    "convnet": (
        models.ConvNet,
        lambda: torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last),
    ),
    "dropout": (models.DropoutMLP, lambda: torch.randn(8, 64)),
    "saved_is_output": (models.SavedIsOutput, lambda: torch.randn(8, 64)),
    "saved_views": (models.SavedViews, lambda: torch.randn(8, 64)),
    "index_and_mask": (models.IndexAndMask, lambda: torch.randn(8, 64)),
    "two_chunks": (models.TwoChunks, lambda: torch.randn(8, 64)),
}


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_equal_unoffloaded(case, fraction, compiler):
    make_model, make_input = CASES[case]
    model, reference, backend = compiled_pair(make_model, compiler, fraction=fraction)
    torch.manual_seed(1)
    x = make_input()
    for step in range(2):
        assert_same_step(train_step(model, x, seed=step), train_step(reference, x, seed=step))
    for plan in backend.plans:
        movable = sum(d.group.nbytes for d in plan.decisions if d.group.fixed_reason is None)
        assert movable > 0
        assert plan.bytes_moved <= fraction * movable
        assert fraction < 1.0 or plan.bytes_moved == movable


def test_checkpointed_layers_offload_their_saved_inputs():
    """Under activation checkpointing the pass moves what each block saves, its input,
    as save_on_cpu does around checkpointed layers; backward computes the same."""
    model, reference, backend = compiled_pair(models.CheckpointedBlocks, "inductor", fraction=1.0)
    x = torch.randn(2, 16, 32)
    for step in range(2):
        assert_same_step(train_step(model, x, seed=step), train_step(reference, x, seed=step))
    (plan,) = backend.plans
    movable = [d for d in plan.decisions if d.group.fixed_reason is None]
    # the first block's input is the batch, a graph input; each later block's is an add
    assert [d.group.op for d in movable] == ["aten.add.Tensor"] * 2
    assert all(d.moved for d in movable)


def test_fraction_one_moves_every_candidate():
    model, _, backend = compiled_pair(models.BlockStack, "eager", fraction=1.0)
    train_step(model, torch.randn(2, 16, 32))
    (plan,) = backend.plans
    assert plan.moved
    assert all(d.moved or d.group.fixed_reason is not None for d in plan.decisions)


def test_user_output_is_kept_on_device():
    model, _, backend = compiled_pair(models.SavedIsOutput, "eager", fraction=1.0)
    train_step(model, torch.randn(8, 64))
    reasons = {d.group.op: d.reason for d in backend.plans[0].decisions}
    assert reasons["aten.tanh.default"] == "user output"


def test_integer_and_boolean_saved_tensors_move():
    model, _, backend = compiled_pair(models.IndexAndMask, "eager", fraction=1.0)
    train_step(model, torch.randn(8, 64))
    moved_dtypes = {d.group.dtype for d in backend.plans[0].moved}
    assert {torch.int64, torch.bool} <= moved_dtypes


def test_graph_break_gives_one_plan_per_chunk():
    model, _, backend = compiled_pair(models.TwoChunks, "eager", fraction=1.0)
    train_step(model, torch.randn(8, 64))
    assert len(backend.plans) == 2
    assert {d.group.module_path.split(".")[0] for p in backend.plans for d in p.moved} == {
        "first",
        "second",
    }


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_recompute_budget_recomputes_then_offloads_what_is_left(compiler):
    x = torch.randn(2, 16, 32)
    model, reference, backend = compiled_pair(
        models.BlockStack, compiler, fraction=1.0, recompute_budget=0.1
    )
    with torch._functorch.config.patch(activation_memory_budget=0.1):
        expected = [train_step(reference, x, seed=step) for step in range(2)]
    for step in range(2):
        assert_same_step(train_step(model, x, seed=step), expected[step])
    without, _, saving_all = compiled_pair(models.BlockStack, compiler, fraction=1.0)
    train_step(without, x)
    (plan,) = backend.plans
    (full,) = saving_all.plans
    assert plan.moved
    assert sum(d.group.nbytes for d in plan.decisions) < sum(d.group.nbytes for d in full.decisions)
