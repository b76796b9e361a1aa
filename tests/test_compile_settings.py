"""The backend under the torch.compile settings real training jobs use: sizes that change
from step to step, torch.compile's mode and options, compiled autograd."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch._dynamo import compiled_autograd

import offload_pass
from offload_pass import analysis
from tests import models
from tests.conftest import assert_same_step, compiled_pair, reference_backend, train_step

SEQUENCE_LENGTHS = (16, 24, 20)
BATCH_SIZES = (4, 4, 3)


def _symbolic(plan: offload_pass.Plan) -> bool:
    """Whether the plan's graphs were compiled with symbolic sizes."""
    return any(
        isinstance(n.meta.get("val"), torch.SymInt)
        for n in plan.forward.graph.find_nodes(op="placeholder")
    )


def _train_on_sizes(compiler, dynamic, inputs, **options) -> offload_pass.OffloadBackend:
    """Train on each input in turn, offloaded and not, and check every step's gradients."""
    torch.manual_seed(0)
    model = models.BlockStack()
    reference = copy.deepcopy(model)
    backend = offload_pass.backend(compiler=compiler, min_bytes=0, **options)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    expected = torch.compile(reference, backend=reference_backend(compiler), dynamic=dynamic)
    for step, x in enumerate(inputs):
        assert_same_step(train_step(compiled, x, seed=step), train_step(expected, x, seed=step))
    return backend


@pytest.mark.parametrize("dynamic", [None, True], ids=["dynamic_none", "dynamic_true"])
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize(
    "options",
    [{"fraction": 1.0}, {"profile": models.H200_INSTANT_HOST}],
    ids=["fraction_1", "auto_h200"],
)
def test_sequence_lengths_that_change_train_like_the_unoffloaded_model(compiler, dynamic, options):
    inputs = [torch.randn(2, length, 32) for length in SEQUENCE_LENGTHS]
    backend = _train_on_sizes(compiler, dynamic, inputs, **options)
    symbolic = [plan for plan in backend.plans if _symbolic(plan)]
    assert symbolic, "the sizes never became symbolic"
    for plan in symbolic:
        assert plan.moved, "nothing moves under symbolic sizes"
        assert not any(d.reason == analysis.NOT_REPLAYABLE for d in plan.decisions)
        if "fraction" in options:
            assert all(d.moved for d in plan.decisions if d.group.fixed_reason is None)


def test_a_smaller_last_batch_trains_like_the_unoffloaded_model():
    inputs = [torch.randn(size, 16, 32) for size in BATCH_SIZES]
    backend = _train_on_sizes("inductor", None, inputs, fraction=0.5)
    assert all(plan.moved for plan in backend.plans)


def test_shapes_the_guards_treat_as_equal_share_one_plan():
    inputs = [torch.randn(2, length, 32) for length in SEQUENCE_LENGTHS]
    backend = _train_on_sizes("eager", True, inputs, fraction=1.0)
    assert len(backend.plans) == 1


@pytest.mark.parametrize(
    "settings",
    [
        {"mode": "max-autotune-no-cudagraphs"},
        {"options": {"epilogue_fusion": False}},
    ],
    ids=["mode", "options"],
)
@pytest.mark.parametrize("by_name", [False, True], ids=["backend_object", "backend_name"])
def test_torch_compile_mode_and_options_reach_inductor(settings, by_name):
    torch.manual_seed(0)
    model = models.BlockStack()
    reference = copy.deepcopy(model)
    backend = offload_pass.default_backend if by_name else offload_pass.backend()
    plans_before = backend.plans
    compiled = torch.compile(model, backend="offload" if by_name else backend, **settings)
    expected = torch.compile(reference, **settings)
    x = torch.randn(2, 16, 32)
    assert_same_step(train_step(compiled, x), train_step(expected, x))
    assert [p for p in backend.plans if p not in plans_before], "no plan was made"


def test_an_unknown_inductor_option_is_named():
    compiled = torch.compile(
        models.MLP(), backend=offload_pass.backend(), options={"no_such_option": 1}
    )
    with pytest.raises(Exception, match="no_such_option"):
        compiled(torch.randn(8, 64))


def test_mode_with_the_eager_compiler_is_refused():
    compiled = torch.compile(
        models.MLP(), backend=offload_pass.backend(compiler="eager"), mode="max-autotune"
    )
    with pytest.raises(Exception, match="compiler='eager'"):
        compiled(torch.randn(8, 64))


@pytest.mark.parametrize("autograd_compiler", ["aot_eager", "inductor"])
def test_compiled_autograd_trains_like_the_unoffloaded_model(autograd_compiler):
    model, reference, backend = compiled_pair(models.BlockStack, "inductor", fraction=1.0)
    x = torch.randn(2, 16, 32)
    grads = []
    for net, module in ((model, model._orig_mod), (reference, reference._orig_mod)):
        loss = net(x).pow(2).mean()
        with compiled_autograd._enable(torch.compile(backend=autograd_compiler)):
            loss.backward()
        grads.append({n: p.grad for n, p in module.named_parameters()})
    assert backend.plans[0].moved
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


def test_under_cuda_graphs_auto_moves_nothing_and_moves_cost_their_whole_copy_time():
    # Inductor runs the transfers after the compute that does not read them
    # (_compat.cuda_graph_caveat): no copy can hide, so auto keeps every activation, and a
    # fraction's plan adds each copy's time to the step.
    from torch._inductor import config

    from offload_pass.profiles import BUILT_IN
    from offload_pass.report import why_nothing_moved

    if not getattr(config, "graph_partition", False):
        pytest.skip("this torch's Inductor does not partition graphs by default")
    x = torch.randn(4, 16, 32)
    plans = {}
    for fraction in (None, 1.0):
        torch.manual_seed(0)
        backend = offload_pass.backend(fraction=fraction, min_bytes=0, profile="h200")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the caveat, tested below
            train_step(
                torch.compile(models.BlockStack(), backend=backend, mode="reduce-overhead"), x
            )
        (plans[fraction],) = backend.plans
    auto, everything = plans[None], plans[1.0]
    assert auto.profile == everything.profile == BUILT_IN["h200"].under_cuda_graphs()
    assert not auto.moved and "overlap no compute" in why_nothing_moved(auto)
    assert everything.moved
    predicted = everything.prediction
    rates = everything.profile
    copies = sum(
        d.group.nbytes / rates.device_to_host + d.group.nbytes / rates.host_to_device
        for d in everything.moved
    )
    assert predicted.step_seconds >= predicted.baseline_seconds + copies
    torch.manual_seed(0)
    default_mode = offload_pass.backend(fraction=1.0, min_bytes=0, profile="h200")
    train_step(torch.compile(models.BlockStack(), backend=default_mode), x)
    assert default_mode.plans[0].profile == BUILT_IN["h200"]


def test_a_cuda_graph_mode_warns_about_graphs_with_transfers():
    torch.manual_seed(0)
    model = models.MLP()
    reference = copy.deepcopy(model)
    backend = offload_pass.backend(fraction=1.0, min_bytes=0)
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead")
    x = torch.randn(8, 64)
    with pytest.warns(UserWarning, match="offload_pass: .*CUDA graphs"):
        offloaded = train_step(compiled, x)
    assert backend.plans[0].moved
    assert_same_step(offloaded, train_step(torch.compile(reference), x))
