"""Backward runs each kernel that frees more memory than it writes as early as it can."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import offload_pass
from offload_pass.order import free_memory_early
from tests import models

TOKENS, WIDTH = 256, 64


def _traced(backward, *shapes: tuple[int, ...]) -> torch.fx.GraphModule:
    return make_fx(backward, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def _matmul_order(gm: torch.fx.GraphModule) -> list[str]:
    """Each matrix product, named by the inputs it reads."""
    found = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.mm.default:
            names = [a.name for a in node.all_input_nodes]
            roots = [n.split("_")[0] for n in names]
            found.append("@".join(roots))
    return found


def _weight_and_input_gradient(weight, saved, grad):
    """One linear layer's backward in autograd's order: input gradient, then the weight
    gradient, the last reader of the saved input; the bias gradient reads ``grad`` last."""
    input_grad = grad @ weight
    weight_grad = grad.t() @ saved
    return input_grad, weight_grad, grad.sum(0)


def test_a_weight_gradient_that_frees_its_saved_input_runs_first():
    gm = _traced(
        _weight_and_input_gradient, (WIDTH, 4 * WIDTH), (TOKENS, 4 * WIDTH), (TOKENS, WIDTH)
    )
    assert _matmul_order(gm) == ["grad@weight", "t@saved"]
    free_memory_early(gm, resident=frozenset({"weight_1"}))
    assert _matmul_order(gm) == ["t@saved", "grad@weight"]
    args = [
        torch.randn(WIDTH, 4 * WIDTH),
        torch.randn(TOKENS, 4 * WIDTH),
        torch.randn(TOKENS, WIDTH),
    ]
    for got, want in zip(gm(*args), _weight_and_input_gradient(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_a_kernel_keeps_its_place_when_it_writes_more_than_it_frees():
    tokens = WIDTH // 2  # the weight gradient is larger than the saved input
    gm = _traced(
        _weight_and_input_gradient, (WIDTH, 4 * WIDTH), (tokens, 4 * WIDTH), (tokens, WIDTH)
    )
    free_memory_early(gm, resident=frozenset({"weight_1"}))
    assert _matmul_order(gm) == ["grad@weight", "t@saved"]


def test_a_resident_input_frees_nothing():
    gm = _traced(
        _weight_and_input_gradient, (WIDTH, 4 * WIDTH), (TOKENS, 4 * WIDTH), (TOKENS, WIDTH)
    )
    free_memory_early(gm, resident=frozenset({"weight_1", "saved_1"}))
    assert _matmul_order(gm) == ["grad@weight", "t@saved"]


def test_a_kernel_stays_after_the_other_kernels_reading_what_it_frees():
    def backward(weight, saved, grad):
        input_grad = grad @ weight
        column_sums = (saved * saved).sum(0)  # reads saved after the input gradient
        return input_grad, grad.t() @ saved, column_sums, grad.sum(0)

    gm = _traced(backward, (WIDTH, 4 * WIDTH), (TOKENS, 4 * WIDTH), (TOKENS, WIDTH))
    free_memory_early(gm, resident=frozenset({"weight_1"}))
    assert _matmul_order(gm) == ["grad@weight", "t@saved"]


def test_a_kernel_does_not_cross_a_side_effect():
    def backward(weight, saved, grad):
        first = grad @ weight
        torch._assert_async(torch.tensor(True), "in order")
        second = grad @ weight
        return first, second, grad.t() @ saved, grad.sum(0)

    gm = _traced(backward, (WIDTH, 4 * WIDTH), (TOKENS, 4 * WIDTH), (TOKENS, WIDTH))
    free_memory_early(gm, resident=frozenset({"weight_1"}))
    assert _matmul_order(gm) == ["grad@weight", "t@saved", "grad@weight"]


class _MLPLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = models.MLP(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).sum()


@pytest.mark.parametrize("tokens", [TOKENS, WIDTH // 2])
def test_the_backend_orders_backward_before_planning(tokens):
    model = _MLPLoss()
    plan = offload_pass.explain(model, torch.randn(1, tokens, WIDTH), fraction=0.0).plans[0]
    fc2_weight = model.mlp.fc2.weight.shape
    products = [n for n in plan.backward.graph.nodes if n.target is torch.ops.aten.mm.default]
    weight_grads = [n for n in products if n.meta["val"].shape == fc2_weight]
    input_grads = [n for n in products if n.meta["val"].shape == (tokens, 4 * WIDTH)]
    (fc2_weight_grad,), (fc2_input_grad,) = weight_grads, input_grads
    index = list(plan.backward.graph.nodes).index
    runs_first = index(fc2_weight_grad) < index(fc2_input_grad)
    assert runs_first == (tokens == TOKENS)


def test_inductors_backward_code_runs_the_weight_gradient_first():
    """With transfers in backward, Inductor's own reordering is off, and its code keeps
    the graph's order: the weight gradient that reads the saved GELU output for the last
    time comes before the input gradient, which reads the weight."""
    torch.manual_seed(0)
    model = torch.compile(_MLPLoss(), backend=offload_pass.backend(fraction=1.0, min_bytes=0))
    _, (_, backward_code) = run_and_get_code(
        lambda: model(torch.randn(1, TOKENS, WIDTH)).backward()
    )
    products = [line for line in backward_code.splitlines() if "extern_kernels.mm(" in line]
    reads_a_weight = ["primals" in line for line in products]
    assert reads_a_weight == [False, True, False]


def _planned_peak(depth: int, fraction: float) -> tuple[int, int]:
    """(the peak predicted at ``fraction``, the stack's parameter bytes)."""
    torch.manual_seed(0)
    model = models.BlockStack(dim=256, heads=4, depth=depth)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    (plan,) = offload_pass.explain(
        _Loss(model), torch.randn(2, 512, 256), profile=models.H200_INSTANT_HOST, fraction=fraction
    ).plans
    return plan.prediction.peak_bytes, nbytes


class _Loss(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).pow(2).mean()


def test_with_everything_moved_the_floor_grows_with_depth_by_parameters_and_gradients_alone():
    """The floor is the parameters, the weight gradients and one block's working set: four
    blocks more add their parameters and gradients to it, and none of their activations."""
    (floor_2, params_2), (floor_6, params_6) = _planned_peak(2, 1.0), _planned_peak(6, 1.0)
    (stock_2, _), (stock_6, _) = _planned_peak(2, 0.0), _planned_peak(6, 0.0)
    added_state = 2 * (params_6 - params_2)
    added_activations = (stock_6 - stock_2) - added_state
    assert added_activations > added_state  # what the floor must not grow by
    assert abs((floor_6 - floor_2) - added_state) <= 0.01 * added_activations, (
        floor_6 - floor_2,
        added_state,
    )
