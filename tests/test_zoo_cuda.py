"""Zoo models trained on CUDA, where the copies run on side streams and Inductor lays out
convolutions as it likes: gradients as close to stock Inductor's as two stock compilers
are to each other, with activations moved in the static and the symbolic compile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_symbols

import offload_pass
from tests import zoo

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = {
    "resnet": zoo.Entry(zoo.ResNet, zoo.image_batch, zoo.classifier_loss),
    "resnet_channels_last": zoo.ZOO["resnet"],
    "mixtral": zoo.ZOO["mixtral"],
    "llama": zoo.ZOO["llama"],
    "vit": zoo.ZOO["vit"],
}
SETTINGS = {"fraction_1": {"fraction": 1.0}, "auto": {}}
STEPS = 3
FLOOR_ULPS = 4

Step = dict[str, torch.Tensor]


def _train(model: nn.Module, entry: zoo.Entry, backend: object) -> list[Step]:
    compiled = torch.compile(model, backend=backend)
    steps = []
    for k in range(STEPS):
        batch = {name: value.cuda() for name, value in entry.make_batch(k).items()}
        loss = entry.loss(compiled, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        steps.append({"loss": loss.detach(), **grads})
        model.zero_grad(set_to_none=True)
    torch.compiler.reset()
    return steps


def _largest_error(a: list[Step], b: list[Step]) -> list[Step]:
    return [{k: (x[k] - y[k]).abs().max() for k in x} for x, y in zip(a, b, strict=True)]


@pytest.fixture(scope="module")
def stock_runs() -> dict[str, tuple[list[Step], list[Step]]]:
    """Per model: stock Inductor's steps, and how far stock aot_eager's are from them."""
    return {}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_zoo_model_trains_on_cuda_like_stock_inductor(name, setting, stock_runs):
    entry = CASES[name]
    if entry.requires:
        pytest.importorskip(entry.requires)
    model = entry.model().cuda()
    if name not in stock_runs:
        stock = _train(copy.deepcopy(model), entry, "inductor")
        other_stock = _train(copy.deepcopy(model), entry, "aot_eager")
        stock_runs[name] = stock, _largest_error(other_stock, stock)
    stock, spread = stock_runs[name]
    backend = offload_pass.backend(min_bytes=0, **SETTINGS[setting])
    offloaded = _train(copy.deepcopy(model), entry, backend)

    error = _largest_error(offloaded, stock)
    for k, (step_error, step_spread, expected) in enumerate(zip(error, spread, stock, strict=True)):
        assert step_error.keys() == step_spread.keys()
        for key, value in step_error.items():
            floor = FLOOR_ULPS * torch.finfo(expected[key].dtype).eps * expected[key].abs().max()
            assert value <= step_spread[key] + floor, (k, key, value, step_spread[key])
    if "fraction" in SETTINGS[setting]:
        moved = {_symbolic(plan) for plan in backend.plans if plan.moved}
        assert moved == {False, True}, "nothing moved in the static or the symbolic compile"


def _symbolic(plan: offload_pass.Plan) -> bool:
    inputs = plan.forward.graph.find_nodes(op="placeholder")
    return any(free_symbols(node.meta.get("val")) for node in inputs)
