"""One test per version-dependent path of offload_pass._compat."""

from __future__ import annotations

import operator
import types
import warnings

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from offload_pass import _compat
from tests import models


def test_flexible_layout_tag_when_torch_has_it():
    assert _compat.flexible_layout_tags() == (torch.Tag.flexible_layout,)


def test_no_layout_tag_on_a_torch_without_flexible_layout():
    assert _compat.flexible_layout_tags(types.SimpleNamespace()) == ()


def test_every_transfer_op_takes_its_inputs_in_any_layout():
    from offload_pass import ops

    assert all(torch.Tag.flexible_layout in op.tags for op in ops.TRANSFERS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_current_stream_is_torchs_current_stream():
    side = torch.cuda.Stream()
    assert _compat.current_stream(0) == torch.cuda.default_stream(0)
    with torch.cuda.stream(side):
        assert _compat.current_stream(0) == side == torch.cuda.current_stream(0)
    assert _compat.current_stream(0) == torch.cuda.current_stream(0)


def test_cudagraph_unsafe_tag_when_torch_has_it():
    assert _compat.cudagraph_unsafe_tags() == (torch.Tag.cudagraph_unsafe,)


def test_no_cudagraph_tag_on_a_torch_without_it():
    assert _compat.cudagraph_unsafe_tags(types.SimpleNamespace()) == ()


def test_every_transfer_op_stays_out_of_cuda_graphs():
    from offload_pass import ops

    assert all(torch.Tag.cudagraph_unsafe in op.tags for op in ops.TRANSFERS)


def test_module_paths_in_both_source_spellings():
    assert _compat.split_source_path("L['self'].blocks.0.attn") == ("L['self']", "blocks.0.attn")
    assert _compat.split_source_path("L['self'].blocks[0].attn") == ("L['self']", "blocks.0.attn")
    assert _compat.split_source_path("L['fn']._modules['blocks']._modules['1']") == (
        "L['fn']",
        "blocks.1",
    )
    assert _compat.split_source_path("L['fn']") == ("L['fn']", "")


def test_concrete_int_reads_symbolic_hints():
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(7, source=ConstantSource("n")), hint=7)
    assert _compat.concrete_int(backed) == 7
    assert _compat.concrete_int(env.create_unbacked_symint()) is None
    assert _compat.concrete_int(5) == 5


def test_no_root_modules_outside_dynamo():
    assert _compat.root_modules_being_compiled() == {}


def test_fusible_tags_when_torch_has_both():
    assert _compat.fusible_tags() == (torch.Tag.pointwise, torch.Tag.reduction)


def test_fusible_tags_on_a_torch_without_the_reduction_tag():
    older = types.SimpleNamespace(pointwise="pointwise")
    assert _compat.fusible_tags(older) == ("pointwise",)


def test_flop_count_uses_torch_formulas_and_covers_cpu_attention():
    from torch.fx.experimental.proxy_tensor import make_fx

    def attend(q, a, b):
        return torch.mm(q[0, 0], a), torch.nn.functional.scaled_dot_product_attention(q, q, q)

    q = torch.randn(2, 4, 8, 16)
    graph = make_fx(attend, tracing_mode="fake")(q, torch.randn(16, 8), torch.randn(1)).graph
    counts = {str(n.target): _compat.flop_count(n) for n in graph.nodes if n.op == "call_function"}
    assert counts["aten.mm.default"] == 2 * 8 * 16 * 8
    attention = [c for name, c in counts.items() if "scaled_dot_product" in name]
    assert attention and max(attention) == 4 * 2 * 4 * 8 * 8 * 16  # q k^T and p v


_CPU_ATTENTION = (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
)


def test_cpu_attention_formulas_added_to_a_registry_without_them():
    from torch.utils import flop_counter

    older = {k: v for k, v in flop_counter.flop_registry.items() if k not in _CPU_ATTENTION}
    formulas = _compat._flop_formulas(older)
    assert formulas[_CPU_ATTENTION[0]] is flop_counter.sdpa_flop
    assert formulas[_CPU_ATTENTION[1]] is flop_counter.sdpa_backward_flop
    assert torch.ops.aten.mm in formulas


def test_cpu_attention_formulas_of_the_registry_are_kept():
    def own(*args, **kwargs):
        return 1

    formulas = _compat._flop_formulas(dict.fromkeys(_CPU_ATTENTION, own))
    assert {op: formulas[op] for op in _CPU_ATTENTION} == dict.fromkeys(_CPU_ATTENTION, own)


def _grouped_query_attention() -> torch.fx.Node:
    """The attention node of a traced grouped-query attention: 4 query heads, 2 key/value."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    q, kv = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    graph = make_fx(attend, tracing_mode="fake")(q, kv, kv).graph
    (node,) = (n for n in graph.nodes if "scaled_dot_product" in str(n.target))
    return node


def test_grouped_query_attention_is_counted_with_the_query_heads():
    assert _compat.flop_count(_grouped_query_attention()) == 4 * 2 * 4 * 8 * 8 * 16


def test_attention_formulas_broadcast_heads_where_torch_counts_equal_heads_only():
    from torch.utils import flop_counter

    def equal_heads_only(query, key, value, *args, **kwargs):
        assert query.shape == key.shape == value.shape, "as torch before 2.13 asserts"
        return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)

    older = dict.fromkeys(_CPU_ATTENTION[:1], equal_heads_only)
    formulas = _compat._flop_formulas(older, grouped_heads=False)
    values = [a.meta["val"] for a in _grouped_query_attention().args]
    assert formulas[_CPU_ATTENTION[0]](*values) == 4 * 2 * 4 * 8 * 8 * 16


def _grouped_products() -> list[torch.fx.Node]:
    """The grouped products of a traced mixture-of-experts projection and its gradients:
    24 tokens among 3 experts, 16 features in, 8 out."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def project(tokens, experts, offsets, grad):
        out = torch._grouped_mm(tokens, experts, offs=offsets)
        return torch.autograd.grad(out, (tokens, experts), grad)

    tokens = torch.randn(24, 16, dtype=torch.bfloat16, requires_grad=True)
    experts = torch.randn(3, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([8, 16, 24], dtype=torch.int32)
    grad = torch.randn(24, 8, dtype=torch.bfloat16)
    graph = make_fx(project, tracing_mode="fake")(tokens, experts, offsets, grad).graph
    return [n for n in graph.nodes if n.target is torch.ops.aten._grouped_mm.default]


def test_grouped_products_are_counted_as_one_product_over_every_group():
    forward, *gradients = _grouped_products()
    assert len(gradients) == 2  # the tokens' gradient and the experts' (2-D by 2-D)
    assert [_compat.flop_count(n) for n in (forward, *gradients)] == [2 * 24 * 16 * 8] * 3


def test_grouped_product_with_columns_split_among_groups():
    a, b = torch.empty(3, 4, 16), torch.empty(16, 24)  # (G, M, K) by (K, N) -> (M, N)
    assert _compat.grouped_mm_flops(a, b) == 2 * 4 * 16 * 24


def test_grouped_product_formula_of_the_registry_is_kept():
    def own(*args, **kwargs):
        return 1

    formulas = _compat._flop_formulas({torch.ops.aten._grouped_mm: own})
    assert formulas[torch.ops.aten._grouped_mm] is own


def test_grouped_heads_support_is_probed_from_torch_formula():
    def equal_heads_only(query_shape, key_shape, value_shape):
        assert query_shape == key_shape
        return 1

    assert not _compat._counts_grouped_heads(equal_heads_only)
    assert _compat._counts_grouped_heads(lambda *shapes: 1)


def test_log_name_registers_with_torch_logging():
    from torch._logging._internal import log_registry

    _compat.register_log_name("offload_pass")
    assert log_registry.log_alias_to_log_qnames["offload_pass"] == ["offload_pass"]


def test_inductor_decompositions_are_available():
    table = _compat.inductor_decompositions()
    assert torch.ops.aten.native_layer_norm.default in table


def _record_setting(monkeypatch, module, name, read):
    seen = []

    def record(*args, **kwargs):
        seen.append(read())
        return "compiled"

    monkeypatch.setattr(module, name, record)
    return seen


def _joint() -> torch.fx.GraphModule:
    return torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())


def _partitioner_replacing_the_graph(replaces: bool, seen: list[bool]):
    """A min-cut partitioner recording its common subexpression setting, whose pass
    replaces the joint's graph by a copy (torch's) or leaves it."""
    from torch._functorch import config

    def partition(joint, joint_inputs, **kwargs):
        seen.append(config.cse)
        if config.cse and replaces:
            joint.graph = torch.fx.Graph()
        return "compiled"

    return partition


def test_a_joint_partitioned_again_is_not_deduplicated_again(monkeypatch):
    seen: list[bool] = []
    partition = _partitioner_replacing_the_graph(replaces=True, seen=seen)
    monkeypatch.setattr(_compat, "min_cut_rematerialization_partition", partition)
    joint, other = _joint(), _joint()
    for graph in (joint, joint, other, joint):
        _compat.stock_partition(graph, [], 1.0)
    assert seen == [True, False, True, False]


def test_a_joint_whose_graph_the_partitioner_keeps_is_deduplicated_each_time(monkeypatch):
    seen: list[bool] = []
    partition = _partitioner_replacing_the_graph(replaces=False, seen=seen)
    monkeypatch.setattr(_compat, "min_cut_rematerialization_partition", partition)
    joint = _joint()
    _compat.stock_partition(joint, [], 1.0)
    _compat.stock_partition(joint, [], 1.0)
    assert seen == [True, True]


def test_stock_partition_runs_under_the_recompute_budget(monkeypatch):
    from torch._functorch import config

    seen = _record_setting(
        monkeypatch,
        _compat,
        "min_cut_rematerialization_partition",
        lambda: config.activation_memory_budget,
    )
    _compat.stock_partition(_joint(), [], 0.25)
    with config.patch(activation_memory_budget=0.6):
        _compat.stock_partition(_joint(), [], None)
    assert seen == [0.25, 0.6]


def _record_estimator(monkeypatch) -> list[object]:
    """The partitioner's runtime estimator at each call of the min-cut partitioner."""
    from torch._functorch import config

    return _record_setting(
        monkeypatch,
        _compat,
        "min_cut_rematerialization_partition",
        lambda: config.activation_memory_budget_runtime_estimator,
    )


def test_stock_partition_prices_recomputation_by_the_seconds_given(monkeypatch):
    from torch._functorch import config

    seen = _record_estimator(monkeypatch)
    _compat.stock_partition(_joint(), [], 0.5, recompute_seconds=lambda node: 0.25)
    _compat.stock_partition(_joint(), [], 0.5)
    estimator, default = seen
    assert estimator("a node") == 0.25 and estimator.uuid() is None
    assert default == config.activation_memory_budget_runtime_estimator


def test_a_torch_without_runtime_estimators_prices_recomputation_by_flops(monkeypatch):
    from torch._inductor import custom_graph_pass

    monkeypatch.delattr(custom_graph_pass, "CustomRuntimeEstimator", raising=False)
    assert _compat.runtime_estimator(lambda node: 0.25) is None
    seen = _record_estimator(monkeypatch)
    _compat.stock_partition(_joint(), [], 0.5, recompute_seconds=lambda node: 0.25)
    assert seen == ["flops"]


def test_reordering_and_buffer_reuse_are_off_only_in_graphs_with_transfers(monkeypatch):
    from torch._inductor import compile_fx, config

    seen = _record_setting(
        monkeypatch,
        compile_fx,
        "compile_fx_inner",
        lambda: (config.reorder_for_peak_memory, config.allow_buffer_reuse),
    )
    with config.patch(reorder_for_peak_memory=True, allow_buffer_reuse=True):
        assert _compat.inductor_graph_compiler(lambda graph: True, None)(None, []) == "compiled"
        assert _compat.inductor_graph_compiler(lambda graph: False, None)(None, []) == "compiled"
    assert seen == [(False, False), (True, True)]


def _scheduler_node(name: str, reads: tuple[str, ...] = (), op: object = None):
    """A stand-in for one of Inductor's scheduler nodes: the buffer it writes (its name),
    the buffers it reads, and the op it calls."""
    return types.SimpleNamespace(
        name=name,
        node=types.SimpleNamespace(op_overload=op),
        get_buffer_names=lambda: [name],
        unmet_dependencies=[types.SimpleNamespace(name=read) for read in reads],
    )


def test_each_reload_moves_to_right_after_what_it_reads_in_its_own_order():
    reload = object()
    nodes = [
        _scheduler_node("first", op=reload),  # reads only backward's inputs
        _scheduler_node("token"),
        _scheduler_node("pulled_ahead", ("token",)),
        _scheduler_node("planned_after", ("token",), reload),
        _scheduler_node("other_token"),
        _scheduler_node("reads_nothing", (), reload),  # stays behind the reload before it
        _scheduler_node("late", ("other_token",), reload),
    ]
    placed = _compat.reloads_issued_where_placed(reload, None, nodes)
    assert [n.name for n in placed] == [
        "first",
        "token",
        "planned_after",
        "reads_nothing",
        "pulled_ahead",
        "other_token",
        "late",
    ]


def test_a_scheduler_pass_already_set_runs_first_and_alone_where_nothing_moves(monkeypatch):
    from torch._inductor import compile_fx, config

    seen = _record_setting(
        monkeypatch, compile_fx, "compile_fx_inner", lambda: config._post_fusion_custom_pass
    )

    def users_pass(nodes):
        return [*nodes, _scheduler_node("added by the user's pass", ("b",))]

    reload = object()
    with config.patch(_post_fusion_custom_pass=users_pass):
        _compat.inductor_graph_compiler(lambda graph: True, reload)(None, [])
        _compat.inductor_graph_compiler(lambda graph: False, reload)(None, [])
    with_transfers, without = seen
    assert without is users_pass
    nodes = [_scheduler_node("a"), _scheduler_node("b", ("a",)), _scheduler_node("r", (), reload)]
    assert [n.name for n in with_transfers(nodes)] == ["r", "a", "b", "added by the user's pass"]


def _inductor_settings(cudagraphs: bool, **settings: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(triton=types.SimpleNamespace(cudagraphs=cudagraphs), **settings)


def test_no_cuda_graph_caveat_without_cuda_graphs():
    assert _compat.cuda_graph_caveat(_inductor_settings(False, graph_partition=True)) is None


def test_cuda_graph_caveat_on_a_torch_without_graph_partitioning():
    caveat = _compat.cuda_graph_caveat(_inductor_settings(True))
    assert "not captured" in caveat and "graph_partition" in caveat


def test_cuda_graph_caveat_with_graph_partitioning_says_copies_do_not_overlap():
    caveat = _compat.cuda_graph_caveat(_inductor_settings(True, graph_partition=True))
    assert "partitions" in caveat and "do not overlap" in caveat


def test_captures_around_transfers_only_with_cuda_graphs_and_graph_partitioning():
    assert _compat.captures_around_transfers(_inductor_settings(True, graph_partition=True))
    assert not _compat.captures_around_transfers(_inductor_settings(True))  # no such setting
    assert not _compat.captures_around_transfers(_inductor_settings(True, graph_partition=False))
    assert not _compat.captures_around_transfers(_inductor_settings(False, graph_partition=True))


def test_the_compile_in_progress_captures_around_transfers_under_its_settings():
    from torch._inductor import config

    with config.patch({"triton.cudagraphs": False}):
        assert not _compat.inductor_captures_around_transfers()
    if hasattr(config, "graph_partition"):
        with config.patch({"triton.cudagraphs": True, "graph_partition": True}):
            assert _compat.inductor_captures_around_transfers()


def test_graphs_with_transfers_warn_under_cuda_graphs(monkeypatch):
    from torch._inductor import compile_fx, config

    monkeypatch.setattr(compile_fx, "compile_fx_inner", lambda graph, inputs, **kw: "compiled")
    with config.patch({"triton.cudagraphs": True}):
        with pytest.warns(UserWarning, match="offload_pass: .*CUDA graphs"):
            _compat.inductor_graph_compiler(lambda graph: True, None)(None, [])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _compat.inductor_graph_compiler(lambda graph: False, None)(None, [])


def test_inductor_config_of_a_mode_and_options():
    config = _compat.inductor_config("max-autotune-no-cudagraphs", None)
    assert config["max_autotune"] is True
    assert _compat.inductor_config(None, {"epilogue_fusion": False}) == {"epilogue_fusion": False}
    assert _compat.inductor_config(None, None) == {}


def test_no_frame_is_being_compiled_outside_dynamo():
    assert _compat.frame_code_being_compiled() is None


def test_backend_names_and_compiled_modules_are_recognised():
    assert {"inductor", "offload"} <= set(_compat.backend_names())
    module = torch.nn.Linear(2, 2)
    assert not _compat.is_compiled_module(module)
    assert _compat.is_compiled_module(torch.compile(module))


def test_view_ops_are_told_from_ops_that_write_or_copy():
    aten = torch.ops.aten
    assert _compat.is_aten_op(aten.view.default) and not _compat.is_aten_op(len)
    assert _compat.is_view_op(aten.view.default)
    assert _compat.is_view_op(aten.transpose.int)
    assert not _compat.is_view_op(aten.add_.Tensor)  # writes its input
    assert not _compat.is_view_op(aten.clone.default)
    assert _compat.is_view_op(aten.unbind.int)  # a list of views of its input
    assert not _compat.is_view_op(aten.var_mean.correction)  # two new tensors
    assert not _compat.is_view_op(operator.getitem)  # not an op overload


def test_outside_compile_makes_real_tensors_and_dispatches_as_in_training():
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensor

    seen = {}

    def partition(joint, inputs, **kwargs):
        seen["inside"] = _python_dispatcher_on()
        with _compat.outside_compile():
            seen["outside"] = _python_dispatcher_on()
            seen["real"] = not isinstance(torch.ones(1), FakeTensor)
        seen["after"] = _python_dispatcher_on()
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    backend = aot_autograd(fw_compiler=_boxed, bw_compiler=_boxed, partition_fn=partition)
    x = torch.randn(8, requires_grad=True)
    torch.compile(lambda x: (x.sin() * 2).sum(), backend=backend)(x).backward()
    assert seen == {"inside": True, "outside": False, "real": True, "after": True}


def _python_dispatcher_on() -> bool:
    return "PythonDispatcher" in repr(torch._C._dispatch_tls_local_include_set())


def _boxed(gm, example_inputs):
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)


def test_a_lazy_graph_module_writes_its_code_when_run():
    lazy = _compat.lazy_graph_module(torch.fx.symbolic_trace(lambda x: x + 1))
    (add,) = lazy.graph.find_nodes(op="call_function", target=operator.add)
    with lazy.graph.inserting_after(add):
        doubled = lazy.graph.call_function(operator.mul, (add, 2))
    add.replace_all_uses_with(doubled, delete_user_cb=lambda user: user is not doubled)
    lazy.recompile()
    assert torch.equal(lazy(torch.tensor([3.0])), torch.tensor([8.0]))
    assert "mul" in lazy.code


def _symbolic_fake(mode, *sizes: int) -> torch.Tensor:
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(sizes))
    return mode.from_tensor(torch.empty(*sizes), symbolic_context=dynamic)


def test_a_fake_built_from_meta_matches_the_fake_modes_own_factory_call():
    """Built inside the mode, as the partitioner runs inside the compile's fake mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(shape_env=ShapeEnv())
    like = _symbolic_fake(mode, 2, 3, 4)
    order = (2, 0, 1)
    metas = []

    def make_meta() -> torch.Tensor:
        metas.append(torch.empty_permuted(like.shape, order, dtype=torch.bfloat16, device="meta"))
        return metas[-1]

    with mode:
        built = _compat.fake_from_meta(mode, make_meta, torch.device("cuda", 1))
        made = torch.empty_permuted(like.shape, order, dtype=torch.bfloat16, device="cuda:1")
        assert (built * 2).shape == like.shape  # and it computes further in that mode
    assert [type(m) for m in metas] == [torch.Tensor]  # built outside the fake mode
    assert type(built) is type(made)
    assert built.fake_mode is mode
    assert (built.shape, built.stride(), built.dtype, built.device) == (
        made.shape,
        made.stride(),
        made.dtype,
        made.device,
    )


def _traced_with_meta(**meta) -> torch.fx.GraphModule:
    joint = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert not _compat.budget_annotated(joint)
    next(iter(joint.graph.nodes)).meta.update(meta)
    return joint


def test_a_per_node_recompute_budget_is_seen():
    assert _compat.budget_annotated(_traced_with_meta(memory_budget=0.5))


def test_a_region_recompute_budget_is_seen_where_torch_writes_one():
    traceback = pytest.importorskip("torch.fx.traceback")
    if not hasattr(traceback, "MEMORY_BUDGET_ANNOTATION_KEY"):
        pytest.skip("this torch has no region_activation_memory_budget (before 2.13)")
    custom = {traceback.MEMORY_BUDGET_ANNOTATION_KEY: 0.5}
    assert _compat.budget_annotated(_traced_with_meta(custom=custom))


def test_a_callback_queued_inside_a_backward_runs_once_it_is_done():
    events = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: _compat.at_backward_end(lambda: events.append("end")))
    x.register_hook(lambda grad: events.append("last node"))
    y.sum().backward()
    assert events == ["last node", "end"]


def test_in_backward_is_true_only_while_autograd_runs_a_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(_compat.in_backward()))
    assert not _compat.in_backward()
    y.sum().backward()
    assert seen == [True]


def test_the_partitioners_settings_are_read_from_its_config():
    from torch._functorch import config

    with config.patch(activation_memory_budget=0.3):
        assert _compat.activation_memory_budget() == 0.3
    assert _compat.partitions_sync_across_ranks() is False
    with config.patch(_sync_decision_cross_ranks=True):
        assert _compat.partitions_sync_across_ranks() is True


def test_a_symbolic_size_is_found_anywhere_in_a_view_ops_arguments():
    from torch._subclasses.fake_tensor import FakeTensorMode

    size = _symbolic_fake(FakeTensorMode(shape_env=ShapeEnv()), 2, 3, 4).shape[0]
    assert isinstance(size, torch.SymInt)
    for holding in [size, ([2, size], {}), ((), {"end": size}), ([[1, (size,)]], {})]:
        assert _compat._holds_symint(holding)
    for static in [([6, 4], {}), ((1, 1, 3), {"dim": 0}), ((), {}), (None, {"x": [2.0]})]:
        assert not _compat._holds_symint(static)


@pytest.mark.parametrize(
    ("target", "args"),
    [
        (torch.ops.aten.view.default, ([6, 4],)),
        (torch.ops.aten.permute.default, ([2, 0, 1],)),
        (torch.ops.aten.slice.Tensor, (1, 1, 3)),
        (torch.ops.aten.unbind.int, (0,)),
    ],
)
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_a_view_of_fakes_matches_the_fake_modes_own_view(target, args, symbolic):
    """The view shares its input's storage, as the mode's does. Built inside the mode and
    the Python dispatcher, as the rewrite runs inside the compile's."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(shape_env=ShapeEnv())
    base = _symbolic_fake(mode, 2, 3, 4) if symbolic else mode.from_tensor(torch.empty(2, 3, 4))
    if target is torch.ops.aten.view.default:
        args = ([base.shape[0] * base.shape[1], base.shape[2]],)
    with mode, enable_python_dispatcher():
        expected = target(base, *args)
        built = _compat.view_of_fakes(target, (base, *args), {})
    expected_views = expected if isinstance(expected, (list, tuple)) else [expected]
    built_views = built if isinstance(built, (list, tuple)) else [built]
    assert len(built_views) == len(expected_views)
    for view, made in zip(built_views, expected_views, strict=True):
        assert type(view) is type(made)
        assert view.fake_mode is mode
        assert view.untyped_storage()._cdata == base.untyped_storage()._cdata
        assert (view.shape, view.stride(), view.dtype, view.device) == (
            made.shape,
            made.stride(),
            made.dtype,
            made.device,
        )
        assert view.storage_offset() == made.storage_offset()


@pytest.mark.parametrize(
    ("dtype", "device", "user"),
    [
        (torch.float32, "cuda", torch.ops.aten.add.Tensor),  # a pointwise use: split
        (torch.bfloat16, "cuda", torch.ops.aten.add.Tensor),  # half precision: kept whole
        (torch.float32, "cpu", torch.ops.aten.add.Tensor),  # not a GPU
        (torch.float32, "cuda", torch.ops.aten.mul.Tensor),
        (torch.float32, "cuda", None),  # a graph output is not a pointwise use
    ],
)
def test_a_bias_add_is_split_where_inductors_own_pattern_splits_it(dtype, device, user):
    """Checked against Inductor's post-grad patterns of the torch installed."""
    from torch._inductor.fx_passes.post_grad import pass_patterns
    from torch._inductor.virtualized import V

    gm, mode = models.biased_product_graph(dtype, device, user)
    (product,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)
    predicted = _compat.inductor_splits_bias_add(product)
    with V.set_fake_mode(mode):
        for patterns in pass_patterns:
            patterns.apply(gm.graph)
    split = not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)
    assert predicted == split
    assert predicted == (dtype == torch.float32 and device == "cuda" and user is not None)


def test_an_addmm_user_other_than_pointwise_keeps_the_product_whole():
    gm, _ = models.biased_product_graph(torch.float32, "cuda", torch.ops.aten.add.Tensor)
    (product,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)
    assert _compat.inductor_splits_bias_add(product)
    with gm.graph.inserting_after(product):
        gm.graph.call_function(torch.ops.aten.sum.default, (product,))  # a reduction
    assert not _compat.inductor_splits_bias_add(product)


def test_a_bias_add_is_kept_whole_where_inductors_check_cannot_be_asked(monkeypatch):
    """A torch whose check reads what this one's match does not hold."""
    from torch._inductor.fx_passes import post_grad

    gm, _ = models.biased_product_graph(torch.float32, "cuda", torch.ops.aten.add.Tensor)
    (product,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)
    assert _compat.inductor_splits_bias_add(product)

    def reads_more(match):
        return match.nodes

    monkeypatch.setattr(post_grad, "should_prefer_unfused_addmm", reads_more)
    assert not _compat.inductor_splits_bias_add(product)


def test_an_op_is_lowered_with_aligned_outputs_once():
    from torch._inductor import lowering

    from offload_pass import ops

    _compat.lower_with_aligned_outputs(ops.RELOAD_WAIT)
    lowered = lowering.lowerings[ops.RELOAD_WAIT]
    _compat.lower_with_aligned_outputs(ops.RELOAD_WAIT)
    assert lowering.lowerings[ops.RELOAD_WAIT] is lowered
    assert ops.RELOAD_WAIT in lowering.needs_realized_inputs  # as Inductor's own fallback


def test_full_collections_are_deferred_by_dynamos_own_deferral_where_torch_has_one(monkeypatch):
    import contextlib

    entered = []

    @contextlib.contextmanager
    def deferred_full_gc():
        entered.append(True)
        yield

    monkeypatch.setattr(torch._dynamo.utils, "deferred_full_gc", deferred_full_gc, raising=False)
    with _compat.full_collections_deferred():
        assert entered == [True]


def test_full_collections_are_deferred_by_the_pass_on_a_torch_without_dynamos(monkeypatch):
    import gc

    monkeypatch.delattr(torch._dynamo.utils, "deferred_full_gc", raising=False)
    before = gc.get_threshold()
    try:
        gc.set_threshold(before[0], before[1], 10)
        with _compat.full_collections_deferred():
            assert gc.get_threshold()[2] == _compat.GEN2_THRESHOLD_WHILE_COMPILING
            with _compat.full_collections_deferred():
                pass
            assert gc.get_threshold()[2] == _compat.GEN2_THRESHOLD_WHILE_COMPILING
        assert gc.get_threshold()[2] == 10
        gc.set_threshold(before[0], before[1], 5000)  # a caller's higher threshold is kept
        with _compat.full_collections_deferred():
            assert gc.get_threshold()[2] == 5000
        assert gc.get_threshold()[2] == 5000
    finally:
        gc.set_threshold(*before)


def test_the_pass_runs_with_full_collections_deferred(monkeypatch):
    import gc

    import offload_pass
    from offload_pass import partition

    seen = []
    plan_jointly = partition.plan_jointly

    def recording(*args, **kwargs):
        seen.append(gc.get_threshold()[2])
        return plan_jointly(*args, **kwargs)

    monkeypatch.setattr(partition, "plan_jointly", recording)
    threshold = gc.get_threshold()
    model, x = models.MLP(), torch.randn(4, 64, requires_grad=True)
    torch.compile(model, backend=offload_pass.backend(fraction=1.0, compiler="eager"))(x)
    torch.compiler.reset()
    assert seen and all(t >= _compat.GEN2_THRESHOLD_WHILE_COMPILING for t in seen)
    assert gc.get_threshold() == threshold


def _wrapped_products() -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """A traced product, and the same product under each random-state wrapper as the
    partitioner writes it for an op it computes again in backward (without a value of
    its own)."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(torch.mm, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 2)).graph
    product = next(n for n in graph.nodes if n.target is torch.ops.aten.mm.default)
    with graph.inserting_after(product):
        saved = graph.call_function(run_and_save_rng_state, (product.target, *product.args))
        state = graph.call_function(operator.getitem, (saved, 0))
        again = graph.call_function(run_with_rng_state, (state, product.target, *product.args))
    return product, saved, again


def test_an_op_under_a_random_state_wrapper_is_the_op_computed():
    product, saved, again = _wrapped_products()
    for wrapped in (saved, again):
        op = _compat.computed_op(wrapped)
        assert op.target is torch.ops.aten.mm.default
        assert op.args == tuple(product.args)
        assert _compat.flop_count(wrapped) == _compat.flop_count(product) == 2 * 4 * 8 * 2
    assert _compat.computed_op(product).value is product.meta["val"]


def test_the_partitioner_policies_mark_regions_and_are_lifted():
    from torch.utils.checkpoint import CheckpointPolicy

    joint = torch.fx.symbolic_trace(models.MLP())
    first, second, *_ = (n for n in joint.graph.nodes if n.op == "call_module")
    with _compat.partitioner_policies(joint, frozenset({second.name}), {first.name: 3}):
        assert first.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
        assert first.meta["ac_graph_id"] == 3
        assert second.meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert not any("recompute" in n.meta or "ac_graph_id" in n.meta for n in joint.graph.nodes)
