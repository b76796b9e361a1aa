"""The host's price measured on a chunk's first steps, and ``auto`` planned again at it."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch

import offload_pass
from offload_pass import host_clock
from offload_pass.profiles import BUILT_IN, UNMEASURED, HostScale
from tests import models
from tests.conftest import train_step

SLOWER = 400.0
FAST_HOST = dataclasses.replace(
    BUILT_IN["h200"].with_host_measured(HostScale(1 / SLOWER, 1 / SLOWER)),
    name="h200, a host 400x as fast",
)
"""The H200's rates with a host so fast that ``auto`` moves activations of a small stack;
on the H200's own host (``SLOWER`` times as slow) the same stack is the host's and
``auto`` moves nothing (test_inspection)."""
STEPS_TO_MEASURE = host_clock.WARMUP_STEPS + host_clock.TIMED_CALLS


def _stack() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return models.BlockStack(dim=256, heads=4, depth=4), torch.randn(2, 512, 256)


@pytest.fixture
def timed_on_cpu(monkeypatch):
    """Time the host on the CPU as on CUDA, and report a host ``SLOWER`` times as slow
    as the plan's profile: on the CPU a forward's wall time is its compute."""
    monkeypatch.setattr(host_clock, "is_timed", lambda plan: True)
    monkeypatch.setattr(host_clock, "host_scale", lambda plan, times: HostScale(SLOWER, SLOWER))


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_auto_plans_again_at_the_host_price_measured_on_its_first_steps(timed_on_cpu, compiler):
    model, x = _stack()
    expected = train_step(model, x)
    backend = offload_pass.backend(profile=FAST_HOST, compiler=compiler)
    compiled = torch.compile(model, backend=backend)
    train_step(compiled, x)
    (first,) = backend.plans
    assert first.moved
    priced = r"400.00x and 400.00x what its plan priced.*compiled once more"
    with pytest.warns(UserWarning, match=priced):
        for _ in range(STEPS_TO_MEASURE - 1):
            train_step(compiled, x)
    assert backend.plans == [], "the plan made at the old price leaves with its code"

    loss, grads, x_grad = train_step(compiled, x)
    (again,) = backend.plans
    assert list(backend.host_scales.values()) == [HostScale(SLOWER, SLOWER)]
    assert again.profile.kernel_launch_seconds == pytest.approx(
        BUILT_IN["h200"].kernel_launch_seconds
    )
    assert again.profile.name == (
        "h200, a host 400x as fast, host measured at 400.00x in forward, 400.00x in backward"
    )
    assert not again.moved, "on the H200's own host the stack's step is the host's"
    torch.testing.assert_close(loss, expected[0])
    torch.testing.assert_close(x_grad, expected[2])
    for name, grad in expected[1].items():
        torch.testing.assert_close(grads[f"_orig_mod.{name}"], grad)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(host_clock.SETTLING_STEPS):
            train_step(compiled, x)
    assert backend.plans == [again], "measured once, compiled once more"


class _TwoStacks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = models.BlockStack(dim=256, heads=4, depth=2)
        self.second = models.BlockStack(dim=256, heads=4, depth=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def test_each_frame_is_planned_again_at_the_price_measured_on_it(monkeypatch):
    """A graph break: two chunks in two frames, each measured on its own."""
    monkeypatch.setattr(host_clock, "is_timed", lambda plan: True)
    measured = iter([HostScale(SLOWER, SLOWER), HostScale(2 * SLOWER, SLOWER)])
    monkeypatch.setattr(host_clock, "host_scale", lambda plan, times: next(measured))
    torch.manual_seed(0)
    model, x = _TwoStacks(), torch.randn(2, 512, 256)
    backend = offload_pass.backend(profile=FAST_HOST, compiler="eager")
    compiled = torch.compile(model, backend=backend)
    train_step(compiled, x)
    assert all(plan.moved for plan in backend.plans) and len(backend.plans) == 2
    with pytest.warns(UserWarning, match="compiled once more"):
        for _ in range(host_clock.SETTLING_STEPS):
            train_step(compiled, x)
    scales = sorted(backend.host_scales.values(), key=lambda scale: scale.forward)
    assert scales == [HostScale(SLOWER, SLOWER), HostScale(2 * SLOWER, SLOWER)]
    assert sorted(p.profile.name.split("measured at ")[-1] for p in backend.plans) == [
        "400.00x in forward, 400.00x in backward",
        "800.00x in forward, 400.00x in backward",
    ]


def test_a_plan_within_its_tolerance_at_the_measured_price_is_kept_so_priced(monkeypatch):
    """The stack's plan on a host twice as slow as planned in forward and three times in
    backward: its transfers still hide, and the plan kept predicts the step at the
    price measured."""
    monkeypatch.setattr(host_clock, "is_timed", lambda plan: True)
    monkeypatch.setattr(host_clock, "host_scale", lambda plan, times: HostScale(2.0, 3.0))
    model, x = _stack()
    backend = offload_pass.backend(profile=FAST_HOST, compiler="eager")
    compiled = torch.compile(model, backend=backend)
    train_step(compiled, x)
    (first,) = backend.plans
    for _ in range(STEPS_TO_MEASURE + 1):
        train_step(compiled, x)
    (plan,) = backend.plans
    assert plan.moved == first.moved
    assert list(backend.host_scales.values()) == [HostScale(2.0, 3.0)]
    assert plan.forward is first.forward, "compiled once"
    assert plan.profile.kernel_launch_seconds == 2 * FAST_HOST.kernel_launch_seconds
    assert plan.profile.backward_launch_seconds == pytest.approx(
        3 * FAST_HOST.kernel_launch_seconds
    )
    assert plan.prediction.forward_host_seconds == pytest.approx(
        2 * first.prediction.forward_host_seconds
    )
    assert plan.prediction.backward_host_seconds == pytest.approx(
        3 * first.prediction.backward_host_seconds
    )


def test_only_auto_measures_the_host(timed_on_cpu):
    model, x = _stack()
    backend = offload_pass.backend(fraction=1.0, profile=FAST_HOST, compiler="eager")
    compiled = torch.compile(model, backend=backend)
    for _ in range(STEPS_TO_MEASURE + 1):
        train_step(compiled, x)
    (plan,) = backend.plans
    assert plan.moved and not backend.host_scales
    assert plan.profile == FAST_HOST


def test_no_rank_measures_where_the_partitioner_agrees_its_choices_across_ranks(timed_on_cpu):
    from torch._functorch import config

    model, x = _stack()
    backend = offload_pass.backend(profile=FAST_HOST, compiler="eager")
    compiled = torch.compile(model, backend=backend)
    with config.patch(_sync_decision_cross_ranks=True):
        for _ in range(host_clock.SETTLING_STEPS):
            train_step(compiled, x)
    (plan,) = backend.plans
    assert plan.moved and plan.profile == FAST_HOST and not backend.host_scales


def test_a_cuda_plan_is_timed_where_its_host_issues_each_kernel_and_not_too_many(monkeypatch):
    model, x = _stack()
    (plan,) = offload_pass.explain(model, x, profile=FAST_HOST).plans
    monkeypatch.setattr(host_clock, "forward_device", lambda forward: torch.device("cuda"))
    assert host_clock.is_timed(plan)
    replayed = plan.profile.under_cuda_graphs()
    assert not host_clock.is_timed(
        dataclasses.replace(plan, costs=dataclasses.replace(plan.costs, profile=replayed))
    ), "under CUDA graphs no launch is priced"
    many = (1,) * host_clock.LAUNCH_QUEUE
    for phase in ("forward_launches", "backward_launches"):
        costs = dataclasses.replace(plan.costs, **{phase: many})
        assert not host_clock.is_timed(dataclasses.replace(plan, costs=costs)), (
            "a forward or backward that fills the launch queue waits for the device"
        )


def test_a_plan_on_the_cpu_is_not_timed():
    """On the CPU a forward call returns when its work is done: its time is not the
    host's to issue it."""
    model, x = _stack()
    (plan,) = offload_pass.explain(model, x, profile=FAST_HOST).plans
    assert plan.moved and not host_clock.is_timed(plan)


def test_a_plan_keeps_its_promise_on_its_own_host_and_not_on_a_slower_one():
    model, x = _stack()
    (plan,) = offload_pass.explain(model, x, profile=FAST_HOST).plans
    assert plan.moved
    assert plan.prediction.within(0.01)
    assert host_clock.priced_at(plan, HostScale(2.0, 2.0), 1).prediction.within(0.01)
    assert not host_clock.priced_at(plan, HostScale(SLOWER, SLOWER), 1).prediction.within(0.01)


@pytest.mark.parametrize(("phase", "op"), [("forward", "offload"), ("backward", "reload")])
def test_each_phases_host_time_counts_its_launches_and_transfer_ops(phase, op):
    model, x = _stack()
    (plan,) = offload_pass.explain(model, x, profile=FAST_HOST).plans
    profile = plan.profile
    launch = {"forward": profile.kernel_launch_seconds, "backward": profile.backward_launch_seconds}
    launches = sum(getattr(plan.costs, f"{phase}_launches")) * launch[phase]
    ops = getattr(plan, f"{op}_ops")
    assert ops >= 1
    assert getattr(plan.prediction, f"{phase}_host_seconds") - launches == pytest.approx(
        getattr(profile, f"{op}_host_seconds") * ops
        + getattr(profile, f"bucketed_{op}_host_seconds") * (len(plan.moved) - ops)
    )


def test_forward_and_backward_are_priced_at_their_own_measured_factors():
    model, x = _stack()
    (plan,) = offload_pass.explain(model, x, profile=FAST_HOST).plans
    predicted = plan.prediction
    times = host_clock.HostTimes(
        2 * predicted.forward_host_seconds, 3 * predicted.backward_host_seconds, 1
    )
    assert host_clock.host_scale(plan, times) == HostScale(2.0, 3.0)
    slower_backward = host_clock.priced_at(plan, HostScale(1.0, 3.0), 1).prediction
    assert slower_backward.forward_host_seconds == pytest.approx(predicted.forward_host_seconds)
    assert slower_backward.backward_host_seconds == pytest.approx(
        3 * predicted.backward_host_seconds
    )


def _reported(into: list) -> Callable[[host_clock.HostTimes], None]:
    return into.append


class _FakeTime:
    """A clock that moves only as a stand-in chunk's forward and backward take their
    next scripted durations."""

    def __init__(self, forward: list[float], backward: list[float]) -> None:
        self.now = 0.0
        self.forward = iter(forward)
        self.backward = iter(backward)

    def __call__(self) -> float:
        return self.now


class _Taking(torch.autograd.Function):
    """Stands in for a compiled chunk, whose outputs' node is a Python one: its forward
    and its backward each take the fake clock's next duration."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, fake: _FakeTime) -> torch.Tensor:
        fake.now += next(fake.forward)
        ctx.fake = fake
        return t * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fake.now += next(ctx.fake.backward)
        return grad * 2, None


def _timed_chunk(
    fake: _FakeTime, reported: list, drained: list, spans: host_clock.BackwardSpans
) -> host_clock.HostClock:
    return host_clock.HostClock(
        lambda t: (_Taking.apply(t, fake),),
        _reported(reported),
        lambda: drained.append(fake.now),
        spans,
        fake,
    )


def test_the_clock_reports_the_medians_of_the_calls_from_the_third_step_on():
    """Two calls a step (two blocks sharing one compiled chunk); a step begins where a
    backward has run since the call before. Each call's backward is timed from its node's
    start to the next one's, or the backward's end."""
    warm_up = [9.0] * 2 * host_clock.WARMUP_STEPS
    fake = _FakeTime(warm_up + [1.0, 5.0, 2.0, 4.0, 3.0, 7.0], warm_up + [2, 6, 4, 8, 5, 1])
    reported, drained = [], []
    timed = _timed_chunk(fake, reported, drained, host_clock.BackwardSpans(fake))
    for _ in range(host_clock.WARMUP_STEPS + 3):
        (first,) = timed(torch.ones(2, requires_grad=True))
        (second,) = timed(torch.ones(2, requires_grad=True))
        (first.sum() + second.sum()).backward()
    assert reported == [host_clock.HostTimes(3.0, 5.0, 2)], (
        "once: the medians of the five timed forwards and their backwards, two in flight"
    )
    assert len(drained) == 2 * 6, "the device drained before each timed call and backward"


def test_a_backward_span_ends_where_the_next_timed_chunks_begins():
    """Two chunks with uncompiled code between them: the later chunk's backward span
    holds that code's backward, which runs before the earlier chunk's."""
    warm_up = [0.0] * host_clock.WARMUP_STEPS
    steps = host_clock.WARMUP_STEPS + host_clock.TIMED_CALLS
    first_fake = _FakeTime(warm_up + [1.0] * 5, warm_up + [2.0] * 5)
    second_fake = _FakeTime(warm_up + [1.0] * 5, warm_up + [3.0] * 5)
    between = iter([0.0] * host_clock.WARMUP_STEPS + [10.0] * 5)

    def uncompiled_backward(grad: torch.Tensor) -> None:
        first_fake.now += next(between)

    reported: dict[str, list] = {"first": [], "second": []}
    spans = host_clock.BackwardSpans(lambda: first_fake.now + second_fake.now)
    first = _timed_chunk(first_fake, reported["first"], [], spans)
    second = _timed_chunk(second_fake, reported["second"], [], spans)
    for _ in range(steps):
        (hidden,) = first(torch.ones(2, requires_grad=True))
        hidden = hidden * 1
        hidden.register_hook(uncompiled_backward)
        (out,) = second(hidden)
        out.sum().backward()
    ((first_times,),) = [reported["first"]]
    ((second_times,),) = [reported["second"]]
    assert first_times.backward_seconds == 2.0
    assert second_times.backward_seconds == 13.0


class _Doubled(torch.autograd.Function):
    """Stands in for a compiled chunk, whose outputs' node is a Python one."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def _chunk(t: torch.Tensor) -> tuple[torch.Tensor]:
    return (_Doubled.apply(t),)


def _forwards_in_flight(step: Callable[[host_clock.HostClock], None]) -> int:
    """What the clock counts over as many steps as its measurement takes."""
    reported: list = []
    timed = host_clock.HostClock(
        _chunk, _reported(reported), lambda: None, host_clock.BackwardSpans()
    )
    while not reported:
        step(timed)
    (times,) = reported
    return times.forwards_in_flight


def _call(timed: host_clock.HostClock) -> torch.Tensor:
    (out,) = timed(torch.ones(2, requires_grad=True))
    return out


def test_the_clock_counts_the_forwards_run_before_a_backward():
    """Four blocks sharing one chunk hold four forwards; a backward after each forward
    (accumulating gradients) holds one. A call under no_grad holds none, nor does an
    evaluation with gradients on whose outputs are dropped."""

    def blocks(backward_each: bool) -> Callable[[host_clock.HostClock], None]:
        def step(timed: host_clock.HostClock) -> None:
            with torch.no_grad():
                _call(timed)
            for _ in range(3):
                _call(timed)
            outs = []
            for _ in range(4):
                outs.append(_call(timed))
                if backward_each:
                    outs.pop().sum().backward()
            if outs:
                sum(out.sum() for out in outs).backward()

        return step

    assert _forwards_in_flight(blocks(backward_each=False)) == 4
    assert _forwards_in_flight(blocks(backward_each=True)) == 1


def test_the_clock_counts_a_pipelines_warm_up_deeper_than_its_measurement():
    """One-forward-one-backward after eight warm-up forwards: the measurement ends
    before the warm-up's backwards have all run."""
    held: list[torch.Tensor] = []

    def step(timed: host_clock.HostClock) -> None:
        while len(held) < 8:
            held.append(_call(timed))
        held.pop(0).sum().backward()

    assert _forwards_in_flight(step) == 8


def test_a_call_inside_a_backward_is_neither_timed_nor_counted():
    """A checkpointed region's forward runs again inside backward."""
    reported = []
    timed = host_clock.HostClock(
        lambda t: (t * 2,), _reported(reported), lambda: None, host_clock.BackwardSpans()
    )
    for _ in range(host_clock.WARMUP_STEPS + host_clock.TIMED_CALLS - 1):
        (out,) = timed(torch.ones(2, requires_grad=True))
        out.register_hook(lambda grad: timed(torch.ones(2, requires_grad=True)) and None)
        out.sum().backward()
    assert reported == [], "one timed call short of the measurement"
    assert timed.samples is not None and len(timed.samples) == host_clock.TIMED_CALLS - 1
    assert timed.steps == host_clock.WARMUP_STEPS


def test_a_host_scale_must_be_positive():
    with pytest.raises(ValueError, match=r"HostScale.backward must be a positive number"):
        HostScale(1.0, 0.0)
    h200 = BUILT_IN["h200"]
    scaled = h200.with_host_measured(HostScale(2.0, 3.0))
    assert scaled.offload_host_seconds == 2 * h200.offload_host_seconds
    assert scaled.kernel_launch_seconds == 2 * h200.kernel_launch_seconds
    assert scaled.backward_launch_seconds == pytest.approx(3 * h200.kernel_launch_seconds)
    assert scaled.matmul_flops == h200.matmul_flops
    again = scaled.with_host_measured(HostScale(0.5, 0.5))
    assert again.backward_launch_seconds == pytest.approx(1.5 * h200.kernel_launch_seconds)


def test_blocks_compiled_each_on_their_own_are_planned_again_for_the_forwards_they_hold(
    monkeypatch,
):
    """Four blocks share one chunk, whose first steps run four forwards before a
    backward: its plan counted one, so the chunk is planned again for four."""
    monkeypatch.setattr(host_clock, "is_timed", lambda plan: True)
    monkeypatch.setattr(host_clock, "host_scale", lambda plan, times: UNMEASURED)
    torch.manual_seed(0)
    model, x = models.BlockStack(dim=256, heads=4, depth=4), torch.randn(2, 512, 256)
    expected = train_step(model, x)
    backend = offload_pass.backend(profile=FAST_HOST, compiler="eager")
    for block in model.blocks:
        block.compile(backend=backend)  # as compile_regions does, not telling the backend
    train_step(model, x)
    (first,) = backend.plans
    counted = "4 of its forwards ran before a backward, where its plan counted 1"
    with pytest.warns(UserWarning, match=counted) as warned:
        for _ in range(STEPS_TO_MEASURE - 1):
            train_step(model, x)
    assert "what its plan priced" not in str(warned[0].message), "the host kept its price"
    assert list(backend.forwards_in_flight.values()) == [4]

    loss, grads, x_grad = train_step(model, x)
    (again,) = backend.plans
    per_forward = first.prediction.baseline_peak_bytes - first.costs.resident_bytes
    assert again.prediction.baseline_peak_bytes > first.prediction.baseline_peak_bytes
    assert again.prediction.baseline_peak_bytes < 4 * per_forward + first.costs.resident_bytes
    torch.testing.assert_close(loss, expected[0])
    torch.testing.assert_close(x_grad, expected[2])
    for name, grad in expected[1].items():
        torch.testing.assert_close(grads[name], grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(host_clock.SETTLING_STEPS):
            train_step(model, x)
    assert backend.plans == [again], "counted once, compiled once more"
