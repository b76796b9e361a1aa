"""Kernel timing: which nodes are timed on the device, and how the cost model uses it."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from offload_pass import _compat, timing
from offload_pass.costs import estimate_costs, node_seconds
from offload_pass.profiles import BUILT_IN
from tests.test_costs import PROFILE, _chunk, _node

CPU = torch.device("cpu")


def test_a_matrix_product_is_timed_on_random_values_of_its_shapes():
    mm = _node(_chunk().forward.graph, torch.ops.aten.mm.default)
    seconds = timing.measured_seconds(mm, CPU)
    assert seconds is not None and 0 < seconds < 1.0


def test_a_timed_node_is_priced_at_its_measured_time():
    chunk = _chunk()
    mm = _node(chunk.forward.graph, torch.ops.aten.mm.default)
    costs = estimate_costs(chunk, PROFILE, timer=lambda node: 7.0 if node is mm else None)
    position = list(chunk.forward.graph.nodes).index(mm)
    assert costs.forward_seconds[position] == 7.0
    untimed = estimate_costs(chunk, PROFILE)
    assert costs.forward_seconds[:position] == untimed.forward_seconds[:position]
    assert untimed.forward_seconds[position] == node_seconds(mm, PROFILE)


def test_nodes_without_flops_are_left_to_the_rates():
    relu = _node(_chunk().forward.graph, torch.ops.aten.relu.default)
    assert timing.measured_seconds(relu, CPU) is None


def test_a_node_reading_integer_tensors_is_not_timed():
    """Random values cannot stand for offsets or indices, so integer tensors (beyond a
    seed's single element) keep a node on the rates."""
    ints = torch.ones(4, 4, dtype=torch.int64)
    graph = make_fx(torch.mm, tracing_mode="fake")(ints, ints)
    mm = _node(graph.graph, torch.ops.aten.mm.default)
    assert timing.measured_seconds(mm, CPU) is None


def test_symbolic_sizes_are_timed_at_their_hints():
    graph = make_fx(torch.mm, tracing_mode="symbolic")(torch.randn(6, 4), torch.randn(4, 8))
    mm = _node(graph.graph, torch.ops.aten.mm.default)
    assert isinstance(mm.meta["val"].shape[0], torch.SymInt)
    assert timing.measured_seconds(mm, CPU) is not None


def test_only_a_profile_of_the_device_present_is_timed():
    cuda = torch.device("cuda", 0)
    assert timing.timer_for(None, cuda) is not None
    assert timing.timer_for("calibrate", cuda) is not None
    assert timing.timer_for("h200", cuda) is None
    assert timing.timer_for(BUILT_IN["h200"], cuda) is None
    assert timing.timer_for(None, CPU) is None


def test_kernels_are_timed_on_real_tensors_inside_a_compile_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        assert isinstance(torch.ones(2), FakeTensor)
        with _compat.outside_fake_mode():
            assert not isinstance(torch.ones(2), FakeTensor)
