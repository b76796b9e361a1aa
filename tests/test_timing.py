"""Kernel timing: which nodes are timed on the device, and how the cost model uses it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from offload_pass import device_cache, timing
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
    """Random values cannot stand for offsets or indices, so integer tensors keep a node
    on the rates."""
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
    assert timing.timer_for(None, cuda, ()) is not None
    assert timing.timer_for("calibrate", cuda, ()) is not None
    assert timing.timer_for("h200", cuda, ()) is None
    assert timing.timer_for(BUILT_IN["h200"], cuda, ()) is None
    assert timing.timer_for(None, CPU, ()) is None


def test_kernels_are_timed_on_real_tensors_inside_a_compile_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = make_fx(torch.mm, tracing_mode="fake")(torch.randn(5, 3), torch.randn(3, 7))
    mm = _node(graph.graph, torch.ops.aten.mm.default)
    with FakeTensorMode():
        assert timing.measured_seconds(mm, CPU) is not None  # a fake run raises nothing


def test_an_expanded_operand_is_timed():
    def biased(x, w, b):
        return torch.addmm(b.expand(4, 6), x, w)

    graph = make_fx(biased, tracing_mode="fake")(
        torch.randn(4, 5), torch.randn(5, 6), torch.randn(6)
    )
    addmm = _node(graph.graph, torch.ops.aten.addmm.default)
    assert addmm.args[0].meta["val"].stride() == (0, 1)
    assert timing.measured_seconds(addmm, CPU) is not None


def test_attention_random_state_does_not_keep_its_backward_from_being_timed():
    """Flash attention's backward reads its seed as a two-element integer tensor; that is
    random-number state, not work, so the node is described (and timed on CUDA)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    with FakeTensorMode():
        q = torch.empty(2, 4, 128, 64, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(2, 4, 128, device="cuda")
        seed = torch.empty(2, dtype=torch.uint64, device="cuda")
        offset = torch.empty((), dtype=torch.uint64, device="cuda")
    graph = torch.fx.Graph()
    inputs = {}
    for name, value in {"q": q, "lse": lse, "seed": seed, "offset": offset}.items():
        inputs[name] = graph.placeholder(name)
        inputs[name].meta["val"] = value
    q_, lse_ = inputs["q"], inputs["lse"]
    args = (q_, q_, q_, q_, q_, lse_, None, None, 128, 128, 0.0, True)
    node = graph.call_function(op, (*args, inputs["seed"], inputs["offset"]))
    described = timing._signature(timing._named_values(node))
    assert timing._TensorSpec((2,), (1,), torch.uint64, "cuda") in described[0]
    mask = torch.ones(2, 2, dtype=torch.bool)
    try:
        timing._signature(mask)
    except timing._Untimeable as why:
        assert "values decide the work" in str(why)
    else:
        raise AssertionError("a boolean mask was described by its shape alone")


def test_only_successful_timings_are_kept(monkeypatch):
    """A failure (out of memory while the graph compiles, say) is tried again next time."""
    graph = make_fx(torch.mm, tracing_mode="fake")(torch.randn(3, 2), torch.randn(2, 9))
    mm = _node(graph.graph, torch.ops.aten.mm.default)
    timed = timing._timed
    monkeypatch.setattr(timing, "_timed", lambda *args: None)
    assert timing.measured_seconds(mm, CPU) is None
    monkeypatch.setattr(timing, "_timed", timed)
    assert timing.measured_seconds(mm, CPU) is not None


@pytest.fixture
def new_process(monkeypatch, tmp_path):
    """Timing's state as a new process finds it, with the device cache in ``tmp_path``."""

    def start() -> None:
        monkeypatch.setattr(timing, "_kept_by_device", {})
        timing.sustained_slowdown.cache_clear()

    monkeypatch.setenv(device_cache.CACHE_DIR_VARIABLE, str(tmp_path))
    start()
    yield start
    timing.sustained_slowdown.cache_clear()


def _untimeable(*args):
    raise AssertionError("timed again, though a time was kept")


def test_a_kernel_time_is_kept_for_the_next_process(new_process, monkeypatch, tmp_path):
    graph = make_fx(torch.mm, tracing_mode="fake")(torch.randn(3, 5), torch.randn(5, 4))
    mm = _node(graph.graph, torch.ops.aten.mm.default)
    first = timing.measured_seconds(mm, CPU)
    (path,) = tmp_path.glob("*.json")
    assert "cpu" in path.name and torch.__version__ in path.name
    assert list(json.loads(path.read_text())[timing.KERNEL_SECONDS].values()) == [first]
    new_process()
    monkeypatch.setattr(timing, "_timed", _untimeable)
    assert timing.measured_seconds(mm, CPU) == first


def test_the_sustained_slowdown_is_kept_for_the_next_process(new_process, monkeypatch):
    monkeypatch.setattr(timing, "_measured_slowdown", lambda device: 1.25)
    assert timing.sustained_slowdown(CPU) == 1.25
    new_process()
    monkeypatch.setattr(timing, "_measured_slowdown", _untimeable)
    assert timing.sustained_slowdown(CPU) == 1.25


def _settled_at(slowdown: float):
    """A stand-in for the settled sequence's reading: ``slowdown``, each reading's
    kernels kept in the list returned."""
    settled = []

    def read(calls, alone_seconds, device):
        settled.append([c.key for c in calls])
        return slowdown

    return read, settled


def test_a_chunks_settled_slowdown_is_kept_for_the_next_process(new_process, monkeypatch):
    chunk = _chunk()
    nodes = [*chunk.forward.graph.nodes, *chunk.backward.graph.nodes]
    read, settled = _settled_at(1.25)
    monkeypatch.setattr(timing, "_sequence_slowdown", read)
    assert timing.settled_slowdown(nodes, CPU) == pytest.approx(1.25)
    (products,) = settled
    assert len(products) == sum(1 for n in nodes if n.target is torch.ops.aten.mm.default)
    new_process()
    monkeypatch.setattr(timing, "_sequence_slowdown", _untimeable)
    assert timing.settled_slowdown(nodes, CPU) == pytest.approx(1.25)


def test_each_set_of_kernels_settles_on_its_own(new_process, monkeypatch):
    """A chunk of other kernels draws other power: its clock is read again. The same
    kernels in another order (a backward the order stage moved) are not read again."""
    read, settled = _settled_at(1.1)
    monkeypatch.setattr(timing, "_sequence_slowdown", read)
    bmm = make_fx(torch.bmm, tracing_mode="fake")(torch.randn(2, 2, 3), torch.randn(2, 3, 2))
    chunk = _chunk()
    nodes = [*chunk.forward.graph.nodes, *chunk.backward.graph.nodes]
    timing.settled_slowdown(nodes, CPU)
    timing.settled_slowdown(list(bmm.graph.nodes), CPU)
    timing.settled_slowdown(nodes[::-1], CPU)
    assert len(settled) == 2 and settled[0] != settled[1]


def test_a_sequence_is_launch_bound_where_its_launch_outlasts_a_share_of_its_run():
    device_seconds = 1e-3
    share = timing.LAUNCH_BOUND_SHARE
    assert timing.launch_bound(1.01 * share * device_seconds, device_seconds)
    assert not timing.launch_bound(0.99 * share * device_seconds, device_seconds)


def test_a_chunk_without_timed_kernels_runs_at_the_clock_it_is_timed_at(monkeypatch):
    monkeypatch.setattr(timing, "_sequence_slowdown", _untimeable)
    relu = _node(_chunk().forward.graph, torch.ops.aten.relu.default)
    assert timing.settled_slowdown([relu], CPU) == 1.0


def test_a_sequence_that_cannot_settle_takes_the_reference_slowdown(new_process, monkeypatch):
    monkeypatch.setattr(timing, "_measured_slowdown", lambda device: 1.3)
    nodes = list(_chunk().forward.graph.nodes)
    assert timing.settled_slowdown(nodes, CPU) == 1.3  # the CPU has no settled clock
    assert not device_cache.numbers(CPU, timing.SETTLED_SLOWDOWN)


def test_timed_nodes_are_priced_at_the_settled_clock(new_process):
    mm = _node(_chunk().forward.graph, torch.ops.aten.mm.default)
    alone = timing.measured_seconds(mm, CPU)
    timer = timing.SettledTimer(CPU, slowdown=1.5)
    assert timer(mm) == pytest.approx(1.5 * alone)
    assert estimate_costs(_chunk(), PROFILE, timer).kernel_slowdown == 1.5


def test_a_slowdown_that_cannot_be_measured_is_one_and_not_kept(new_process, tmp_path):
    assert timing.sustained_slowdown(CPU) == 1.0  # the CPU has no settled clock to read
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("switch", ["empty directory", "inductor caches forced off"])
def test_caching_off_keeps_times_in_memory_only(switch, new_process, monkeypatch, tmp_path):
    forced_off = switch == "inductor caches forced off"
    if not forced_off:
        monkeypatch.setenv(device_cache.CACHE_DIR_VARIABLE, "")
    mm = _node(_chunk().forward.graph, torch.ops.aten.mm.default)
    with torch._inductor.config.patch(force_disable_caches=forced_off):
        assert device_cache.path_for(CPU) is None
        assert timing.measured_seconds(mm, CPU) is not None
    assert not list(tmp_path.iterdir())


def test_an_unreadable_cache_is_warned_about_and_timed_again(new_process, tmp_path):
    path = device_cache.path_for(CPU)
    path.write_text("{not json")
    mm = _node(_chunk().forward.graph, torch.ops.aten.mm.default)
    with pytest.warns(UserWarning, match="cannot read .* measuring again"):
        assert timing.measured_seconds(mm, CPU) is not None


def test_an_unwritable_cache_is_warned_about_once(new_process, monkeypatch, tmp_path):
    blocked = tmp_path / "a file where the directory should be"
    blocked.write_text("")
    monkeypatch.setenv(device_cache.CACHE_DIR_VARIABLE, str(blocked))
    graph = make_fx(torch.mm, tracing_mode="fake")(torch.randn(2, 3), torch.randn(3, 2))
    mm = _node(graph.graph, torch.ops.aten.mm.default)
    bmm = make_fx(torch.bmm, tracing_mode="fake")(torch.randn(2, 2, 3), torch.randn(2, 3, 2))
    with pytest.warns(UserWarning, match="cannot write .* keeping measurements in memory"):
        assert timing.measured_seconds(mm, CPU) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bmm_node = _node(bmm.graph, torch.ops.aten.bmm.default)
        assert timing.measured_seconds(bmm_node, CPU) is not None
    assert timing.measured_seconds(mm, CPU) is not None


def test_kept_entries_of_the_wrong_kind_are_measured_again(new_process):
    """A file another version wrote, or a hand edited: what is not a number is not used."""
    device_cache.path_for(CPU).write_text(
        json.dumps(
            {
                timing.KERNEL_SECONDS: ["not", "a", "mapping"],
                timing.SUSTAINED_SLOWDOWN: {timing.REFERENCE: "slow"},
            }
        )
    )
    mm = _node(_chunk().forward.graph, torch.ops.aten.mm.default)
    assert timing.measured_seconds(mm, CPU) is not None
    assert timing.sustained_slowdown(CPU) == 1.0
