from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch

import offload_pass
from offload_pass import device_cache
from offload_pass.blocks import Split, find_blocks
from offload_pass.driver import plan_chunk
from offload_pass.joint import SearchSpace


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The model zoo's tests first: pytest-xdist then shares their long groups out among
    the workers at the start, and the short tests fill in behind them."""
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


@pytest.fixture(autouse=True, scope="session")
def device_cache_of_this_run(tmp_path_factory: pytest.TempPathFactory):
    """Measurements kept where this run alone reads them, not in the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        directory = tmp_path_factory.mktemp("device_cache")
        patch.setenv(device_cache.CACHE_DIR_VARIABLE, str(directory))
        yield directory


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def total(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A scalar loss that reads every output."""
    if isinstance(out, tuple):
        return sum(o.float().pow(2).mean() for o in out)
    return out.float().pow(2).mean()


def train_step(
    model: torch.nn.Module, x: torch.Tensor, seed: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(loss, parameter grads, input grad) of one forward and backward."""
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(seed)
    loss = total(model(x))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, x.grad


def reference_backend(compiler: str) -> str:
    """The same compiler with no offload pass in it."""
    return {"inductor": "inductor", "eager": "aot_eager"}[compiler]


def compiled_pair(
    make_model: Callable[[], torch.nn.Module], compiler: str, **options
) -> tuple[torch.nn.Module, torch.nn.Module, offload_pass.OffloadBackend]:
    """(offloading model, reference model) with equal weights, and the backend."""
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    backend = offload_pass.backend(compiler=compiler, min_bytes=0, **options)
    return (
        torch.compile(model, backend=backend),
        torch.compile(reference, backend=reference_backend(compiler)),
        backend,
    )


def assert_same_step(a, b) -> None:
    loss_a, grads_a, x_grad_a = a
    loss_b, grads_b, x_grad_b = b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    if x_grad_a is not None or x_grad_b is not None:
        assert torch.equal(x_grad_a, x_grad_b)


def every_block_checkpointed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compile plans its chunk with every repeated block checkpointed, in whatever
    mode its backend was given."""

    def every_block(options, joint_graph, outputs):
        return SearchSpace((), find_blocks(joint_graph, outputs))

    def planned_at_every_block(partition, options, rule, space, host_scale=1.0):
        split = Split(None, space.blocks)
        planned = plan_chunk(partition(split), options, rule, host_scale)
        return dataclasses.replace(planned, split=split)

    monkeypatch.setattr("offload_pass.partition.search_space", every_block)
    monkeypatch.setattr("offload_pass.partition.plan_jointly", planned_at_every_block)
