"""Per-instance state: microbatch interleaving, evaluation forwards, abandoned forwards."""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch

import offload_pass
from offload_pass.profiles import BUILT_IN
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


_failing = {"armed": False}


@torch.library.custom_op("offload_pass_tests::fail_in_backward", mutates_args=())
def fail_in_backward(x: torch.Tensor) -> torch.Tensor:
    """Identity in forward; its backward raises while ``_failing["armed"]`` is set."""
    return x.clone()


@fail_in_backward.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("offload_pass_tests::raise_if_armed", mutates_args=())
def raise_if_armed(grad: torch.Tensor) -> torch.Tensor:
    if _failing["armed"]:
        raise RuntimeError("a failure in the middle of backward")
    return grad.clone()


@raise_if_armed.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


fail_in_backward.register_autograd(lambda ctx, grad: raise_if_armed(grad))


class FailsMidBackward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = models.BlockStack(depth=2)
        self.second = models.BlockStack(depth=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(fail_in_backward(self.first(x)))


def test_backward_that_raises_between_reload_and_wait_leaks_nothing():
    """A step whose backward raises (an OOM caught by a skip-batch handler, say) leaves no
    copy in flight once its exception is dropped, and the next step trains as usual."""
    torch.manual_seed(0)
    model = FailsMidBackward()
    plain = copy.deepcopy(model)
    slow_reloads = dataclasses.replace(BUILT_IN["h200"], host_to_device=1e6)
    backend = offload_pass.backend(
        fraction=1.0, min_bytes=0, compiler="eager", profile=slow_reloads
    )
    compiled = torch.compile(model, backend=backend)
    reference = torch.compile(plain, backend="aot_eager")
    x = torch.randn(2, 16, 32)
    gc.collect()
    baseline = offload_pass.counts()

    loss = total(compiled(x))
    _failing["armed"] = True
    try:
        with pytest.raises(RuntimeError, match="middle of backward") as failure:
            loss.backward()
    finally:
        _failing["armed"] = False
    assert offload_pass.counts().pending_reloads > baseline.pending_reloads, "none in flight"
    del failure, loss
    model.zero_grad(set_to_none=True)
    gc.collect()
    after = offload_pass.counts()
    assert (after.pending_reloads, after.host_buffers) == (
        baseline.pending_reloads,
        baseline.host_buffers,
    )

    total(compiled(x)).backward()
    total(reference(x)).backward()
    for name, grad in _grads(model).items():
        assert torch.equal(grad, dict(plain.named_parameters())[name].grad), name
