"""Whole blocks checkpointed by the pass: which blocks it finds, what the split computes
again, that the search takes them where recomputing whole blocks is the cheaper way to
a budget, and that a checkpointed step trains as the model does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import offload_pass
from offload_pass import _compat, joint
from offload_pass.blocks import Split, find_blocks, recomputed_regions
from offload_pass.driver import PlannedChunk
from offload_pass.graphs import ChunkGraphs
from offload_pass.joint import SearchSpace
from offload_pass.options import OffloadOptions
from offload_pass.partition import stock_splits
from tests import models
from tests.conftest import (
    assert_same_step,
    compiled_pair,
    every_block_checkpointed,
    train_step,
)
from tests.test_joint import SLOW_COPIES


def _on_joint(model: nn.Module, x: torch.Tensor, look) -> dict:
    """``look(joint, joint_inputs, kwargs)`` on the joint graph ``model``'s compile
    partitions, its result returned under ``"found"``; the stock split is compiled."""
    found: dict = {}

    def partition(joint_graph, joint_inputs, **kwargs):
        found["found"] = look(joint_graph, joint_inputs, kwargs)
        return _compat.stock_partition(joint_graph, joint_inputs, **kwargs)

    def backend(gm, example_inputs):
        passes = _compat.after_inductor_joint_passes(partition)
        return _compat.compile_with_eager(
            gm, example_inputs, passes, _compat.inductor_decompositions()
        )

    torch.compile(model, backend=backend)(x).sum().backward()
    return found


def test_the_repeated_blocks_are_found_in_the_order_forward_runs_them():
    found = _on_joint(models.BlockStack(depth=3), torch.randn(2, 16, 32), _blocks)
    assert found["found"] == ("blocks.0", "blocks.1", "blocks.2")


def test_a_model_that_repeats_no_module_has_no_blocks():
    found = _on_joint(models.MLP(), torch.randn(4, 64), _blocks)
    assert found["found"] == ()


def test_children_of_one_class_are_blocks_whatever_their_names():
    """torchvision's ViT names its encoder layers ``encoder_layer_0`` and so on."""
    model = nn.Sequential()
    for i in range(3):
        model.add_module(f"layer_{i}", models.MLP())
    found = _on_joint(model, torch.randn(4, 64), _blocks)
    assert found["found"] == ("layer_0", "layer_1", "layer_2")


def _blocks(joint_graph, joint_inputs, kwargs):
    return find_blocks(joint_graph, kwargs["num_fwd_outputs"])


def _splits(joint_graph, joint_inputs, kwargs) -> dict:
    outputs = kwargs["num_fwd_outputs"]
    blocks = find_blocks(joint_graph, outputs)
    split = stock_splits(joint_graph, joint_inputs, **kwargs)
    output = joint_graph.graph.output_node().args[0][0]
    return {
        "regions": recomputed_regions(joint_graph, outputs, blocks[-1:]),
        "stock": split(Split()),
        "last": split(Split(None, blocks[-1:])),
        "all": split(Split(None, blocks)),
        "marks left": [n.name for n in joint_graph.graph.nodes if "recompute" in n.meta],
        "output": output.name,
        "inside": output.args[0].name,
    }


def _products(graph: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.aten.mm.default for n in graph.graph.nodes)


def _saved_bytes(chunk: ChunkGraphs) -> int:
    values = (n.meta.get("val") for n in chunk.saved_values() if isinstance(n, torch.fx.Node))
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def test_checkpointed_blocks_are_computed_again_in_backward_and_save_less():
    found = _on_joint(models.BlockStack(depth=3), torch.randn(2, 16, 32), _splits)["found"]
    stock, last, every = found["stock"], found["last"], found["all"]
    per_block = 2  # the attention's two products (its MLP's are addmm)
    assert _products(last.backward) == _products(stock.backward) + per_block
    assert _products(every.backward) == _products(stock.backward) + 3 * per_block
    assert _products(every.forward) == _products(stock.forward)
    assert _saved_bytes(every) < _saved_bytes(last) < _saved_bytes(stock)
    assert found["marks left"] == []


def test_a_blocks_output_read_outside_the_blocks_is_not_marked():
    """Marked, the last block's output would be computed again at the start of backward,
    where the loss's gradients are alive; the partitioner may save it instead."""
    found = _on_joint(models.BlockStack(depth=2), torch.randn(2, 16, 32), _splits)["found"]
    regions = found["regions"]
    assert regions and set(regions.values()) == {0}
    assert found["output"] not in regions  # the last block's second residual sum
    assert found["inside"] in regions  # its first, read inside the block alone


def _force_checkpointing(monkeypatch) -> None:
    """No knapsack level to try: a budget moving meets only slowly goes to the blocks."""
    original = joint.search_space

    def blocks_alone(options, joint_graph, outputs):
        return SearchSpace((), original(options, joint_graph, outputs).blocks)

    monkeypatch.setattr(joint, "search_space", blocks_alone)
    monkeypatch.setattr("offload_pass.partition.search_space", blocks_alone)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_checkpointed_blocks_chosen_by_the_search_train_as_the_model(monkeypatch, compiler):
    _force_checkpointing(monkeypatch)
    model, _, backend = compiled_pair(
        lambda: models.BlockStack(depth=4), compiler, memory_budget=0.9, profile=SLOW_COPIES
    )
    torch.manual_seed(0)
    eager = models.BlockStack(depth=4)
    x = torch.randn(2, 16, 32)
    got, want = train_step(model, x), train_step(eager, x)
    (plan,) = backend.plans
    assert plan.checkpointed_blocks and set(plan.checkpointed_blocks) <= {
        f"blocks.{i}" for i in range(4)
    }
    assert "blocks checkpointed" in str(plan)
    torch.testing.assert_close(got[0], want[0])
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][f"_orig_mod.{name}"], grad, msg=name)


class _DropoutBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(models.DropoutMLP() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_checkpointed_blocks_that_draw_random_numbers_draw_the_same_again(monkeypatch):
    """Backward computes the dropout masks again from the generator's saved state: the
    gradients are those of the stock compile, which saved the masks."""
    every_block_checkpointed(monkeypatch)
    model, reference, backend = compiled_pair(
        _DropoutBlocks, "eager", fraction=1.0, profile=SLOW_COPIES
    )
    x = torch.randn(4, 64)
    got = [train_step(model, x, seed=step) for step in range(2)]
    (plan,) = backend.plans
    assert plan.checkpointed_blocks
    want = [train_step(reference, x, seed=step) for step in range(2)]
    for step, expected in zip(got, want, strict=True):
        assert_same_step(step, expected)


def _zoo_llama_steps(backend) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Two steps of the model zoo's HF Llama at its CPU size."""
    from benchmarks import zoo as model_zoo

    torch.manual_seed(0)
    task, batch = model_zoo.MODELS["llama"].build(torch.device("cpu"))
    compiled = torch.compile(task, backend=backend)
    steps = []
    for step in range(2):
        torch.manual_seed(step)
        loss = compiled(batch)
        loss.backward()
        steps.append((loss.detach(), [p.grad.clone() for p in task.parameters()]))
        task.zero_grad(set_to_none=True)
    return steps


def test_a_checkpointed_hf_decoder_with_moves_trains_as_the_stock_compile(monkeypatch):
    """HF Llama under Inductor: its SDPA calls draw random numbers as torch tags them, so
    the checkpointed split runs them under the random-state wrappers, whose saved state
    Inductor hands on as a real tensor: no transfer op may take it, as a value or as an
    ordering token."""
    pytest.importorskip("transformers")
    every_block_checkpointed(monkeypatch)
    backend = offload_pass.backend(fraction=1.0, min_bytes=0)
    got = _zoo_llama_steps(backend)
    (plan,) = backend.plans
    assert len(plan.checkpointed_blocks) == 2 and plan.moved
    want = _zoo_llama_steps("inductor")
    for (loss, grads), (want_loss, want_grads) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, want_loss)
        for grad, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(grad, expected)


def _stub(step_ms: float, unmoved_peak: int, shortfall: int, count: int) -> PlannedChunk:
    prediction = SimpleNamespace(
        step_seconds=step_ms / 1e3,
        baseline_seconds=step_ms / 1e3,
        peak_bytes=unmoved_peak - 1,
        baseline_peak_bytes=unmoved_peak,
    )
    planned = SimpleNamespace(prediction=prediction, budget_shortfall=shortfall, budget_bytes=10)
    return PlannedChunk(None, None, planned, {}, Split(None, ("b",) * count))


MISSED = _stub(200, 30, 5, 0)
"""The best plan before the blocks, missing the budget: it bounds no count of blocks."""


def _checkpointing_search(plans: dict[int, PlannedChunk], search, *args):
    tried: list[int] = []

    def plan_at(split, options=None):
        tried.append(len(split.checkpointed))
        return plans[len(split.checkpointed)]

    blocks = tuple(f"b{i}" for i in range(len(plans)))
    return search(plan_at, OffloadOptions(memory_budget=0.5), blocks, *args), tried


def test_a_budget_is_met_by_the_fastest_plan_the_halving_makes():
    """Moving what one block leaves misses the budget and two blocks meet it by moving;
    six blocks meet it with nothing moved. Of the plans made on the way to those two
    counts, the fastest is kept."""
    plans = {1: _stub(120, 20, 5, 1)} | {c: _stub(100 + c, 20 - c, 0, c) for c in range(2, 9)}
    plans[6] = _stub(106, 10, 0, 6)  # the fewest that meet the budget of 10 unmoved
    kept, tried = _checkpointing_search(plans, joint._checkpointing_meeting_budget, MISSED)
    assert {1, 2, 6} <= set(tried) and len(set(tried)) <= 6  # halving twice over 8
    assert len(kept.split.checkpointed) == 2  # 102 ms, moving: the fastest planned
    plans[2] = _stub(130, 18, 0, 2)
    kept, tried = _checkpointing_search(plans, joint._checkpointing_meeting_budget, MISSED)
    fastest = min(set(tried), key=lambda c: plans[c].planned.prediction.step_seconds)
    assert len(kept.split.checkpointed) == fastest != 2


def test_where_no_count_meets_the_budget_every_block_is_checkpointed():
    plans = {c: _stub(100 + c, 30 - c, 20 - c, c) for c in range(1, 5)}
    kept, _ = _checkpointing_search(plans, joint._checkpointing_meeting_budget, MISSED)
    assert len(kept.split.checkpointed) == 4


def test_auto_checkpoints_the_most_blocks_within_the_tolerance():
    plans = {c: _stub(100 + c, 20 - c, 0, c) for c in range(1, 9)}
    kept, tried = _checkpointing_search(plans, joint._most_checkpointing_in_time, 105.5e-3)
    assert len(kept.split.checkpointed) == 5
    assert max(tried) > 5 and len(tried) <= 4
    none, _ = _checkpointing_search(plans, joint._most_checkpointing_in_time, 100.5e-3)
    assert none is None
