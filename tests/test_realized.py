"""A split that rebuilds a residual stream in backward, which Inductor would write out at
backward's start and hold there, is split again with that stream saved
(offload_pass.realized)."""

from __future__ import annotations

import contextlib

import torch
import torch.fx

from offload_pass import _compat
from offload_pass.blocks import Split
from offload_pass.graphs import ChunkGraphs
from offload_pass.partition import stock_splits
from offload_pass.realized import held_recomputations
from tests import models
from tests.conftest import compiled_pair, train_step

aten = torch.ops.aten
CHAIN = 5


def _chain_graphs() -> ChunkGraphs:
    """Forward computes ``r1 = x + m1, ..., r5 = r4 + m5``; backward computes the chain
    again from the saved ``x`` and ``m*``. Each ``r_k`` but the last is read by the next
    link and, after a matrix product, by its own block's gradient; ``lone`` is computed in
    backward only."""
    forward = torch.fx.Graph()
    saved = [forward.placeholder("x")] + [forward.placeholder(f"m{k}") for k in range(1, 6)]
    link = saved[0]
    for k in range(1, CHAIN + 1):
        link = forward.create_node("call_function", aten.add.Tensor, (link, saved[k]), name=f"r{k}")
    forward.output((link, *saved))

    backward = torch.fx.Graph()
    inputs = [backward.placeholder(n.name) for n in saved]
    grad = backward.placeholder("tangent")
    links = [inputs[0]]
    for k in range(1, CHAIN + 1):
        args = (links[-1], inputs[k])
        links.append(backward.create_node("call_function", aten.add.Tensor, args, name=f"r{k}"))
    lone = backward.create_node(
        "call_function", aten.mul.Tensor, (inputs[1], inputs[2]), name="lone"
    )
    lone_read = backward.call_function(aten.mul.Tensor, (lone, lone))
    grads = [backward.call_function(aten.mul.Tensor, (grad, links[CHAIN]))]
    for k in range(CHAIN - 1, 0, -1):
        product = backward.call_function(aten.mm.default, (grads[-1], grads[-1]))
        grads.append(backward.call_function(aten.mul.Tensor, (product, links[k])))
    backward.call_function(aten.mm.default, (lone, lone))
    backward.output((*grads, lone_read))
    return ChunkGraphs(
        torch.fx.GraphModule(torch.nn.Module(), forward),
        torch.fx.GraphModule(torch.nn.Module(), backward),
        num_forward_outputs=1,
    )


def test_held_are_the_recomputed_links_read_across_a_product_past_the_read_limit():
    """``r_k`` inlined reads ``x`` and ``m1..m_k``: k + 1 buffers, counted again from a
    held link (written out, it is one buffer). The last link has one reader; ``lone`` is
    not recomputed (forward never computes it), and a product reads it as well, so the
    graph's own memory model already writes it out."""
    graphs = _chain_graphs()
    assert held_recomputations(graphs, reads_threshold=4) == {"r4"}
    assert held_recomputations(graphs, reads_threshold=2) == {"r2", "r4"}
    assert held_recomputations(graphs, reads_threshold=100) == frozenset()


def _stock_and_ours(
    budget: float, depth: int, marks_left: list[str] | None = None
) -> dict[str, ChunkGraphs]:
    """The stock partitioner's split of a residual stack under ``budget``, and the
    partition stage's, from the joint graph Inductor would partition. ``marks_left``
    receives the joint graph's nodes that carry a recompute policy after the stage's
    split."""
    found: dict[str, ChunkGraphs] = {}

    def partition(joint, joint_inputs, **kwargs):
        stock = _compat.stock_partition(joint, joint_inputs, budget, **kwargs)
        found["stock"] = ChunkGraphs(*stock, kwargs["num_fwd_outputs"])
        found["ours"] = stock_splits(joint, joint_inputs, **kwargs)(Split(budget))
        if marks_left is not None:
            marks_left.extend(n.name for n in joint.graph.nodes if "recompute" in n.meta)
        return found["ours"].forward, found["ours"].backward

    def backend(gm, example_inputs):
        passes = _compat.after_inductor_joint_passes(partition)
        return _compat.compile_with_eager(
            gm, example_inputs, passes, _compat.inductor_decompositions()
        )

    torch.manual_seed(0)
    model = torch.compile(models.BlockStack(depth=depth), backend=backend)
    model(torch.randn(2, 16, 32)).sum().backward()
    return found


def test_a_split_rebuilding_the_residual_stream_is_split_again_saving_it():
    splits = _stock_and_ours(budget=0.5, depth=6)
    threshold = _compat.realize_reads_threshold()
    held = held_recomputations(splits["stock"], threshold)
    assert any(name.startswith("add") for name in held), held
    ours = splits["ours"]
    assert held_recomputations(ours, threshold) == frozenset()
    recomputed = {n.name for n in ours.backward.graph.nodes if n.op == "call_function"}
    assert held.isdisjoint(recomputed)


def test_the_marks_are_lifted_after_the_split():
    """The joint graph is split again under other budgets by the search: the policies the
    stage set must not outlive its split."""
    joint = torch.fx.symbolic_trace(models.MLP())
    names = frozenset(n.name for n in joint.graph.nodes if n.op == "call_function")
    first = next(n for n in joint.graph.nodes if n.op == "call_function")
    first.meta["recompute"] = "the user's own"
    with _compat.partitioner_policies(joint, names):
        marked = [n.name for n in joint.graph.nodes if "recompute" in n.meta]
        assert sorted(marked) == sorted(names)
    assert [n for n in joint.graph.nodes if "recompute" in n.meta] == [first]
    assert first.meta["recompute"] == "the user's own"


def test_no_marks_outlive_the_split_again_on_the_graph_the_partitioner_leaves():
    """The partitioner replaces the joint graph by its common-subexpression copy, the
    stage's marks copied with it; a search splitting that graph again under a lower
    budget must not save what an earlier split held."""
    marks_left: list[str] = []
    splits = _stock_and_ours(budget=0.5, depth=6, marks_left=marks_left)
    assert held_recomputations(splits["stock"], _compat.realize_reads_threshold())
    assert marks_left == []


def test_steps_split_again_equal_the_model_without_offloading():
    """Under a recompute budget where the stock split rebuilds the residual stream, the
    pass's step (split again, nothing moved) computes the eager model's loss and
    gradients."""
    model, _, backend = compiled_pair(
        lambda: models.BlockStack(depth=6), "inductor", fraction=0.0, recompute_budget=0.5
    )
    torch.manual_seed(0)
    eager = models.BlockStack(depth=6)
    x = torch.randn(2, 16, 32)
    got, want = train_step(model, x), train_step(eager, x)
    (plan,) = backend.plans
    assert plan.recompute_budget == 0.5
    torch.testing.assert_close(got[0], want[0])
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][f"_orig_mod.{name}"], grad, msg=name)
    torch.testing.assert_close(got[2], want[2])


def test_each_level_split_after_the_first_collects_what_the_levels_before_left(monkeypatch):
    """Full collections are deferred while the pass runs; the splits a budget's search
    drops are cyclic garbage that only a full collection frees, so one is made before
    each level after the first, and none before the first or within a level (where a
    split is made again with Inductor's held values saved)."""
    from offload_pass import partition

    graphs = _chain_graphs()
    events = []
    monkeypatch.setattr(partition.gc, "collect", lambda *args: events.append("collect"))

    def stock_partition(joint, joint_inputs, budget, **kwargs):
        events.append(f"split {budget}")
        return graphs.forward, graphs.backward

    monkeypatch.setattr(_compat, "stock_partition", stock_partition)
    monkeypatch.setattr(_compat, "partitioner_policies", lambda *args: contextlib.nullcontext())
    monkeypatch.setattr(partition, "held_recomputations", lambda *args: frozenset({"r4"}))
    monkeypatch.setattr(partition, "recomputed_regions", lambda *args: {})
    split = stock_splits(None, [], num_fwd_outputs=graphs.num_forward_outputs)
    split(Split(None))
    split(Split(0.6))
    assert events == ["split None", "split None", "collect", "split 0.6", "split 0.6"]
