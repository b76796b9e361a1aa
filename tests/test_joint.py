"""A memory budget that moving alone meets only by slowing the step is met by recomputing
as well: the pass chooses the split, and backward computes what the stock compile computes
under that split."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from offload_pass import _compat
from offload_pass import joint as joint_search
from offload_pass.blocks import Split
from offload_pass.costs import node_seconds
from offload_pass.driver import PlannedChunk
from offload_pass.joint import RECOMPUTE_LEVELS, SearchSpace, search_space
from offload_pass.options import OffloadOptions
from offload_pass.partition import stock_splits
from offload_pass.profiles import BUILT_IN
from offload_pass.recomputation import Recomputable
from tests import models
from tests.conftest import assert_same_step, compiled_pair, train_step

BUDGET = 0.9
"""A share of the small stack's peak that moving alone meets, and so does recomputing
(nothing the stack saves goes below 0.84: its parameters and gradients)."""

# the CPU's rates with slow and fast copies (on the CPU a copy adds its whole time to the step)
SLOW_COPIES = models.copies_at(BUILT_IN["cpu"], 1e6, "slow copies")
FAST_COPIES = models.copies_at(BUILT_IN["cpu"], 1e15, "fast copies")


def _plan(compiler: str = "eager", **options):
    model, _, backend = compiled_pair(models.BlockStack, compiler, **options)
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


def test_the_search_splits_with_the_compiles_objects_frozen(monkeypatch):
    """The collection before each split after the first walks only what the pass made;
    afterwards nothing stays frozen, and objects a caller froze stay frozen."""
    import gc

    from offload_pass import partition

    frozen_at_splits = []
    stock_splits = partition.stock_splits

    def recording(*args, **kwargs):
        split = stock_splits(*args, **kwargs)

        def partition_under(chosen):
            frozen_at_splits.append(gc.get_freeze_count())
            return split(chosen)

        return partition_under

    monkeypatch.setattr(partition, "stock_splits", recording)
    _plan(memory_budget=BUDGET, profile=SLOW_COPIES)
    assert len(frozen_at_splits) > 1 and all(frozen_at_splits)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        _plan(memory_budget=BUDGET, profile=SLOW_COPIES)
        assert gc.get_freeze_count() > 0  # unfrozen, there would be none
    finally:
        gc.unfreeze()


def test_a_joint_split_again_is_split_as_a_fresh_copy_of_it_is(monkeypatch):
    """The search partitions one joint several times; the partitioner's common
    subexpression pass runs on the first only (``_compat._DEDUPLICATED``), and every
    split, so the plan, is what it is with the pass run on each."""
    from torch._functorch import partitioners

    calls = []
    deduplicate = partitioners.fx_graph_cse

    def counted(graph, *args, **kwargs):
        calls.append(graph)
        return deduplicate(graph, *args, **kwargs)

    monkeypatch.setattr(partitioners, "fx_graph_cse", counted)
    once = _plan("inductor", memory_budget=BUDGET, profile=SLOW_COPIES)
    assert len(calls) == 1
    monkeypatch.setattr(_compat, "_DEDUPLICATED", _NeverDeduplicated())
    each_time = _plan("inductor", memory_budget=BUDGET, profile=SLOW_COPIES)
    assert len(calls) > 2
    assert once.recompute_budget == each_time.recompute_budget != 1.0
    assert once.forward.code == each_time.forward.code
    assert once.backward.code == each_time.backward.code
    assert once.prediction == each_time.prediction


class _NeverDeduplicated:
    def __contains__(self, graph: object) -> bool:
        return False

    def add(self, graph: object) -> None:
        pass


def test_a_budget_no_split_meets_is_planned_once_and_warned_once():
    """A share that rounds to no bytes at all: every split misses it, the search goes on
    in bytes, and the kept plan alone warns."""
    with pytest.warns(UserWarning, match="cannot meet memory_budget") as caught:
        plan = _plan(memory_budget=1e-9, profile=SLOW_COPIES)
    assert sum("cannot meet memory_budget" in str(w.message) for w in caught) == 1
    assert plan.planned.budget_shortfall > 0


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
    same_split = _plan(compiler, fraction=0.0, recompute_budget=plan.recompute_budget)
    assert plan.bytes_saved_for_backward == same_split.bytes_saved_for_backward
    assert plan.bytes_saved_for_backward < _plan(compiler, fraction=0.0).bytes_saved_for_backward


def _levels(options: OffloadOptions, joint: torch.fx.GraphModule) -> tuple[float, ...]:
    return search_space(options, joint, 1).levels


def test_the_search_tries_the_levels_below_the_partitioners_own_setting():
    joint = torch.fx.symbolic_trace(models.MLP())
    assert _levels(OffloadOptions(memory_budget=BUDGET), joint) == RECOMPUTE_LEVELS
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        assert _levels(OffloadOptions(memory_budget=BUDGET), joint) == (0.4, 0.2)
    assert not search_space(OffloadOptions(), joint, 1)
    assert not search_space(OffloadOptions(memory_budget=BUDGET, recompute_budget=0.5), joint, 1)


def test_no_level_is_searched_where_the_graph_carries_its_own_recompute_budget():
    """The partitioner takes a node's budget over any setting: every split would be one."""
    joint = torch.fx.symbolic_trace(models.MLP())
    next(iter(joint.graph.nodes)).meta["memory_budget"] = 0.5
    assert _levels(OffloadOptions(memory_budget=BUDGET), joint) == ()


def _stub_split(
    step_ms: float,
    unmoved_ms: float,
    level: float | None,
    shortfall: int = 0,
    peak: int = 0,
    split: Split | None = None,
    unmoved_peak: int = 0,
):
    """A planned split as the search reads it: its predicted step, its step with nothing
    moved, what it misses the budget by, and its predicted peak, planned and with nothing
    moved; the split at ``level`` unless another is given."""
    prediction = SimpleNamespace(
        step_seconds=step_ms / 1e3,
        baseline_seconds=unmoved_ms / 1e3,
        peak_bytes=peak,
        baseline_peak_bytes=unmoved_peak,
    )
    planned = SimpleNamespace(
        prediction=prediction, budget_shortfall=shortfall, budget_bytes=1, decisions=()
    )
    return PlannedChunk(None, None, planned, {}, split or Split(level))


def _search(monkeypatch, splits: dict[float | None, PlannedChunk], **options):
    """The search over ``splits`` by level (each partition stands in as its level), with
    ``options`` (default: a memory budget); the split kept and the levels planned."""
    tried: list[float | None] = []

    def planned(split, options, rule, host_scale):
        tried.append(split.recompute_budget)
        return splits[split.recompute_budget]

    monkeypatch.setattr(joint_search, "plan_chunk", planned)
    chosen = OffloadOptions(**(options or {"memory_budget": 0.5}))
    kept = joint_search.plan_jointly(
        lambda split: split, chosen, chosen.fraction_rule(), SearchSpace(RECOMPUTE_LEVELS)
    )
    return kept, tried


def test_the_search_goes_past_a_level_that_does_not_improve_while_a_lower_one_could(monkeypatch):
    """W2's pattern under the H200 rates: 0.6 is slower than 0.8, 0.4 faster than both."""
    splits = {
        None: _stub_split(1000, 500, None),
        0.8: _stub_split(594, 507, 0.8),
        0.6: _stub_split(614, 529, 0.6),
        0.4: _stub_split(572, 558, 0.4),
        0.2: _stub_split(594, 594, 0.2),
    }
    kept, tried = _search(monkeypatch, splits)
    # after 0.2, nothing lower is left; 0.2's step with nothing moved (594) is over 572
    assert tried == [None, 0.8, 0.6, 0.4, 0.2] and kept.split.recompute_budget == 0.4


def test_the_search_stops_once_no_lower_level_can_beat_the_best(monkeypatch):
    splits = {
        None: _stub_split(1000, 500, None),
        0.8: _stub_split(560, 507, 0.8),
        0.6: _stub_split(590, 565, 0.6),  # with nothing moved already slower than 560
    }
    kept, tried = _search(monkeypatch, splits)
    assert tried == [None, 0.8, 0.6] and kept.split.recompute_budget == 0.8


def test_a_split_that_misses_the_budget_does_not_end_the_search(monkeypatch):
    splits = {
        None: _stub_split(1000, 500, None, shortfall=100),
        0.8: _stub_split(520, 510, 0.8, shortfall=50),
        0.6: _stub_split(600, 530, 0.6),
        0.4: _stub_split(640, 640, 0.4),
    }
    kept, tried = _search(monkeypatch, splits)
    assert tried == [None, 0.8, 0.6, 0.4] and kept.split.recompute_budget == 0.6


def test_a_level_no_nearer_a_budget_nothing_met_ends_the_search(monkeypatch):
    splits = {
        None: _stub_split(1000, 500, None, shortfall=100),
        0.8: _stub_split(520, 510, 0.8, shortfall=120),
    }
    kept, tried = _search(monkeypatch, splits)
    assert tried == [None, 0.8] and kept.split.recompute_budget is None


def _search_with_values(monkeypatch, splits, values: PlannedChunk, blocks=()):
    """As :func:`_search`, the values' search standing in as ``values``, over the levels
    and ``blocks``; the split kept and the levels planned (a block's as its count)."""
    tried: list[float | int | None] = []

    def planned(split, options, rule, host_scale):
        count = len(split.checkpointed)
        tried.append(count or split.recompute_budget)
        return splits[count or split.recompute_budget]

    monkeypatch.setattr(joint_search, "plan_chunk", planned)
    monkeypatch.setattr(joint_search, "_values_recomputed_for_budget", lambda *_: values)
    chosen = OffloadOptions(memory_budget=0.5)
    space = SearchSpace(RECOMPUTE_LEVELS, blocks, values=True)
    kept = joint_search.plan_jointly(lambda split: split, chosen, chosen.fraction_rule(), space)
    return kept, tried


def test_values_meeting_the_budget_in_time_leave_the_levels_and_blocks_untried(monkeypatch):
    """The values' splits cost the partitioner the least, so they are tried first."""
    values = _stub_split(505, 503, None, split=Split(None, recomputed=("mm",)))
    splits = {None: _stub_split(1000, 500, None), 0.8: _stub_split(501, 501, 0.8)}
    kept, tried = _search_with_values(monkeypatch, splits, values, blocks=("b0", "b1"))
    assert tried == [None] and kept.split == values.split


def test_values_meeting_the_budget_only_slowly_leave_the_levels_to_try(monkeypatch):
    values = _stub_split(700, 503, None, split=Split(None, recomputed=("mm",)))
    splits = {
        None: _stub_split(1000, 500, None),
        0.8: _stub_split(560, 507, 0.8),
        0.6: _stub_split(590, 565, 0.6),
    }
    kept, tried = _search_with_values(monkeypatch, splits, values)
    assert tried == [None, 0.8, 0.6] and kept.split.recompute_budget == 0.8


def test_no_more_blocks_are_planned_than_one_whose_split_is_no_faster_than_the_best(
    monkeypatch,
):
    """Each block more recomputes more: a count whose step with nothing moved is past the
    best plan's step bounds every count above it."""
    values = _stub_split(600, 503, None, split=Split(None, recomputed=("mm",)))
    splits = {
        None: _stub_split(1000, 500, None),
        0.8: _stub_split(700, 620, 0.8),  # with nothing moved past 600: no level can win
        1: _stub_split(650, 505, None, shortfall=10),
        2: _stub_split(560, 550, None, unmoved_peak=10),
        3: _stub_split(585, 580, None, unmoved_peak=10),
        4: _stub_split(700, 700, None),  # past 600: so are 5 to 8
    }
    blocks = tuple(f"b{i}" for i in range(8))
    kept, tried = _search_with_values(monkeypatch, splits, values, blocks)
    assert tried == [None, 0.8, 1, 4, 2, 3] and len(kept.split.checkpointed) == 2

    splits[1] = _stub_split(650, 610, None)  # one block no faster than the values' plan
    kept, tried = _search_with_values(monkeypatch, splits, values, blocks)
    assert tried == [None, 0.8, 1] and kept.split == values.split


def _rounds_tried(monkeypatch, plans: list[PlannedChunk], slowest_ms: float) -> list[Split]:
    """The splits the values' rounds plan from a stock split meeting the budget slowly,
    each round's plan taken from ``plans`` in turn."""
    monkeypatch.setattr(joint_search, "recomputable", lambda planned: ["value"])
    names = iter(("a", "b", "c"))
    monkeypatch.setattr(
        joint_search, "cheapest", lambda *_: (Recomputable((next(names),), 1, 0.0, False),)
    )
    tried: list[Split] = []

    def plan(split: Split) -> PlannedChunk:
        tried.append(split)
        return dataclasses.replace(plans[len(tried) - 1], split=split)

    stock = _stub_split(1000, 500, None)
    joint_search._rounds(plan, stock, lambda values: values, slowest_ms / 1e3)
    return tried


def test_the_values_rounds_stop_at_the_first_plan_meeting_the_budget_in_time(monkeypatch):
    plans = [_stub_split(900, 502, None), _stub_split(505, 504, None), _stub_split(503, 503, None)]
    tried = _rounds_tried(monkeypatch, plans, slowest_ms=510)
    assert [split.recomputed for split in tried] == [("a",), ("a", "b")]
    tried = _rounds_tried(monkeypatch, plans, slowest_ms=501)  # none in time: every round
    assert [split.recomputed for split in tried] == [("a",), ("a", "b"), ("a", "b", "c")]


AUTO_SEARCH = {"recompute_budget": "search", "stall_tolerance": 0.02}
"""auto, choosing the split: within 2% of the stock split's 100 ms step below."""


def test_auto_keeps_the_split_with_the_lowest_peak_within_the_tolerance(monkeypatch):
    splits = {
        None: _stub_split(100, 100, None, peak=10),
        0.8: _stub_split(101, 100.5, 0.8, peak=7),
        0.6: _stub_split(101.5, 101.5, 0.6, peak=6),
        0.4: _stub_split(103, 103, 0.4, peak=5),  # recomputing past the tolerance
    }
    kept, tried = _search(monkeypatch, splits, **AUTO_SEARCH)
    assert tried == [None, 0.8, 0.6, 0.4] and kept.split.recompute_budget == 0.6
    assert kept.stage_seconds["search"] >= 0


def test_auto_does_not_keep_a_split_planned_past_the_stock_step(monkeypatch):
    """Each split's own plan moves within the tolerance of its own step: one close to the
    limit can plan past it, and a lower peak does not make up for that."""
    splits = {
        None: _stub_split(100, 100, None, peak=10),
        0.8: _stub_split(103, 101, 0.8, peak=5),
        0.6: _stub_split(102.5, 102.5, 0.6, peak=4),
    }
    kept, tried = _search(monkeypatch, splits, **AUTO_SEARCH)
    assert tried == [None, 0.8, 0.6] and kept.split.recompute_budget is None


def test_auto_keeps_the_stock_split_where_recomputing_lowers_no_peak(monkeypatch):
    splits = {
        None: _stub_split(100, 100, None, peak=10),
        0.8: _stub_split(100, 100, 0.8, peak=10),
        0.6: _stub_split(101, 101, 0.6, peak=11),
        0.4: _stub_split(101, 101, 0.4, peak=10),
        0.2: _stub_split(101, 101, 0.2, peak=10),
    }
    kept, _ = _search(monkeypatch, splits, **AUTO_SEARCH)
    assert kept.split.recompute_budget is None


def _searched(search, most: int, fewest: int) -> tuple[int | None, list[int]]:
    """What ``search`` finds among 1 to ``most`` where ``fewest`` and more are enough, and
    the counts it tried."""
    tries: list[int] = []
    found = search(most, lambda count: tries.append(count) or count >= fewest)
    return found, tries


@pytest.mark.parametrize("most", [1, 2, 5, 8, 13])
def test_trying_one_first_finds_the_fewest_that_halving_finds(most):
    for fewest in range(1, most + 2):  # most + 1: none is enough
        found, one_first = _searched(joint_search._fewest_one_first, most, fewest)
        halved, halving = _searched(joint_search._fewest, most, fewest)
        assert found == halved == (fewest if fewest <= most else None)
        assert one_first[0] == 1 and set(one_first) <= set(range(1, most + 1))
        assert len(one_first) <= len(halving) + 1
    assert _searched(joint_search._fewest_one_first, most, 1) == (1, [1])  # one try


def test_auto_searches_the_splits_only_where_asked():
    joint = torch.fx.symbolic_trace(models.MLP())
    assert _levels(OffloadOptions(recompute_budget="search"), joint) == RECOMPUTE_LEVELS
    assert not search_space(OffloadOptions(), joint, 1)
    budget = OffloadOptions(memory_budget=BUDGET, recompute_budget="search")
    assert _levels(budget, joint) == RECOMPUTE_LEVELS


def test_auto_choosing_its_split_trains_as_the_stock_compile_of_that_split():
    """On the CPU nothing moves, so what auto may do is recompute: on the small stack it
    recomputes where that lowers the predicted peak within the tolerance, and backward
    computes what the stock compile computes under that split."""
    model, reference, backend = compiled_pair(
        models.BlockStack, "eager", recompute_budget="search", stall_tolerance=0.1
    )
    x = torch.randn(2, 16, 32)
    steps = [train_step(model, x, seed=step) for step in range(2)]
    (plan,) = backend.plans
    assert plan.recompute_budget in RECOMPUTE_LEVELS
    assert plan.prediction.peak_bytes < _plan().prediction.peak_bytes
    assert plan.prediction.step_seconds <= 1.1 * _plan().prediction.baseline_seconds
    with torch._functorch.config.patch(activation_memory_budget=plan.recompute_budget):
        expected = [train_step(reference, x, seed=step) for step in range(2)]
    for step, want in zip(steps, expected, strict=True):
        assert_same_step(step, want)


def _saved_under(pricing, budget: float = 0.5) -> list[str]:
    """What backward takes from forward (parameters and incoming gradients aside) where
    the partition stage splits ``tanh(tanh(x @ a) @ b)`` under ``budget``, its
    knapsack pricing each product by ``pricing``."""
    saved: list[str] = []

    def partition(joint, joint_inputs, **kwargs):
        split = stock_splits(joint, joint_inputs, pricing, **kwargs)(Split(budget))
        inputs = split.backward.graph.find_nodes(op="placeholder")
        saved.extend(n.name for n in inputs if not n.name.startswith(("primals", "tangents")))
        return split.forward, split.backward

    def backend(gm, example_inputs):
        passes = _compat.after_inductor_joint_passes(partition)
        return _compat.compile_with_eager(
            gm, example_inputs, passes, _compat.inductor_decompositions()
        )

    def two_products(x, a, b):
        return torch.tanh(torch.tanh(x @ a) @ b).sum()

    x, a, b = (torch.randn(64, 64, requires_grad=True) for _ in range(3))
    torch.compile(two_products, backend=backend)(x, a, b).backward()
    return saved


def test_the_partitioner_recomputes_the_products_the_pricing_makes_cheapest():
    """Under a recompute budget the split saves the product priced dear and recomputes
    the one priced cheap, whichever that is."""
    second_dear = _saved_under(lambda node: 100.0 if node.name == "mm_1" else 1.0)
    first_dear = _saved_under(lambda node: 100.0 if node.name == "mm" else 1.0)
    assert "mm_1" in second_dear
    assert "mm_1" not in first_dear


def test_the_backend_prices_recomputation_as_the_cost_model_prices_nodes(monkeypatch):
    priced: list[tuple[float, float]] = []
    stock_partition = _compat.stock_partition

    def spy(joint, joint_inputs, budget, recompute_seconds=None, **kwargs):
        for node in joint.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default):
            want = node_seconds(node, BUILT_IN["cpu"])
            priced.append((recompute_seconds(node), want))
        return stock_partition(joint, joint_inputs, budget, recompute_seconds, **kwargs)

    monkeypatch.setattr(_compat, "stock_partition", spy)
    _plan(memory_budget=BUDGET, profile="cpu")
    assert priced and all(got == want > 0 for got, want in priced)
