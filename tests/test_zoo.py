"""Three training steps of each zoo model under offloading land as close to stock Inductor's
as other stock runs do.

The second distinct shape recompiles with symbolic sizes, so every model is planned and
rewritten twice: once static, once symbolic.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_symbols

import offload_pass
from tests import zoo

STEPS = 3
SETTINGS = {
    "half": {"fraction": 0.5},
    "all": {"fraction": 1.0},
    "auto_h200": {"profile": "h200"},
}
FLOOR_ULPS = 4
"""The least tolerance, in float32 roundings at a tensor's largest magnitude."""

Step = dict[str, torch.Tensor]
"""A step's loss (under "loss") and every parameter's gradient (under its name)."""


def train(model: nn.Module, entry: zoo.Entry, backend: object) -> list[Step]:
    compiled = torch.compile(model, backend=backend)
    steps = []
    for k in range(STEPS):
        loss = entry.loss(compiled, entry.make_batch(k))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        steps.append({"loss": loss.detach(), **grads})
        model.zero_grad(set_to_none=True)
    torch.compiler.reset()
    return steps


def largest_error(a: list[Step], b: list[Step]) -> list[Step]:
    return [{k: (x[k] - y[k]).abs().max() for k in x} for x, y in zip(a, b, strict=True)]


@dataclasses.dataclass(frozen=True)
class Reference:
    model: nn.Module
    """The untrained model; every run trains a deep copy of it."""
    stock: list[Step]
    spread: list[Step]
    """Per tensor, how far stock runs land from ``stock``: a second Inductor compile (its
    parallel atomic adds sum in a different order from run to run) and aot_eager (the
    same graph in other kernels: offloading splits some of Inductor's fusions too)."""


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    return {}


def reference(references: dict[str, Reference], name: str) -> Reference:
    if name not in references:
        entry = zoo.ZOO[name]
        model = entry.model()
        stock, again, eager = (
            train(copy.deepcopy(model), entry, other)
            for other in ("inductor", "inductor", "aot_eager")
        )
        spread = [
            {k: torch.maximum(a[k], b[k]) for k in a}
            for a, b in zip(largest_error(again, stock), largest_error(eager, stock), strict=True)
        ]
        references[name] = Reference(model, stock, spread)
    return references[name]


def assert_within_spread(steps: list[Step], ref: Reference) -> None:
    errors = largest_error(steps, ref.stock)
    for k, (error, spread, expected) in enumerate(zip(errors, ref.spread, ref.stock, strict=True)):
        assert error.keys() == expected.keys()
        for key, value in error.items():
            floor = FLOOR_ULPS * torch.finfo(expected[key].dtype).eps * expected[key].abs().max()
            assert value <= spread[key] + floor, (k, key, value.item(), spread[key].item())


def symbolic(plan: offload_pass.Plan) -> bool:
    """Whether the chunk was compiled with symbolic sizes."""
    inputs = plan.forward.graph.find_nodes(op="placeholder")
    return any(free_symbols(node.meta.get("val")) for node in inputs)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_training_matches_stock_inductor(name, setting, references):
    if zoo.ZOO[name].requires:
        pytest.importorskip(zoo.ZOO[name].requires)
    ref = reference(references, name)
    backend = offload_pass.backend(min_bytes=0, **SETTINGS[setting])
    steps = train(copy.deepcopy(ref.model), zoo.ZOO[name], backend)
    assert_within_spread(steps, ref)
    assert sum(plan.bytes_moved for plan in backend.plans) > 0
    if "fraction" in SETTINGS[setting]:
        moved = {symbolic(plan) for plan in backend.plans if plan.bytes_moved}
        assert moved == {False, True}, "nothing moved in the static or the symbolic compile"
