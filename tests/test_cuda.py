"""Stream ordering, memory release and pinned-pool behaviour on a real CUDA device."""

from __future__ import annotations

import copy
import dataclasses
import gc
import time

import pytest
import torch

import offload_pass
from offload_pass import device_cache, host_clock, ops, runtime, timing
from offload_pass.joint import SearchSpace
from offload_pass.profiles import BUILT_IN, HostScale
from tests import models
from tests.conftest import every_block_checkpointed, total

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
STALL_MS = 200
CYCLES_PER_MS = 2_000_000  # about an H100/H200 clock; the tests check the stall took effect


def _stall(stream: torch.cuda.Stream, ms: int = STALL_MS) -> None:
    """Queue a busy-wait of about ``ms`` milliseconds on ``stream``."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(ms * CYCLES_PER_MS)


def _reload_after_stalled_offload() -> tuple[bool, bool]:
    """(the offload was still in flight when the reload was issued, reload == source),
    for a bucket of two tensors of different types and layouts.

    The reload takes the host buffers before their offload_wait, as no graph can: the
    copy streams' own ordering is what is checked."""
    a = torch.randn(64 * 2**20, device="cuda")  # 256 MiB, fresh values every call
    b = torch.randn(8, 2**20, device="cuda", dtype=torch.bfloat16).t()
    layouts = [0, 1, 0]
    # Pin the buffers with other values: a pinned block handed out again would otherwise
    # already hold a's, and a reload that did not wait would still read them.
    others = [torch.zeros_like(a), torch.zeros_like(b)]
    ops.offload_wait(ops.offload(others, layouts), others, layouts, [])
    torch.cuda.synchronize()  # so that pinning host memory does not outlast the stall
    _stall(runtime.copy_streams(a.device).device_to_host)
    ticket = ops.offload([a, b], layouts)
    hosts = runtime._pending_offloads[int(ticket)].buffers
    reloading = ops.reload(hosts[::-1], a.device, [])
    in_flight = not runtime.offload_done(hosts[0]).query()
    reloaded = ops.reload_wait(reloading, hosts[::-1], a.device)
    same = torch.equal(reloaded[1], a) and torch.equal(reloaded[0], b)
    ops.offload_wait(ticket, [a, b], layouts, [])
    torch.cuda.synchronize()
    return in_flight, same


def test_reload_waits_for_a_stalled_offload():
    in_flight, same = _reload_after_stalled_offload()
    assert in_flight, "the stall did not take effect"
    assert same


def test_without_the_event_wait_the_stalled_race_corrupts(monkeypatch):
    """The check above can fail: drop the reload's wait and it reads a half-filled buffer."""
    monkeypatch.setattr(runtime, "wait_for_offload", lambda stream, h: None)
    in_flight, same = _reload_after_stalled_offload()
    assert in_flight
    assert not same


def test_an_offload_into_another_layout_does_not_block_the_host():
    """The device tensor is row-major and the host buffer column-major (the layout
    backward was compiled for): the copy still runs on the copy stream, host free."""
    a = torch.randn(4096, 4096, device="cuda")
    layout = [1, 0]
    ops.offload_wait(ops.offload([a], layout), [a], layout, [])  # a pinned block to reuse
    torch.cuda.synchronize()
    _stall(runtime.copy_streams(a.device).device_to_host)
    start = time.perf_counter()
    ticket = ops.offload([a], layout)
    issued = time.perf_counter() - start
    (h,) = ops.offload_wait(ticket, [a], layout, [])
    torch.cuda.synchronize()
    assert issued < STALL_MS / 1e3 / 2, f"the host waited {issued * 1e3:.0f} ms for the copy"
    assert h.stride() == (1, 4096)
    assert torch.equal(h, a.cpu())


def _reload_dropped_before_its_wait() -> tuple[bool, torch.Tensor]:
    """A reload whose wait never runs (backward raised in between), then a fresh tensor
    of the same size from the compute stream: (the copy was still stalled when the fresh
    tensor was allocated, the fresh tensor once everything finished)."""
    h = torch.ones(64 * 2**20).pin_memory()  # 256 MiB
    copy_stream = runtime.copy_streams(torch.device("cuda")).host_to_device
    _stall(copy_stream)
    ticket = ops.reload([h], torch.device("cuda"), [])
    copied = torch.cuda.Event()
    copied.record(copy_stream)
    del ticket  # its finalizer drops the reload at once
    stalled = not copied.query()
    fresh = torch.zeros(64 * 2**20, device="cuda")
    torch.cuda.synchronize()
    return stalled, fresh


def test_an_unwaited_reload_keeps_its_buffer_until_the_copy_lands():
    stalled, fresh = _reload_dropped_before_its_wait()
    assert stalled, "the stall did not take effect"
    assert torch.count_nonzero(fresh) == 0


def test_without_record_stream_an_unwaited_reload_overwrites_a_new_tensor(monkeypatch):
    """The check above can fail: without the record, the allocator hands the buffer out
    while the copy still writes it."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    stalled, fresh = _reload_dropped_before_its_wait()
    assert runtime.counts().pending_reloads == 0, "the dropped reload was not released"
    assert stalled, "the stall did not take effect"
    assert torch.count_nonzero(fresh) > 0


def _released_then_reused() -> tuple[bool, bool]:
    """An offload released while its copy is stalled, its device tensor dropped, then a
    fresh tensor of the same size from the compute stream: (the copy was still stalled
    when the fresh tensor was made, the host buffer holds the released tensor's values)."""
    a = torch.randn(64 * 2**20, device="cuda")  # 256 MiB
    expected = a.cpu()
    layouts = [0]
    others = [torch.zeros_like(a)]
    ops.offload_wait(ops.offload(others, layouts), others, layouts, [])  # pinned, reused
    del others
    torch.cuda.synchronize()
    _stall(runtime.copy_streams(a.device).device_to_host)
    ticket = ops.offload([a], layouts)
    (h,) = ops.offload_release(ticket, [a], layouts, [])
    stalled = not runtime.offload_done(h).query()
    del a, ticket
    fresh = torch.zeros(64 * 2**20, device="cuda")
    torch.cuda.synchronize()
    del fresh
    return stalled, torch.equal(h, expected)


def test_a_released_tensor_is_reused_only_once_its_copy_has_read_it():
    stalled, same = _released_then_reused()
    assert stalled, "the stall did not take effect"
    assert same


def test_without_record_stream_a_released_tensor_is_overwritten_before_its_copy(monkeypatch):
    """The check above can fail: without the record, the allocator hands the released
    tensor's memory out while the copy has yet to read it."""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    stalled, same = _released_then_reused()
    assert stalled, "the stall did not take effect"
    assert not same


def test_gradients_exact_when_released_copies_are_stalled_under_the_next_forward():
    """Two microbatches' forwards, then both backwards, with a plan that releases a copy
    at forward's end; the device-to-host stream stalled through both forwards."""
    model = _blocks(depth=1)
    backend = offload_pass.backend(
        fraction=1.0, profile=models.H200_QUICK_COPIES, in_flight_microbatches=2
    )
    compiled = torch.compile(model, backend=backend)
    xs = [torch.randn(2, 512, 256, device="cuda") for _ in range(2)]

    def step(stalled: bool) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        inputs = [x.clone().requires_grad_() for x in xs]
        torch.cuda.synchronize()
        if stalled:
            _stall(runtime.copy_streams(xs[0].device).device_to_host)
        loss = sum(total(compiled(x)) for x in inputs)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return grads, [x.grad for x in inputs]

    expected_grads, expected_x_grads = step(stalled=False)
    assert any(t.released for t in backend.plans[0].planned.transfers)
    grads, x_grads = step(stalled=True)
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name
    assert all(torch.equal(a, b) for a, b in zip(x_grads, expected_x_grads, strict=True))


def _moved_from_a_stalled_callers_stream() -> tuple[bool, bool, bool]:
    """(the caller's stream stayed current through the ops, the host buffer holds what the
    caller's stream wrote, the reload does): a tensor written on a stalled stream of the
    caller's own, then offloaded and reloaded with that stream current."""
    caller = torch.cuda.Stream()
    a = torch.zeros(2**20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(STALL_MS * CYCLES_PER_MS)
        a.fill_(1.0)
        hosts = ops.offload_wait(ops.offload([a], [0]), [a], [0], [])
        reloaded = ops.reload_wait(ops.reload(hosts, a.device, []), hosts, a.device)
        still_current = torch.cuda.current_stream() == caller
    torch.cuda.synchronize()
    ones = torch.ones(2**20)
    return still_current, torch.equal(hosts[0], ones), torch.equal(reloaded[0].cpu(), ones)


def test_copies_wait_for_the_callers_own_stream_and_leave_it_current():
    assert _moved_from_a_stalled_callers_stream() == (True, True, True)


def test_copies_behind_the_default_stream_alone_miss_the_callers_writes(monkeypatch):
    """The check above can fail: copies queued behind the default stream run before the
    caller's stalled stream has written the tensor."""
    monkeypatch.setattr(runtime._compat, "current_stream", torch.cuda.default_stream)
    _, offloaded, _ = _moved_from_a_stalled_callers_stream()
    assert not offloaded


def _blocks(depth: int = 2, dim: int = 256, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.BlockStack(dim=dim, heads=heads, depth=depth).cuda()


def _step(model, x):
    x = x.clone().requires_grad_()
    total(model(x)).backward()
    module = getattr(model, "_orig_mod", model)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads, x.grad


def test_offloading_an_fp32_stack_leaves_every_bit_of_its_gradients_as_stock():
    """Stock Inductor's kernels, reading reloaded tensors: each bias add split as Inductor
    splits it, and each kernel reading a reload compiled for an aligned buffer."""
    model = _blocks()
    backend = offload_pass.backend(fraction=1.0, min_bytes=0)
    x = torch.randn(2, 128, 256, device="cuda")
    grads, x_grad = _step(torch.compile(model, backend=backend), x)
    expected_grads, expected_x_grad = _step(torch.compile(copy.deepcopy(model)), x)
    assert backend.plans[0].moved
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name
    assert torch.equal(x_grad, expected_x_grad)


@pytest.mark.parametrize("stalled", ["device_to_host", "host_to_device"])
def test_gradients_exact_with_a_stalled_copy_stream(stalled):
    model = _blocks()
    backend = offload_pass.backend(fraction=1.0, min_bytes=0)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 128, 256, device="cuda")
    expected_grads, expected_x_grad = _step(compiled, x)  # same kernels, no stall

    streams = runtime.copy_streams(x.device)
    xg = x.clone().requires_grad_()
    torch.cuda.synchronize()
    if stalled == "device_to_host":
        _stall(streams.device_to_host)
    loss = total(compiled(xg))
    if stalled == "host_to_device":
        _stall(streams.host_to_device)
    loss.backward()
    assert backend.plans[0].moved
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected_grads[name]), name
    assert torch.equal(xg.grad, expected_x_grad)


def _stalled_step_as_stock(model: torch.nn.Module, backend, x: torch.Tensor):
    """Compile ``model`` with ``backend``, step it once more with the copy to the host
    stalled, and check the gradients against the stock compile's, to rounding (the
    kernels computed again in backward are fused apart from the forward's); its plan."""
    compiled = torch.compile(model, backend=backend)
    _step(compiled, x)  # compiles
    torch.cuda.synchronize()
    _stall(runtime.copy_streams(x.device).device_to_host)
    grads, x_grad = _step(compiled, x)
    expected_grads, expected_x_grad = _step(torch.compile(copy.deepcopy(model)), x)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=name)
    torch.testing.assert_close(x_grad, expected_x_grad)
    (plan,) = backend.plans
    return plan


def test_checkpointed_blocks_with_their_inputs_moved_train_as_the_model(monkeypatch):
    """Blocks computed again in backward (their attention under the random-state wrapper
    the partitioner writes for it on CUDA), what they save moved, the copy to the host
    stalled: the gradients are the stock compile's."""
    every_block_checkpointed(monkeypatch)
    backend = offload_pass.backend(fraction=1.0, min_bytes=0, profile="h200")
    plan = _stalled_step_as_stock(
        _blocks(depth=4), backend, torch.randn(2, 128, 256, device="cuda")
    )
    assert plan.checkpointed_blocks and plan.moved
    names = {str(n.target) for n in plan.forward.graph.nodes}
    assert any("rng_state" in name for name in names), names


def test_values_recomputed_beside_moves_train_as_the_model(monkeypatch):
    """Saved values computed again in backward one by one, what the budget still needs
    moved, the copy to the host stalled: the gradients are the stock compile's. Copies
    priced at 1 GB/s make moving alone slow, so the search recomputes."""
    monkeypatch.setattr("offload_pass.partition.search_space", lambda *_: SearchSpace(values=True))
    slow_copies = models.copies_at(BUILT_IN["h200"], 1e9, "h200, copies at 1 GB/s")
    backend = offload_pass.backend(memory_budget=0.7, min_bytes=0, profile=slow_copies)
    plan = _stalled_step_as_stock(
        _blocks(depth=4), backend, torch.randn(8, 512, 256, device="cuda")
    )
    assert plan.recomputed_nodes and plan.moved


def test_auto_plans_again_where_the_host_measured_on_its_first_steps_is_too_slow():
    """A profile whose host is 400 times as fast as any has ``auto`` move activations of
    a small stack whose real step is the host's; the host's time measured on the first
    steps has the chunk planned again at that price, and the step trains as stock's."""
    model = _blocks(depth=4)
    fast_host = dataclasses.replace(
        BUILT_IN["h200"].with_host_measured(HostScale(1 / 400, 1 / 400)),
        name="h200, a host 400x as fast",
    )
    backend = offload_pass.backend(profile=fast_host)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 512, 256, device="cuda")
    _step(compiled, x)
    moved_first = len(backend.plans[0].moved)
    assert moved_first
    with pytest.warns(UserWarning, match="compiled once more"):
        for _ in range(host_clock.WARMUP_STEPS + host_clock.TIMED_CALLS - 1):
            _step(compiled, x)
    grads, x_grad = _step(compiled, x)
    (plan,) = backend.plans
    (scale,) = backend.host_scales.values()
    assert scale.forward > 1 and scale.backward > 1
    assert plan.profile.name == f"h200, a host 400x as fast, host measured at {scale}"
    assert len(plan.moved) < moved_first
    expected_grads, expected_x_grad = _step(torch.compile(copy.deepcopy(model)), x)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=name)
    torch.testing.assert_close(x_grad, expected_x_grad)


def _held_between_forward_and_backward(model, x) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = total(model(x.clone().requires_grad_()))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held


def test_offloaded_memory_is_released_between_forward_and_backward():
    dims = dict(depth=4, dim=1024, heads=8)
    x = torch.randn(2, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    baseline = torch.compile(_blocks(**dims).bfloat16(), backend=offload_pass.backend(fraction=0))
    backend = offload_pass.backend(fraction=1.0)
    offloaded = torch.compile(_blocks(**dims).bfloat16(), backend=backend)
    for _ in range(2):
        held_base = _held_between_forward_and_backward(baseline, x)
        held_offload = _held_between_forward_and_backward(offloaded, x)
    moved = backend.plans[0].bytes_moved
    assert moved > 0
    assert held_base - held_offload >= 0.9 * moved, (held_base, held_offload, moved)


def _step_peak_over_parameters(depth: int, fraction: float) -> tuple[int, int]:
    """(a training step's peak above what was allocated before it, the parameter bytes)."""
    model = _blocks(depth=depth, dim=1024, heads=8).bfloat16()
    compiled = torch.compile(model, backend=offload_pass.backend(fraction=fraction))
    # 4 x 1024 tokens: a block's activations (42 MiB per 2 x 1024 on the H100, run 142)
    # outweigh its weight gradients (24 MiB) several times
    x = torch.randn(4, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        total(compiled(x)).backward()
        torch.cuda.synchronize()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return torch.cuda.max_memory_allocated() - before, nbytes


def test_with_everything_moved_the_measured_floor_grows_by_gradients_alone():
    """Four blocks more add their weight gradients to the step's peak and, with every
    activation moved, next to none of their activations (``tests/test_order.py`` checks
    the same of the plan's prediction)."""
    (floor_2, params_2), (floor_6, params_6) = (
        _step_peak_over_parameters(2, 1.0),
        _step_peak_over_parameters(6, 1.0),
    )
    stock_2, _ = _step_peak_over_parameters(2, 0.0)
    stock_6, _ = _step_peak_over_parameters(6, 0.0)
    added_gradients = params_6 - params_2
    added_activations = (stock_6 - stock_2) - added_gradients
    assert added_activations > 2 * added_gradients, (added_activations, added_gradients)
    assert abs((floor_6 - floor_2) - added_gradients) <= 0.1 * added_activations, (
        floor_6 - floor_2,
        added_gradients,
        added_activations,
    )


def _host_allocations() -> int:
    stats = torch.cuda.host_memory_stats()
    return stats.get("num_host_alloc", stats.get("allocations.allocated", 0))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_no_pinned_allocation_after_warmup_and_flat_host_memory():
    model = torch.compile(_blocks(), backend=offload_pass.backend(fraction=1.0, min_bytes=0))
    x = torch.randn(2, 128, 256, device="cuda")
    for _ in range(2):
        _step(model, x)
    torch.cuda.synchronize()
    allocations = _host_allocations()
    rss = []
    for step in range(200):
        _step(model, x)
        if step in (19, 199):
            torch.cuda.synchronize()
            gc.collect()
            rss.append(_rss_bytes())
    assert _host_allocations() == allocations
    assert rss[1] - rss[0] < 16 * 2**20, rss
    assert offload_pass.counts().host_buffers == 0


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_interleaved_microbatches_on_gpu(fraction):
    """Each microbatch's backward gets its own forward's tensors, whatever the order."""
    model = _blocks(depth=3)
    sequential = copy.deepcopy(model)
    options = dict(fraction=fraction, min_bytes=0)
    batches = [torch.randn(2, 128, 256, device="cuda") for _ in range(2)]

    reference = torch.compile(sequential, backend=offload_pass.backend(**options))
    expected_x = []
    for x in batches:
        x = x.clone().requires_grad_()
        total(reference(x)).backward()
        expected_x.append(x.grad)

    compiled = torch.compile(model, backend=offload_pass.backend(**options))
    inputs = [x.clone().requires_grad_() for x in batches]
    losses = [total(compiled(x)) for x in inputs]
    losses[1].backward()
    losses[0].backward()
    for (name, p), q in zip(model.named_parameters(), sequential.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for x, expected in zip(inputs, expected_x, strict=True):
        assert torch.equal(x.grad, expected)


def test_profile_is_chosen_from_the_device_name():
    name = torch.cuda.get_device_name().lower()
    expected = next((key for key in ("h200", "h100", "a100") if key in name), None)
    if expected is None:
        pytest.skip(f"no built-in profile for {name}")
    backend = offload_pass.backend(fraction=0.0)
    _step(torch.compile(_blocks(), backend=backend), torch.randn(2, 128, 256, device="cuda"))
    assert backend.plans[0].profile.name == expected


def test_a_spin_keeps_the_stream_busy_while_the_host_queues_work():
    from offload_pass import _compat

    torch.cuda.synchronize()
    _compat.spin_device(torch.device("cuda"), 100 * CYCLES_PER_MS)
    queued = torch.cuda.Event()
    queued.record()
    assert not queued.query(), "the event ran before the spin ended"
    torch.cuda.synchronize()


def test_a_chunks_kernels_settle_at_a_clock_measured_on_them(monkeypatch, tmp_path):
    """The chunk's own products run back to back until the clock settles and are read;
    the reference product's slowdown does not stand in."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setenv(device_cache.CACHE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setattr(timing, "_kept_by_device", {})
    monkeypatch.setattr(timing, "sustained_slowdown", lambda device: pytest.fail("fell back"))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    graph = make_fx(lambda a, b: (a @ b).relu() @ b, tracing_mode="fake")(a, a)
    device = torch.device("cuda", torch.cuda.current_device())
    slowdown = timing.settled_slowdown(list(graph.graph.nodes), device)
    assert 0.8 < slowdown < 2.0
    assert list(device_cache.numbers(device, timing.SETTLED_SLOWDOWN).values()) == [slowdown]


def test_kernels_too_short_to_outrun_their_launch_take_the_reference_clock_and_keep_it(
    monkeypatch, tmp_path
):
    """Products of 16 x 16 finish before the host launches the next: the device idles
    between them, so their clock is not read; the reference stands in, kept for them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setenv(device_cache.CACHE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setattr(timing, "_kept_by_device", {})
    monkeypatch.setattr(timing, "sustained_slowdown", lambda device: 1.125)
    a = torch.randn(16, 16, device="cuda")
    graph = make_fx(lambda a: a @ a @ a @ a @ a, tracing_mode="fake")(a)
    device = torch.device("cuda", torch.cuda.current_device())
    assert timing.settled_slowdown(list(graph.graph.nodes), device) == 1.125
    assert list(device_cache.numbers(device, timing.SETTLED_SLOWDOWN).values()) == [1.125]


def test_calibration_inside_a_compile_measures_real_tensors(monkeypatch, tmp_path):
    from offload_pass.calibration import calibrate

    # measured here, inside the compile's fake mode: with nothing kept, on disk or not
    monkeypatch.setenv(device_cache.CACHE_DIR_VARIABLE, str(tmp_path))
    calibrate.cache_clear()
    backend = offload_pass.backend(profile="calibrate")
    _step(torch.compile(_blocks(), backend=backend), torch.randn(2, 128, 256, device="cuda"))
    profile = backend.plans[0].profile
    assert profile.name.startswith("calibrated ")
    assert profile.device_to_host > 1e9 and profile.offload_host_seconds > 0


def test_calibration_measures_this_device_near_its_built_in_profile():
    from offload_pass.calibration import calibrate
    from offload_pass.profiles import built_in_for_name

    measured = calibrate(torch.cuda.current_device())
    assert calibrate(torch.cuda.current_device()) is measured, "cached per process"
    built_in = built_in_for_name(torch.cuda.get_device_name())
    if built_in is None:
        pytest.skip("no built-in profile to compare with")
    measured_fields = ("matmul_flops", "memory_bandwidth", "device_to_host", "host_to_device")
    for field in (*measured_fields, "kernel_floor_seconds"):
        ratio = getattr(measured, field) / getattr(built_in, field)
        assert 0.5 < ratio < 2.0, (field, getattr(measured, field), getattr(built_in, field))
    # Host times depend on the host CPU, not the GPU: hosts of one machine kind have
    # measured them up to twice apart (docs/gpu-validation.md, runs 31 and 35).
    host = ("offload", "reload", "bucketed_offload", "bucketed_reload")
    for field in (f"{name}_host_seconds" for name in host):
        ratio = getattr(measured, field) / getattr(built_in, field)
        assert 0.25 < ratio < 4.0, (field, getattr(measured, field), getattr(built_in, field))


# the budget on the stock split, which moving meets (its search would checkpoint blocks)
@pytest.mark.parametrize(
    "options", [{}, {"memory_budget": 0.8, "recompute_budget": 1.0}], ids=["auto", "budget"]
)
def test_planner_modes_train_like_the_unoffloaded_model(options):
    """auto and memory_budget move activations of a float32 stack and match its gradients."""
    model = _blocks(depth=4, dim=1024, heads=8)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 512, 1024, device="cuda")
    backend = offload_pass.backend(**options)
    compiled = torch.compile(model, backend=backend)
    expected = torch.compile(reference, backend=offload_pass.backend(fraction=0.0))
    for net in (compiled, expected):
        total(net(x)).backward()
    assert backend.plans[0].moved, str(backend.plans[0])
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
