"""Saved values recomputed one by one: which the search may choose, what the split then
saves, and that the step still trains as the stock compile."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from offload_pass import _compat, recomputation
from offload_pass import joint as joint_search
from offload_pass.blocks import Split
from offload_pass.joint import SearchSpace, search_space
from offload_pass.options import OffloadOptions
from offload_pass.recomputation import (
    Recomputable,
    _computation,
    cheapest,
    first_made_first,
    last_made_first,
    recomputable,
    recomputing,
    saving_nothing_more,
)
from tests import models
from tests.conftest import assert_same_step, compiled_pair, train_step
from tests.test_joint import SLOW_COPIES

BATCH = (16, 64, 32)
"""Enough tokens that activations, not parameters, make the small stack's peak."""

BUDGET = 0.95
"""A share of the small stack's peak that recomputing single values meets, where moving
alone meets it only slowly."""


def _candidate(name: str, nbytes: int, seconds: float) -> Recomputable:
    return Recomputable((name,), nbytes, seconds, moved=False)


CANDIDATES = (
    _candidate("a", 100, 1.0),
    _candidate("b", 100, 2.0),
    _candidate("c", 100, 4.0),
)


def _names(taken: tuple[Recomputable, ...]) -> list[str]:
    return [name for value in taken for name in value.names]


def test_the_cheapest_are_taken_until_their_bytes_reach_the_need():
    assert _names(cheapest(CANDIDATES, 150, seconds=100.0)) == ["a", "b"]
    assert _names(cheapest(CANDIDATES, 100, seconds=100.0)) == ["a"]
    assert cheapest(CANDIDATES, 0, seconds=100.0) == ()


def test_none_is_taken_past_the_time_allowed():
    assert _names(cheapest(CANDIDATES, 300, seconds=3.0)) == ["a", "b"]
    assert cheapest(CANDIDATES, 300, seconds=0.5) == ()


def test_a_split_recomputing_values_saves_what_they_are_computed_from_in_their_place():
    taken = (
        Recomputable(("a", "x"), 100, 1.0, moved=False, saved=("mean",)),
        Recomputable(("b", "x"), 100, 1.0, moved=True, saved=("mean", "var")),
    )
    split = recomputing(Split(0.8, ("block",), ("c",), ("m",)), taken)
    assert split == Split(0.8, ("block",), ("c", "a", "x", "b"), ("m", "mean", "var"))


def _search_values_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The joint search tries recomputing values alone, no level and no block."""
    monkeypatch.setattr("offload_pass.partition.search_space", lambda *_: SearchSpace(values=True))


@pytest.fixture
def values_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _search_values_alone(monkeypatch)


def _plan_under_slow_copies(compiler: str):
    model, reference, backend = compiled_pair(
        models.BlockStack, compiler, memory_budget=BUDGET, profile=SLOW_COPIES
    )
    x = torch.randn(*BATCH)
    steps = [train_step(model, x, seed=seed) for seed in range(2)]
    expected = [train_step(reference, x, seed=seed) for seed in range(2)]
    (plan,) = backend.plans
    return plan, steps, expected


def _targets(graph: torch.fx.Graph) -> collections.Counter:
    return collections.Counter(n.target for n in graph.nodes if n.op == "call_function")


def _moving_alone(compiler: str):
    """The plan of the stock split under the same budget and copies, nothing recomputed."""
    model, _, backend = compiled_pair(
        models.BlockStack, compiler, memory_budget=BUDGET, profile=SLOW_COPIES, recompute_budget=1.0
    )
    train_step(model, torch.randn(*BATCH))
    (plan,) = backend.plans
    return plan


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_values_recomputed_in_place_of_slow_moves_train_as_the_stock_compile(monkeypatch, compiler):
    stock = _moving_alone(compiler)
    _search_values_alone(monkeypatch)
    plan, steps, expected = _plan_under_slow_copies(compiler)
    assert plan.recomputed_nodes
    assert not plan.planned.budget_shortfall
    assert "forward nodes computed again in backward one by one" in str(plan)
    assert plan.split_name == f"stock, {len(plan.recomputed_nodes)} nodes"
    saved = {name for d in plan.decisions for name in d.group.members}
    assert saved.isdisjoint(plan.recomputed_nodes)
    # the ops that made the values the stock split saves run again in backward, once
    # more than in the stock split's
    saved_by_stock = {d.group.root for d in stock.decisions}
    forward = {n.name: n.target for n in plan.forward.graph.nodes}
    recomputed_ops = {forward[name] for name in plan.recomputed_nodes if name in saved_by_stock}
    in_backward, in_stock_backward = _targets(plan.backward.graph), _targets(stock.backward.graph)
    assert recomputed_ops
    assert all(in_backward[op] > in_stock_backward[op] for op in recomputed_ops)
    for step, want in zip(steps, expected, strict=True):
        assert_same_step(step, want)


def test_recomputing_values_is_faster_than_moving_alone_when_copies_are_slow(monkeypatch):
    moving_alone = _moving_alone("eager")
    _search_values_alone(monkeypatch)
    plan, _, _ = _plan_under_slow_copies("eager")
    assert not moving_alone.recomputed_nodes
    assert plan.recomputed_nodes
    assert plan.prediction.step_seconds < moving_alone.prediction.step_seconds


class RandomScale(torch.nn.Module):
    """A value that draws random numbers, saved for backward."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        return self.fc2(h * torch.rand_like(h))


def test_values_that_draw_random_numbers_stay_saved(values_alone):
    model, reference, backend = compiled_pair(
        RandomScale, "eager", memory_budget=BUDGET, profile=SLOW_COPIES
    )
    x = torch.randn(32, 64)
    step = train_step(model, x)
    (plan,) = backend.plans
    drawn = [
        n.name
        for n in plan.forward.graph.nodes
        if _compat.is_aten_op(n.target) and torch.Tag.nondeterministic_seeded in n.target.tags
    ]
    assert plan.recomputed_nodes
    assert drawn
    assert set(drawn).isdisjoint(plan.recomputed_nodes)
    assert set(drawn) <= {d.group.root for d in plan.decisions}
    assert_same_step(step, train_step(reference, x))


def test_the_search_offers_values_unless_the_graph_carries_its_own_checkpointing():
    options = OffloadOptions(memory_budget=0.5)
    plain = torch.fx.symbolic_trace(models.MLP())
    assert search_space(options, plain, 1).values
    checkpointed = torch.fx.symbolic_trace(models.MLP())
    next(iter(checkpointed.graph.nodes)).meta["recompute"] = "must save"
    assert not search_space(options, checkpointed, 1).values
    assert not search_space(OffloadOptions(), plain, 1).values


def test_auto_recomputes_what_its_tolerance_leaves_time_for_where_that_lowers_the_peak(
    monkeypatch,
):
    x = torch.randn(*BATCH)
    model, _, backend = compiled_pair(models.BlockStack, "eager", stall_tolerance=0.2)
    train_step(model, x)
    (stock,) = backend.plans
    _search_values_alone(monkeypatch)
    model, reference, backend = compiled_pair(
        models.BlockStack, "eager", recompute_budget="search", stall_tolerance=0.2
    )
    step = train_step(model, x)
    (plan,) = backend.plans
    assert plan.recomputed_nodes
    assert plan.prediction.peak_bytes < stock.prediction.peak_bytes
    assert plan.prediction.step_seconds <= stock.prediction.baseline_seconds * 1.2
    assert_same_step(step, train_step(reference, x))


def test_ties_in_price_are_broken_by_when_forward_made_them():
    made = (_candidate("a", 100, 1.0), _candidate("b", 100, 1.0), _candidate("c", 100, 0.5))
    assert [c.names for c in first_made_first(made)] == [("c",), ("a",), ("b",)]
    assert [c.names for c in last_made_first(made)] == [("c",), ("b",), ("a",)]


def test_the_last_order_offers_only_values_that_save_nothing_more():
    made = (
        _candidate("a", 100, 1.0),
        Recomputable(("norm",), 100, 0.1, moved=False, saved=("mean",)),
        _candidate("b", 100, 0.5),
    )
    assert [c.names for c in saving_nothing_more(made)] == [("b",), ("a",)]


def _aten_graph(f, *args: torch.Tensor) -> dict[str, torch.fx.Node]:
    graph = make_fx(f)(*args).graph
    return {node.name: node for node in graph.nodes}


def test_a_value_is_computed_again_from_what_is_saved_with_what_lies_between():
    def f(x, w):
        return torch.mm(torch.relu(x * 2), w)

    nodes = _aten_graph(f, torch.randn(4, 4), torch.randn(4, 4))
    mm, relu, mul = nodes["mm"], nodes["relu"], nodes["mul"]
    needed, kept = _computation(mm, saved=set())
    assert set(needed) == {mm, relu, mul} and kept == ()
    assert _computation(mm, saved={relu}) == ((mm,), ())


def test_random_numbers_a_value_is_computed_from_are_saved_in_its_place():
    def f(x, w):
        return torch.mm(x * torch.rand_like(x), w)

    nodes = _aten_graph(f, torch.randn(4, 4), torch.randn(4, 4))
    mm, mul, drawn = nodes["mm"], nodes["mul"], nodes["rand_like"]
    assert _computation(mm, saved=set()) == ((mm, mul), (drawn,))
    assert _computation(mm, saved={mul}) == ((mm,), ())
    assert _computation(drawn, saved=set()) is None


def test_a_norm_is_computed_again_from_its_saved_statistics():
    """A norm's mean and variance come from one op with two results, which cannot be
    computed again alone: its output is computed again from them, saved in its place."""

    def f(x):
        var, mean = torch.var_mean(x, dim=-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + 1e-5)

    nodes = _aten_graph(f, torch.randn(4, 8))
    needed, kept = _computation(nodes["mul"], saved=set())
    assert {n.target for n in needed} == {
        torch.ops.aten.mul.Tensor,
        torch.ops.aten.sub.Tensor,
        torch.ops.aten.rsqrt.default,
        torch.ops.aten.add.Tensor,
    }
    assert {n.name for n in kept} == {"getitem", "getitem_1"}


def _saved_norm_output() -> SimpleNamespace:
    """A planned chunk (what ``recomputable`` reads of one) whose split saves a norm's
    output, 4 x 8 float32 values read by a product, and not the norm's statistics."""

    def f(x, w):
        var, mean = torch.var_mean(x, dim=-1, keepdim=True)
        return torch.mm((x - mean) * torch.rsqrt(var + 1e-5), w)

    graph = make_fx(f)(torch.randn(4, 8), torch.randn(8, 8)).graph
    nodes = list(graph.nodes)
    norm = next(n for n in nodes if n.target is torch.ops.aten.mm.default).args[0]
    group = SimpleNamespace(
        root=norm.name, members=(), produced_at=nodes.index(norm), fixed_reason=None, nbytes=128
    )
    return SimpleNamespace(
        chunk=SimpleNamespace(forward=SimpleNamespace(graph=graph)),
        planned=SimpleNamespace(decisions=(SimpleNamespace(group=group, moved=True),)),
        split=Split(),
        costs=SimpleNamespace(forward_seconds=[1.0] * len(nodes)),
    )


def test_a_norms_output_is_offered_with_its_statistics_saved_in_its_place():
    (offered,) = recomputable(_saved_norm_output())
    assert set(offered.saved) == {"getitem", "getitem_1"}
    assert offered.nbytes == 128 - 2 * 4 * 4  # less the statistics' bytes
    assert offered.seconds == 4.0  # sub, add, rsqrt and mul, each priced 1
    assert offered.moved


def test_values_computed_again_from_statistics_saved_in_their_place_train_as_the_stock_compile(
    monkeypatch, values_alone
):
    """Inductor's layer norm takes its mean and variance from one op with two results,
    which cannot be computed again alone. Offered only values whose computation stops at
    such results, the search recomputes some, the split saves the results, and the step
    trains as the stock compile."""
    offered: list[Recomputable] = []

    def computed_from_saved_statistics(planned):
        found = [value for value in recomputation.recomputable(planned) if value.saved]
        offered.extend(found)
        return tuple(found)

    monkeypatch.setattr(joint_search, "recomputable", computed_from_saved_statistics)
    plan, steps, expected = _plan_under_slow_copies("inductor")
    saved = {name for d in plan.decisions for name in (d.group.root, *d.group.members)}
    taken = [value for value in offered if set(value.names) <= set(plan.recomputed_nodes)]
    assert taken
    assert all(set(value.saved) <= saved for value in taken)
    for step, want in zip(steps, expected, strict=True):
        assert_same_step(step, want)
