"""Per-instance state: microbatch interleaving, evaluation forwards, abandoned forwards."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import offload_pass
from tests import models
from tests.conftest import total


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _sequential_reference(model, batches):
    plain = copy.deepcopy(model)
    reference = torch.compile(plain, backend="aot_eager")
    x_grads = []
    for x in batches:
        x = x.clone().requires_grad_()
        total(reference(x)).backward()
        x_grads.append(x.grad)
    return _grads(plain), x_grads


@pytest.mark.parametrize("order", ["last_first", "first_first"])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_interleaved_microbatches_match_sequential(fraction, order):
    torch.manual_seed(0)
    model = models.BlockStack(depth=3)
    batches = [torch.randn(2, 16, 32) for _ in range(2)]
    expected_params, expected_x = _sequential_reference(model, batches)

    backend = offload_pass.backend(fraction=fraction, min_bytes=0, compiler="eager")
    compiled = torch.compile(model, backend=backend)
    inputs = [x.clone().requires_grad_() for x in batches]
    losses = [total(compiled(x)) for x in inputs]
    for i in reversed(range(2)) if order == "last_first" else range(2):
        losses[i].backward()

    for name, grad in _grads(model).items():
        assert torch.equal(grad, expected_params[name]), name
    for x, expected in zip(inputs, expected_x, strict=True):
        assert torch.equal(x.grad, expected)
    assert offload_pass.counts().host_buffers == 0


def _decisions(backend):
    return [(d.group.root, d.moved, d.reason) for p in backend.plans for d in p.decisions]


def test_evaluation_forwards_change_neither_plan_nor_gradients():
    torch.manual_seed(0)
    model = models.BlockStack()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 16, 32)

    with_eval = offload_pass.backend(min_bytes=0, compiler="eager")
    compiled = torch.compile(model, backend=with_eval)
    without_eval = offload_pass.backend(min_bytes=0, compiler="eager")
    compiled_plain = torch.compile(plain, backend=without_eval)

    for step in range(3):
        with torch.no_grad():
            compiled(x)
        total(compiled(x)).backward()
        total(compiled_plain(x)).backward()
        for name, grad in _grads(model).items():
            assert torch.equal(grad, dict(plain.named_parameters())[name].grad), (step, name)

    assert _decisions(with_eval) == _decisions(without_eval)
    assert len(with_eval.plans) == 1


def test_forward_without_backward_leaks_nothing():
    torch.manual_seed(0)
    backend = offload_pass.backend(min_bytes=0, compiler="eager")
    compiled = torch.compile(models.BlockStack(), backend=backend)
    gc.collect()
    baseline = offload_pass.counts()

    loss = total(compiled(torch.randn(2, 16, 32, requires_grad=True)))
    assert offload_pass.counts().host_buffers == baseline.host_buffers + len(backend.plans[0].moved)
    del loss
    gc.collect()
    after = offload_pass.counts()
    assert after.host_buffers == baseline.host_buffers
    assert after.pending_reloads == baseline.pending_reloads
