"""The rewritten graphs hold the contract's nodes in the contract's order."""

from __future__ import annotations

import re

import pytest
import torch
import torch.fx
from torch._inductor.utils import run_and_get_code

import offload_pass
from offload_pass import ops
from tests import models
from tests.conftest import compiled_pair, train_step


def _nodes(graph: torch.fx.Graph, target) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is target]


@pytest.fixture(params=["eager", "inductor"])
def plan(request) -> offload_pass.Plan:
    model, _, backend = compiled_pair(models.BlockStack, request.param, fraction=1.0)
    train_step(model, torch.randn(2, 16, 32))
    return backend.plans[0]


def test_each_offload_is_waited_on_after_its_last_forward_use(plan):
    graph = plan.forward.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    output = graph.output_node()
    offloads = _nodes(graph, ops.OFFLOAD)
    assert len(offloads) == len(plan.moved)
    for offload in offloads:
        (wait,) = [u for u in offload.users if u.target is ops.OFFLOAD_WAIT]
        device_tensor = offload.args[0]
        assert order[device_tensor] < order[offload] < order[wait] < order[output]
        assert wait.args[1] is device_tensor
        last_use = max(order[u] for u in device_tensor.users)
        assert last_use == order[wait], "offload_wait must be the last use of the device tensor"
        assert device_tensor not in output.args[0]
        assert offload in output.args[0]


def test_backward_reads_host_tensors_and_waits_before_first_use(plan):
    graph = plan.backward.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    reloads = _nodes(graph, ops.RELOAD)
    assert len(reloads) == len(plan.moved)
    for reload in reloads:
        host_input = reload.args[0]
        assert host_input.op == "placeholder"
        assert host_input.meta["val"].device.type == "cpu"
        assert list(host_input.users) == [reload]
        (wait,) = [u for u in reload.users if u.target is ops.RELOAD_WAIT]
        readers = [u for u in reload.users if u is not wait]
        assert readers
        assert order[reload] < order[wait] < min(order[u] for u in readers)
    moved_roots = {d.group.root for d in plan.moved}
    placeholder_names = {n.name for n in graph.find_nodes(op="placeholder")}
    assert not moved_roots & placeholder_names, "backward must not take the device tensor"


def _alias(code: str, buffer: str) -> str:
    """The name Inductor's wrapper rebinds a fallback kernel's result to, if any."""
    match = re.search(rf"^\s*(\w+) = {buffer}\s*$", code, flags=re.MULTILINE)
    return match.group(1) if match else buffer


_DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.mark.parametrize("device", _DEVICES)
def test_inductor_keeps_the_order_in_generated_code(device):
    model, _, backend = compiled_pair(
        lambda: models.BlockStack().to(device), "inductor", fraction=1.0
    )
    _, (forward_code, backward_code) = run_and_get_code(
        lambda: train_step(model, torch.randn(2, 16, 32, device=device))
    )
    offload_call = r"(\w+) = torch\.ops\.offload_pass\.offload\.default\((\w+),"
    offloads = re.findall(offload_call, forward_code)
    assert len(offloads) == len(backend.plans[0].moved)
    for host, device_buffer in offloads:
        produced = forward_code.index(f"{device_buffer} = ")
        issued = forward_code.index(f"{host} = torch.ops.offload_pass.offload")
        waited = forward_code.index(f"offload_wait.default({_alias(forward_code, host)}")
        assert produced < issued < waited

    reloads = re.findall(r"(\w+) = torch\.ops\.offload_pass\.reload\.default\(", backward_code)
    assert len(reloads) == len(backend.plans[0].moved)
    for result in reloads:
        issued = backward_code.index(f"{result} = torch.ops.offload_pass.reload")
        buffer = _alias(backward_code, result)
        waited = backward_code.index(f"reload_wait.default({buffer}")
        first_read = min(
            m.start() for m in re.finditer(rf"\b{buffer}\b", backward_code[waited + 1 :])
        )
        assert issued < waited < waited + 1 + first_read
        between = "\n".join(
            line
            for line in backward_code[issued:waited].splitlines()
            if not line.strip().startswith(("assert_", "#"))
        )
        assert re.search(rf"[(, ]{buffer}[,)]", between) is None, "read before reload_wait"
