"""The cost model on a graph small enough to price by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from offload_pass.costs import (
    ATTENTION_BACKWARD_ACCUMULATORS,
    ReuseHold,
    _run_position,
    estimate_costs,
    kernel_launches,
    node_seconds,
)
from offload_pass.graphs import ChunkGraphs, materializes
from offload_pass.profiles import BUILT_IN, DeviceProfile
from offload_pass.simulate import MemoryTimeline, peak_bytes

PROFILE = DeviceProfile("test", 1e3, 1e3, 1e12, 1e9, 1e9, 2e9)


def _forward(x, w):
    y = torch.mm(x, w)
    return y.relu().sum(), y


def _backward(y, tangent):
    return (y * tangent,)


def _chunk(
    forward_fn=_forward, backward_fn=_backward, num_saved=1, tangent_shape=()
) -> ChunkGraphs:
    """Forward on x (6×4) and w (4×8); backward reads forward's last ``num_saved``
    outputs (6×8 each), then a tangent of ``tangent_shape``."""
    x, w = torch.randn(6, 4), torch.randn(4, 8)
    forward = make_fx(forward_fn, tracing_mode="fake")(x, w)
    saved = forward.graph.output_node().args[0][-num_saved:]
    saved_values = [torch.mm(x, w) for _ in range(num_saved)]
    backward = make_fx(backward_fn, tracing_mode="fake")(*saved_values, torch.ones(tangent_shape))
    placeholders = backward.graph.find_nodes(op="placeholder")[:num_saved]
    for node, placeholder in zip(saved, placeholders, strict=True):
        placeholder.name = placeholder.target = node.name
    backward.recompile()
    return ChunkGraphs(forward, backward, num_forward_outputs=1)


def _node(graph: torch.fx.Graph, target) -> torch.fx.Node:
    (node,) = graph.find_nodes(op="call_function", target=target)
    return node


def test_a_matrix_product_is_priced_by_its_flops():
    mm = _node(_chunk().forward.graph, torch.ops.aten.mm.default)
    assert node_seconds(mm, PROFILE) == pytest.approx(2 * 6 * 4 * 8 / 1e3)


def test_a_grouped_product_is_priced_by_its_flops_at_the_matrix_rate():
    """A mixture of experts' projection: 24 tokens sorted among 3 experts, 16 in, 8 out."""

    def project(tokens, experts, offsets):
        return torch._grouped_mm(tokens, experts, offs=offsets)

    tokens = torch.randn(24, 16, dtype=torch.bfloat16)
    experts = torch.randn(3, 16, 8, dtype=torch.bfloat16)
    offsets = torch.tensor([8, 16, 24], dtype=torch.int32)
    graph = make_fx(project, tracing_mode="fake")(tokens, experts, offsets).graph
    product = _node(graph, torch.ops.aten._grouped_mm.default)
    assert node_seconds(product, PROFILE) == pytest.approx(2 * 24 * 16 * 8 / 1e3)


def test_an_elementwise_op_is_priced_by_the_bytes_it_moves():
    backward = _chunk().backward.graph
    mul = _node(backward, torch.ops.aten.mul.Tensor)
    slow_memory = dataclasses.replace(PROFILE, memory_bandwidth=388.0)
    assert materializes(mul)
    assert node_seconds(mul, slow_memory) == pytest.approx(1.0)  # reads 192 + 4 B, writes 192 B


def test_an_elementwise_op_that_fuses_into_a_reduction_writes_nothing():
    relu = _node(_chunk().forward.graph, torch.ops.aten.relu.default)
    slow_memory = dataclasses.replace(PROFILE, memory_bandwidth=192.0)
    assert not materializes(relu)
    assert node_seconds(relu, slow_memory) == pytest.approx(1.0)  # reads y, 192 B


def test_views_and_placeholders_cost_nothing():
    chunk = _chunk()
    placeholders = chunk.forward.graph.find_nodes(op="placeholder")
    assert all(node_seconds(n, PROFILE) == 0 for n in placeholders)


def test_memory_timeline_follows_each_storage_from_producer_to_last_use():
    # forward: x, w, mm, relu, sum, output; backward: y, tangent, mul, output.
    costs = estimate_costs(_chunk(), PROFILE)
    assert costs.resident_bytes == 6 * 4 * 4 + 4 * 8 * 4
    # relu fuses into sum and takes no memory; sum (a user output) lives until forward
    # returns; the tangent dies after mul; y dies at mul, which writes the gradient into
    # y's storage (as large, same dtype); the gradient (a backward output) is kept.
    assert costs.allocated == (0, 0, 192, 0, 4, 0, 0, 4, 0, 0)
    assert costs.freed == (0, 0, 0, 0, 0, 4, 0, 0, 4, 192)
    assert costs.backward_inputs == 2
    # the peak is while sum runs and while mul runs: y (then the gradient) and the loss,
    # then the tangent
    assert peak_bytes(costs, ()) == costs.resident_bytes + 192 + 4


def _forward_doubling(x, w):
    y = torch.mm(x, w)
    return y * 2, y


def test_a_user_output_is_held_until_forward_returns_not_through_backward():
    """The caller drops forward's outputs before backward (a loss read off the model's
    output, a graph break's values passed on): backward holds y and the output's tangent,
    not the output beside them."""
    chunk = _chunk(forward_fn=_forward_doubling, tangent_shape=(6, 8))
    costs = estimate_costs(chunk, PROFILE)
    doubled = _position(chunk, chunk.forward.graph, torch.ops.aten.mul.Tensor)
    returns = len(chunk.forward.graph.nodes) - 1
    assert costs.allocated[doubled] == 192
    assert costs.freed[returns] == 192
    assert peak_bytes(costs, ()) == costs.resident_bytes + 2 * 192


def test_a_user_output_is_held_by_each_other_forward_in_flight():
    """A forward before this one, its backward pending, still holds what it returned
    (a pipeline stage's outputs kept for their backward), besides what it saved."""
    costs = estimate_costs(_chunk(forward_fn=_forward_doubling, tangent_shape=(6, 8)), PROFILE)
    assert costs.returned_bytes == 192
    assert peak_bytes(costs, (), in_flight=2) == costs.resident_bytes + 2 * 192 + 2 * 192


def _forward_adding(x, w):
    y = torch.mm(x, w)
    z = y + 1  # y dies here
    return z.sum(), z


def _forward_widening(x, w):
    y = torch.mm(x, w)
    z = y + torch.full((6, 8), 1.0, dtype=torch.float64)  # y dies; z's elements are wider
    return z.sum(), z


def _position(chunk: ChunkGraphs, graph: torch.fx.Graph, target) -> int:
    nodes = list(graph.nodes)
    offset = 0 if graph is chunk.forward.graph else len(chunk.forward.graph.nodes)
    return offset + nodes.index(_node(graph, target))


def test_a_fused_kernel_writes_into_a_same_sized_input_it_reads_for_the_last_time():
    """Inductor's in-place reuse: a residual add into the matrix product it adds."""
    chunk = _chunk(_forward_adding)
    costs = estimate_costs(chunk, PROFILE)
    add = _position(chunk, chunk.forward.graph, torch.ops.aten.add.Tensor)
    assert (costs.allocated[add], costs.freed[add]) == (0, 0)
    assert peak_bytes(costs, ()) == costs.resident_bytes + 192 + 4  # z, and the loss or tangent


def _forward_reusing(x, w):
    y = torch.mm(x, w)
    narrow = torch.mm(y, torch.ones(8, 4))  # y's last read
    wide = torch.mm(x, torch.ones(4, 16))  # another size: y stays pooled
    z = torch.mm(x, w)  # y's size and dtype: Inductor writes it into y's buffer
    return narrow.sum() + wide.sum() + z.sum(), z


def test_a_freed_buffer_is_held_until_a_later_one_of_its_size_takes_it():
    """Inductor's buffer reuse: a buffer freed goes to a pool, and the next allocation
    of its dtype and size takes it, so it stays allocated in between."""
    chunk = _chunk(_forward_reusing)
    costs = estimate_costs(chunk, PROFILE)
    nodes = list(chunk.forward.graph.nodes)
    y, narrow, wide, z = chunk.forward.graph.find_nodes(
        op="call_function", target=torch.ops.aten.mm.default
    )
    assert ReuseHold(nodes.index(narrow), nodes.index(z), 6 * 8 * 4) in costs.reuse_holds
    pooled = MemoryTimeline(costs, ()).live  # nothing moved: reuse is on
    freed = MemoryTimeline(dataclasses.replace(costs, reuse_holds=()), ()).live
    at_wide, at_z = nodes.index(wide), nodes.index(z)
    assert pooled.max(at_wide, at_wide + 1) == freed.max(at_wide, at_wide + 1) + 6 * 8 * 4
    assert pooled.max(at_z, at_z + 1) == freed.max(at_z, at_z + 1)  # z takes y's buffer


def test_no_kernel_writes_into_an_input_of_another_dtype():
    chunk = _chunk(_forward_widening)
    costs = estimate_costs(chunk, PROFILE)
    add = _position(chunk, chunk.forward.graph, torch.ops.aten.add.Tensor)
    assert (costs.allocated[add], costs.freed[add]) == (6 * 8 * 8, 6 * 8 * 4)


def _forward_sin_and_cos(x, w):
    y = torch.mm(x, w)
    a, b = y.sin(), y.cos()  # one kernel, two results, both reading y
    return a.sum() + b.sum(), a, b


def _forward_transposing(x, w):
    z = torch.mm(x, w).t() * 2  # y dies here, read across its rows
    return z.sum(), z


def _forward_to_int(x, w):
    y = torch.mm(x, w)
    z = torch.ops.prims.convert_element_type.default(y + 1, torch.int32)  # as many bytes
    return z.sum(), z


def _backward_product(a, b, tangent):
    return (a * b * tangent,)


def test_a_kernel_with_two_results_writes_neither_into_the_input_both_read():
    chunk = _chunk(_forward_sin_and_cos, _backward_product, num_saved=2)
    costs = estimate_costs(chunk, PROFILE)
    sin = _position(chunk, chunk.forward.graph, torch.ops.aten.sin.default)
    cos = _position(chunk, chunk.forward.graph, torch.ops.aten.cos.default)
    assert costs.allocated[sin] + costs.allocated[cos] == 2 * 192


def _forward_returning_what_it_saves(x, w):
    y = torch.mm(x, w)
    return y, y


def test_no_kernel_writes_into_what_forward_returns():
    """AOTAutograd does not donate a saved value forward also returns: the gradient
    backward computes from it takes a storage of its own."""
    chunk = _chunk(_forward_returning_what_it_saves, tangent_shape=(6, 8))
    costs = estimate_costs(chunk, PROFILE)
    mul = _position(chunk, chunk.backward.graph, torch.ops.aten.mul.Tensor)
    assert costs.allocated[mul] == 192
    assert costs.returned_bytes == 0  # backward reads it: held as a saved value
    assert peak_bytes(costs, ()) == costs.resident_bytes + 3 * 192  # y, tangent, gradient


def test_a_kernel_runs_before_its_first_unfused_reader_only_once_its_inputs_are_there():
    assert _run_position(last=10, ready=3, before_first_read=5) == 5
    assert _run_position(last=10, ready=8, before_first_read=5) == 10
    assert _run_position(last=10, ready=3, before_first_read=11) == 10


def _backward_of_attention(y, tangent):
    """One head of six queries of eight attending to themselves, and the three gradients
    of its backward, an op with three results."""
    q = y.view(1, 1, 6, 8)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, False)
    grad_out = tangent.view(1, 1, 6, 8)
    attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    return tuple(attention_backward(grad_out, q, q, q, out, lse, 0.0, False))


def _attention_backward_position(chunk: ChunkGraphs) -> int:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    return _position(chunk, chunk.backward.graph, op)


def test_an_op_with_several_results_writes_them_all_where_it_runs():
    """The three gradients are written by the kernel, beside its inputs, not where
    the graph takes each result out of the tuple."""
    chunk = _chunk(backward_fn=_backward_of_attention, tangent_shape=(6, 8))
    costs = estimate_costs(chunk, PROFILE)
    at = _attention_backward_position(chunk)
    assert costs.allocated[at] == 3 * 192
    assert costs.allocated[at + 1 : at + 4] == (0, 0, 0)  # the three getitems


def test_an_attention_backward_holds_its_accumulators_while_it_runs(monkeypatch):
    """Priced as the CUDA kernels are: float32 copies of the query's gradient and a
    float32 statistic per query row, allocated and freed at the kernel."""
    name = "_scaled_dot_product_flash_attention_for_cpu_backward"
    chunk = _chunk(backward_fn=_backward_of_attention, tangent_shape=(6, 8))
    at = _attention_backward_position(chunk)
    without = estimate_costs(chunk, PROFILE)
    monkeypatch.setitem(ATTENTION_BACKWARD_ACCUMULATORS, name, 2)
    costs = estimate_costs(chunk, PROFILE)
    accumulators = 4 * (2 * 48 + 6)
    assert costs.allocated[at] - without.allocated[at] == accumulators
    assert costs.freed[at] - without.freed[at] == accumulators
    assert peak_bytes(costs, ()) == peak_bytes(without, ()) + accumulators


@pytest.mark.parametrize("name", sorted(ATTENTION_BACKWARD_ACCUMULATORS))
def test_each_attention_backward_priced_is_an_op_taking_the_query_second(name):
    """Read by name, so a torch that renamed one would leave it unpriced."""
    schema = getattr(torch.ops.aten, name).default._schema
    assert schema.arguments[1].name == "query"


def _backward_sin_and_cos(y, tangent):
    return y.sin() * tangent, y.cos() * tangent  # one kernel, two results, both reading y


def test_a_backward_kernel_with_two_results_writes_neither_into_the_saved_value_both_read():
    """Backward reads a saved value through the input that receives it: its readers
    there, not forward's, decide whether a kernel may write into it."""
    chunk = _chunk(backward_fn=_backward_sin_and_cos)
    costs = estimate_costs(chunk, PROFILE)
    backward_starts = len(chunk.forward.graph.nodes)
    assert sum(costs.allocated[backward_starts:]) == 4 + 2 * 192  # the tangent, both results


@pytest.mark.parametrize("forward_fn", [_forward_transposing, _forward_to_int])
def test_no_kernel_writes_into_an_input_read_out_of_order_or_of_another_dtype(forward_fn):
    chunk = _chunk(forward_fn)
    costs = estimate_costs(chunk, PROFILE)
    (writer,) = (
        n
        for n in chunk.forward.graph.nodes
        if n.target in (torch.ops.aten.mul.Tensor, torch.ops.prims.convert_element_type.default)
    )
    at = list(chunk.forward.graph.nodes).index(writer)
    assert (costs.allocated[at], costs.freed[at]) == (192, 192)


def _backward_from_tangent(y, tangent):
    return tangent * 2, y.sum()


def test_no_kernel_writes_into_a_tangent():
    """Backward's tangents are the caller's tensors; only the saved values are donated."""
    chunk = _chunk(backward_fn=_backward_from_tangent, tangent_shape=(6, 8))
    costs = estimate_costs(chunk, PROFILE)
    mul = _position(chunk, chunk.backward.graph, torch.ops.aten.mul.Tensor)
    assert (costs.allocated[mul], costs.freed[mul]) == (192, 192)


def test_the_host_issues_one_kernel_per_value_written_to_memory():
    # forward: x, w, mm, relu, sum, output; relu fuses into sum
    costs = estimate_costs(_chunk(), PROFILE)
    assert costs.forward_launches == (0, 0, 1, 0, 1, 0)
    # backward: y, tangent, mul, output
    assert costs.backward_launches == (0, 0, 1, 0)
    assert costs.launches == 3


def test_a_kernel_takes_the_device_no_less_than_the_floor_of_one():
    """forward: x, w, mm, relu, sum, output; relu fuses into sum's kernel, and what the
    two leave short of the floor is counted where the kernel is issued."""
    unfloored = estimate_costs(_chunk(), PROFILE).forward_seconds
    floored = estimate_costs(
        _chunk(), dataclasses.replace(PROFILE, kernel_floor_seconds=10.0)
    ).forward_seconds
    assert unfloored[2] == pytest.approx(0.384)  # 384 FLOPs at 1e3 FLOP/s
    assert floored[2] == pytest.approx(10.0)
    assert floored[3] == unfloored[3] > 0, "relu is in sum's kernel, issued at sum"
    assert floored[3] + floored[4] == pytest.approx(10.0)
    assert floored[:2] + floored[5:] == (0.0, 0.0, 0.0), "placeholders and output"
    below = dataclasses.replace(PROFILE, kernel_floor_seconds=0.1)
    assert estimate_costs(_chunk(), below).forward_seconds[2] == unfloored[2], "longer"


def _launched(fn, *shapes, tracing_mode: str = "fake") -> list[str]:
    """The nodes where the host issues a kernel, in ``fn``'s graph."""
    graph = make_fx(fn, tracing_mode=tracing_mode)(*(torch.randn(s) for s in shapes)).graph
    nodes = list(graph.nodes)
    return [n.name for n, launches in zip(nodes, kernel_launches(nodes), strict=True) if launches]


def _rms_norm(x, w):
    rstd = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    return torch.mm(x * rstd, w), rstd  # rstd is kept for backward


def test_a_normalization_writes_its_statistics_and_its_output_in_one_kernel():
    # rstd and the normalized x are both written (mm and the output read them); one kernel
    assert _launched(_rms_norm, (6, 4), (4, 4)) == ["rsqrt", "mm"]


def _residual(x, w):
    h = x + 1
    return h + torch.mm(h, w)


def test_values_with_a_matrix_product_between_them_are_two_kernels():
    # the second add reads the first's value and the product of it: it must wait for mm
    assert _launched(_residual, (4, 4), (4, 4)) == ["add", "mm", "add_1"]


def _two_gradients(g, a, b):
    g = torch.mm(g, a)
    return torch.mm(g * b, a), torch.mm(g * b.sigmoid(), a)


def test_values_of_one_size_computed_from_one_written_value_share_a_kernel():
    # both products read mm's result and are as large: one kernel writes both
    assert _launched(_two_gradients, (4, 4), (4, 4), (4, 4)) == ["mm", "mul", "mm_1", "mm_2"]


def _gated_unit(x, w, g):
    gate, up = torch.mm(x, w), torch.mm(x, w.t())
    h = gate.sigmoid() * up  # the product, read by a weight gradient
    dh = torch.mm(torch.mm(g, w), w)  # two products on, h not among their inputs
    return torch.mm(h, w), torch.mm(dh * up, w), torch.mm(dh * gate.sigmoid(), w)


def test_values_read_from_one_written_value_share_a_kernel_past_products_they_do_not_wait_on():
    # h and both of dh's products read up and are as large: one kernel writes all three,
    # as Inductor fuses a gated unit's product with its gradients
    assert _launched(_gated_unit, (4, 4), (4, 4), (4, 4)) == [
        "mm",
        "mm_1",
        "mul",
        "mm_2",
        "mm_3",
        "mm_4",
        "mm_5",
        "mm_6",
    ]


def _gated_unit_waiting_on_its_product(x, w, g):
    gate, up = torch.mm(x, w), torch.mm(x, w.t())
    h = gate.sigmoid() * up
    dh = torch.mm(h, w) + g  # waits on a product of h
    return torch.mm(dh * up, w)


def test_a_value_waiting_on_a_product_of_another_is_not_fused_with_it():
    assert _launched(_gated_unit_waiting_on_its_product, (4, 4), (4, 4), (4, 4)) == [
        "mm",
        "mm_1",
        "mul",
        "mm_2",
        "mul_1",
        "mm_3",
    ]


def _backward_gated(y, tangent):
    gate, up = torch.mm(y.t(), y), torch.mm(y.t(), y.cos())  # 8x8 each
    h = gate.sigmoid() * up
    dh = torch.mm(torch.mm(gate, up), up)
    return torch.mm(h, gate) + torch.mm(dh * up, dh * gate.sigmoid()) * tangent


def test_a_kernels_values_are_written_where_it_runs_after_the_products_it_waits_on():
    """h is fused with dh's two products: all three are written once dh is there, and
    before the product that reads h (``mm_4``), which comes before the last of them."""
    chunk = _chunk(backward_fn=_backward_gated)
    costs = estimate_costs(chunk, PROFILE)
    offset = len(chunk.forward.graph.nodes)
    at = {n.name: offset + i for i, n in enumerate(chunk.backward.graph.nodes)}
    assert costs.allocated[at["mul"]] == costs.allocated[at["mul_2"]] == 0
    # dh, and the kernel's three values: none is written in place, as two of them read
    # each input the kernel reads last (up and dh), and mm_2, which mm_3 reads last
    # where the kernel runs, is not one the kernel reads
    assert costs.allocated[at["mm_3"]] == 8 * 8 * 4 + 3 * 8 * 8 * 4


def _gradient_and_sums(g, w):
    d = torch.mm(g, w) * 2
    return torch.mm(d, w), d.sum(0), d.sum(1)


def test_a_sum_over_rows_is_a_kernel_of_its_own_and_a_sum_within_each_row_is_not():
    # d (6x4) and its sum within each row share a loop; the sum over rows (a bias
    # gradient's) runs in a kernel of its own, as Inductor's code does
    assert _launched(_gradient_and_sums, (6, 4), (4, 4)) == ["mm", "mul", "mm_1", "sum_1"]


def _inputs_two_ways(x, w):
    return torch.mm(x * 2, w), torch.mm(x + 1, w)


def test_values_of_one_size_computed_from_one_input_share_a_kernel():
    assert _launched(_inputs_two_ways, (4, 6), (6, 6)) == ["mul", "mm", "mm_1"]


def _broadcast(x, w, y):
    r = torch.mm(x, w).relu()
    return torch.mm(r, w), r.unsqueeze(-1) * y


def test_a_value_and_its_broadcast_are_two_kernels():
    assert _launched(_broadcast, (4, 6), (6, 6), (4, 6, 8)) == ["mm", "relu", "mm_1", "mul"]


def _rotary(q, w):
    half = q.shape[-1] // 2
    rotated = torch.cat([-q[:, half:], q[:, :half]], dim=-1)
    return torch.mm(q + rotated, w)


def test_concatenations_and_copies_fuse_as_pointwise_ops():
    assert _launched(_rotary, (4, 4), (4, 4)) == ["add", "mm"]


@pytest.mark.parametrize(
    ("fn", "shapes"),
    [
        (_rms_norm, [(6, 4), (4, 4)]),
        (_two_gradients, [(6, 4), (4, 4), (6, 4)]),
        (_gradient_and_sums, [(6, 4), (4, 4)]),
        (_rotary, [(4, 6), (6, 6)]),  # its sizes are computed on the host: not kernels
    ],
)
def test_symbolic_sizes_count_the_kernels_static_sizes_count(fn, shapes):
    static = _launched(fn, *shapes)
    assert _launched(fn, *shapes, tracing_mode="symbolic") == static


def test_host_costs_are_zero_or_more_seconds():
    assert BUILT_IN["cpu"].kernel_launch_seconds == 0
    assert BUILT_IN["h200"].offload_host_seconds > 0
    with pytest.raises(ValueError, match="reload_host_seconds must be a number of seconds >= 0"):
        dataclasses.replace(PROFILE, reload_host_seconds=-1e-6)


def test_built_in_profiles_are_positive_and_cpu_copies_do_not_overlap():
    assert not BUILT_IN["cpu"].copies_overlap_compute
    assert all(p.copies_overlap_compute for name, p in BUILT_IN.items() if name != "cpu")
    with pytest.raises(ValueError, match="device_to_host must be positive"):
        dataclasses.replace(PROFILE, device_to_host=0.0)


def test_under_cuda_graphs_copies_overlap_no_compute_and_kernels_cost_the_host_nothing():
    h200 = BUILT_IN["h200"]
    captured = h200.under_cuda_graphs()
    assert captured.name == "h200 under CUDA graphs"
    assert not captured.copies_overlap_compute and captured.kernel_launch_seconds == 0
    assert captured.offload_host_seconds == h200.offload_host_seconds > 0  # ops outside graphs
    assert captured.under_cuda_graphs() is captured
    assert BUILT_IN["cpu"].under_cuda_graphs() is BUILT_IN["cpu"]
    assert dataclasses.replace(captured, name="h200") == dataclasses.replace(
        h200, copies_overlap_compute=False, kernel_launch_seconds=0.0
    )


def test_matrix_rate_depends_on_dtype():
    h200 = BUILT_IN["h200"]
    assert h200.matrix_rate(torch.bfloat16) > h200.matrix_rate(torch.float32)


def _forward_two_products(x, w):
    a, b = torch.mm(x, w), torch.mm(x, 2 * w)
    return a.sum() + b.sum(), a, b


def _backward_summing_late(a, b, tangent):
    total = a + b  # fuses into the sum below, after a matrix product
    scale = torch.bmm(tangent.view(1, 1, 1), tangent.view(1, 1, 1))
    return (torch.bmm(total.sum().view(1, 1, 1), scale),)


def test_a_fused_value_keeps_what_it_is_computed_from_until_its_reader():
    # backward: mm, mm_1, tangent, add, view, view, bmm, sum, view, bmm, output
    chunk = _chunk(_forward_two_products, _backward_summing_late, num_saved=2)
    costs = estimate_costs(chunk, PROFILE)
    add = _node(chunk.backward.graph, torch.ops.aten.add.Tensor)
    total_sum = _node(chunk.backward.graph, torch.ops.aten.sum.default)
    backward = list(chunk.backward.graph.nodes)
    assert not materializes(add)
    assert costs.freed[costs.num_forward + backward.index(add)] == 0
    assert costs.freed[costs.num_forward + backward.index(total_sum)] == 2 * 6 * 8 * 4


def _cross_entropy(logits, target):
    return torch.nn.functional.cross_entropy(logits.float(), target)


def test_a_cross_entropy_never_writes_its_log_softmax():
    """Inductor lowers the gather of the picked log-probabilities as a pointwise read,
    so the fp32 log-softmax, as large as the logits, is computed inside that kernel."""
    from torch._inductor.decomposition import select_decomp_table

    logits, target = torch.randn(8, 32, dtype=torch.bfloat16), torch.randint(0, 32, (8,))
    graph = make_fx(_cross_entropy, select_decomp_table(), tracing_mode="fake")(logits, target)
    (gather,) = graph.graph.find_nodes(op="call_function", target=torch.ops.aten.gather.default)
    log_softmax = gather.args[0]
    assert tuple(log_softmax.meta["val"].shape) == (8, 32)
    assert not materializes(gather)
    assert not materializes(log_softmax)


def test_constants_and_pads_fuse_into_their_readers():
    def fill_and_pad(x, w):
        return (torch.full((6, 8), 2.0) * torch.mm(x, w)).sum(), torch.nn.functional.pad(x, (1, 1))

    forward = make_fx(fill_and_pad, tracing_mode="fake")(torch.randn(6, 4), torch.randn(4, 8))
    assert not materializes(_node(forward.graph, torch.ops.aten.full.default))
    assert materializes(_node(forward.graph, torch.ops.aten.constant_pad_nd.default)), (
        "an output of the graph is written"
    )
