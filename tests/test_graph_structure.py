"""The rewritten graphs hold the contract's nodes in the contract's order."""

from __future__ import annotations

import dataclasses
import functools
import operator
import re

import pytest
import torch
import torch.fx
from torch._inductor.utils import run_and_get_code

import offload_pass
from offload_pass import ops
from offload_pass.graphs import is_view
from offload_pass.profiles import BUILT_IN
from tests import models
from tests.conftest import compiled_pair, train_step


def _nodes(graph: torch.fx.Graph, target) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is target]


@pytest.fixture(params=["eager", "inductor"])
def plan(request) -> offload_pass.Plan:
    model, _, backend = compiled_pair(models.BlockStack, request.param, fraction=1.0)
    train_step(model, torch.randn(2, 16, 32))
    return backend.plans[0]


def _items(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """The tensors taken from an op's list result, by index."""
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def test_each_offload_is_waited_on_after_its_last_forward_use(plan):
    graph = plan.forward.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    output = graph.output_node()
    offloads = _nodes(graph, ops.OFFLOAD)
    assert sum(len(o.args[0]) for o in offloads) == len(plan.moved)
    assert len(offloads) < len(plan.moved), "storages placed close together share an op"
    for offload in offloads:
        (wait,) = [
            u for u in offload.users if u.target is ops.OFFLOAD_WAIT and u.args[0] is offload
        ]
        device_tensors = offload.args[0]
        assert wait.args[1] == device_tensors
        hosts = _items(wait)
        assert sorted(hosts) == list(range(len(device_tensors)))
        for i, device_tensor in enumerate(device_tensors):
            assert order[device_tensor] < order[offload] < order[wait] < order[output]
            last_use = max(order[u] for u in device_tensor.users)
            assert last_use == order[wait], "offload_wait must be the device tensor's last use"
            assert device_tensor not in output.args[0]
            assert hosts[i] in output.args[0], "the host tensor the wait returns is saved"
        assert offload not in output.args[0], "a ticket never outlives its forward"


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    found: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(current.all_input_nodes)
    return found


def test_each_wait_follows_every_read_and_holds_no_token_it_does_not_need(plan):
    """Data dependence alone puts every kernel reading a moved storage before its wait;
    and no token is passed whose value only the other tokens read, since a token's buffer
    stays alive until the wait."""
    waits = _nodes(plan.forward.graph, ops.OFFLOAD_WAIT)
    assert waits
    for wait in waits:
        before = _ancestors(wait)
        for device_tensor in wait.args[1]:
            assert set(_readers(device_tensor)) <= before, "a read may run after the wait"
        tokens = [t for t in wait.args[-1] if t.target not in ops.TICKETS]
        for token in tokens:
            others = set().union(*(_ancestors(o) | {o} for o in tokens if o is not token))
            read_by_others_only = all(u in others or u is wait for u in token.users)
            assert not (token in others and read_by_others_only), token.name


def _read_by_b_alone(graph: torch.fx.Graph, a: torch.fx.Node) -> torch.fx.Node:
    return graph.call_function(torch.neg, (a,))


def _read_again_after_b(graph: torch.fx.Graph, a: torch.fx.Node) -> torch.fx.Node:
    b = graph.call_function(torch.neg, (a,))
    graph.call_function(torch.exp, (a,))
    return b


def _only_its_size_taken_by_b(graph: torch.fx.Graph, a: torch.fx.Node) -> torch.fx.Node:
    size = graph.call_function(torch.ops.aten.sym_size.int, (a, 0))
    size.meta["val"] = 3
    fresh = graph.call_function(torch.neg, (next(iter(graph.nodes)),))
    return graph.call_function(torch.ops.aten.view.default, (fresh, [size]))


@pytest.mark.parametrize(
    ("make_b", "a_kept"),
    [(_read_by_b_alone, False), (_read_again_after_b, True), (_only_its_size_taken_by_b, True)],
)
def test_a_token_is_left_out_only_where_the_others_wait_for_all_its_reads(make_b, a_kept):
    """Token ``a``, read by nothing but later token ``b``'s ancestry, is implied by it;
    one read again after ``b``, or whose size alone ``b`` takes, is not."""
    from offload_pass.rewrite import _without_implied

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.relu, (x,))
    b = make_b(graph, a)
    for node in graph.nodes:
        node.meta.setdefault("val", torch.empty(3))
    order = {n: i for i, n in enumerate(graph.nodes)}
    assert _without_implied([a, b], order) == ([a, b] if a_kept else [b])


def test_backward_reads_host_tensors_and_waits_before_first_use(plan):
    graph = plan.backward.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    reloads = _nodes(graph, ops.RELOAD)
    assert sum(len(r.args[0]) for r in reloads) == len(plan.moved)
    for reload in reloads:
        host_inputs = reload.args[0]
        (wait,) = [u for u in reload.users if u.target is ops.RELOAD_WAIT]
        assert wait.args[0] is reload
        assert wait.args[1] == host_inputs
        loaded = _items(wait)
        assert sorted(loaded) == list(range(len(host_inputs)))
        for i, host_input in enumerate(host_inputs):
            storage = loaded[i]
            assert host_input.op == "placeholder"
            assert host_input.meta["val"].device.type == "cpu"
            host, device = host_input.meta["val"], storage.meta["val"]
            assert (host.shape, host.dtype) == (device.shape, device.dtype)
            assert set(host_input.users) == {reload, wait}
            readers = list(storage.users)
            assert readers
            assert order[reload] < order[wait] < min(order[u] for u in readers)
    moved_roots = {d.group.root for d in plan.moved}
    placeholder_names = {n.name for n in graph.find_nodes(op="placeholder")}
    assert not moved_roots & placeholder_names, "backward must not take the device tensor"


def _calls(lines: list[str]) -> list[str]:
    """Lines of generated code that run something (not a free, reuse, check or comment)."""
    skipped = ("assert_", "#", "del ")
    return [
        line
        for line in lines
        if line.strip() and not line.strip().startswith(skipped) and "# reuse" not in line
    ]


def _alias(code: str, buffer: str) -> str:
    """The name Inductor's wrapper rebinds a fallback kernel's result to, if any."""
    match = re.search(rf"^\s*(\w+) = {buffer}\s*$", code, flags=re.MULTILINE)
    return match.group(1) if match else buffer


def _position(code: str, pattern: str) -> int:
    """Where ``pattern`` first matches; whole buffer names only (``buf1`` is not ``buf10``)."""
    match = re.search(pattern, code)
    assert match, f"no match for {pattern!r}"
    return match.start()


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
    moved = len(backend.plans[0].moved)
    offload_call = r"(\w+) = torch\.ops\.offload_pass\.offload\.default\(\[([\w, ]+)\],"
    offloads = re.findall(offload_call, forward_code)
    assert sum(len(buffers.split(", ")) for _, buffers in offloads) == moved
    for ticket, buffers in offloads:
        issued = _position(forward_code, rf"\b{ticket} = torch\.ops\.offload_pass\.offload\b")
        waited = _position(
            forward_code, rf"offload_wait\.default\({_alias(forward_code, ticket)}\b"
        )
        later = _calls(forward_code[waited:].splitlines()[1:])
        for device_buffer in buffers.split(", "):
            assert _position(forward_code, rf"\b{device_buffer} = ") < issued < waited
            reads = [line for line in later if re.search(rf"\b{device_buffer}\b", line)]
            assert not reads, f"{device_buffer} read after its offload_wait: {reads}"

    # What runs in the step: not its inputs' unpacking, nor the benchmark harness after it.
    step = backward_code.split("def call(", 1)[1].split("\ndef ", 1)[0]
    kernel_lines = [line for line in _calls(step.splitlines()) if not line.endswith("= args")]
    reload_call = r"(\w+) = torch\.ops\.offload_pass\.reload\.default\(\[([\w, ]+)\],"
    reloads = re.findall(reload_call, backward_code)
    assert sum(len(hosts.split(", ")) for _, hosts in reloads) == moved
    for ticket, hosts in reloads:
        issued = _position(backward_code, rf"\b{ticket} = torch\.ops\.offload_pass\.reload\b")
        wait_call = r"(\w+) = torch\.ops\.offload_pass\.reload_wait\.default\("
        wait = re.search(rf"{wait_call}{_alias(backward_code, ticket)}\b", backward_code)
        assert wait, f"no reload_wait takes {ticket}"
        assert issued < wait.start()
        for i, host in enumerate(hosts.split(", ")):
            uses = [line for line in kernel_lines if re.search(rf"\b{host}\b", line)]
            assert all("offload_pass.reload" in line for line in uses), uses
            item = re.search(rf"(\w+) = {wait.group(1)}\[{i}\]", backward_code)
            assert item, f"reload_wait {wait.group(1)}'s tensor {i} is never taken"
            for name in {item.group(1), _alias(backward_code, item.group(1))}:
                assert _position(backward_code, rf"\b{name}\b") > wait.start(), name


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _matmuls_before(graph: torch.fx.Graph, target) -> list[int]:
    count, counts = 0, []
    for node in graph.nodes:
        count += node.target in _MATMULS
        if node.target is target:
            counts.append(count)
    return counts


def _code_matmuls_before(code: str, call: str) -> list[int]:
    body = code[code.index("def call(") :]
    count, counts = 0, []
    for line in _calls(body.splitlines()):
        count += bool(re.search(r"extern_kernels\.(mm|addmm|bmm)\(", line))
        counts += [count] if call in line else []
    return counts


def test_inductor_issues_each_transfer_where_the_plan_placed_it():
    """Counted in matrix products before it, every wait and reload sits in Inductor's code
    where it sits in the rewritten graph: no pass hoisted or sank it."""
    instant_copies = dataclasses.replace(BUILT_IN["h200"], device_to_host=1e15, host_to_device=1e15)
    model, _, backend = compiled_pair(
        lambda: models.BlockStack(depth=3), "inductor", fraction=1.0, profile=instant_copies
    )
    _, (forward_code, backward_code) = run_and_get_code(
        lambda: train_step(model, torch.randn(2, 16, 32))
    )
    plan = backend.plans[0]
    reloads = _matmuls_before(plan.backward.graph, ops.RELOAD)
    assert len(set(reloads)) > 2, "the plan should spread reloads through backward"
    assert _code_matmuls_before(backward_code, "offload_pass.reload.default(") == reloads
    waits = _matmuls_before(plan.forward.graph, ops.OFFLOAD_WAIT)
    assert sorted(_code_matmuls_before(forward_code, "offload_wait.default(")) == sorted(waits)


def _sink_reloads(sunk: list[str], nodes: list) -> list:
    """What fusion did to a reload on CUDA (a fused kernel pulled the work planned after
    it ahead of it): each reload, with the nodes right after it that take its result
    apart, moved down to right before the first other node reading it."""
    nodes = list(nodes)
    for reload in [n for n in nodes if getattr(n.node, "op_overload", None) is ops.RELOAD]:
        start = end = nodes.index(reload)
        names = set(reload.get_buffer_names())
        reads = [{d.name for d in n.unmet_dependencies} for n in nodes]
        while end + 1 < len(nodes) and reads[end + 1] and reads[end + 1] <= names:
            end += 1
            names |= set(nodes[end].get_buffer_names())
        reader = next(k for k in range(end + 1, len(nodes)) if names & reads[k])
        if reader > end + 1:
            nodes[start:reader] = nodes[end + 1 : reader] + nodes[start : end + 1]
            sunk.append(reload.get_name())
    return nodes


def test_reloads_issue_where_placed_after_a_scheduler_pass_sinks_them():
    """Whatever order Inductor's scheduler reaches after fusion (here a pass of the user's
    that sinks every reload to its first reader), the code starts each reload where the
    plan placed it."""
    from torch._inductor import config

    slow_reloads = dataclasses.replace(BUILT_IN["h200"], host_to_device=1e9)
    model, _, backend = compiled_pair(
        lambda: models.BlockStack(depth=3), "inductor", fraction=1.0, profile=slow_reloads
    )
    sunk: list[str] = []
    with config.patch(_post_fusion_custom_pass=functools.partial(_sink_reloads, sunk)):
        _, (_, backward_code) = run_and_get_code(lambda: train_step(model, torch.randn(2, 16, 32)))
    backward = backend.plans[0].backward.graph
    reloads = _matmuls_before(backward, ops.RELOAD)
    waits = _matmuls_before(backward, ops.RELOAD_WAIT)
    assert sum(waits) > sum(reloads), "reloads should be placed matrix products before use"
    assert sunk, "the sinking pass should have moved reloads"
    assert _code_matmuls_before(backward_code, "offload_pass.reload.default(") == reloads


_FUSED = {torch.Tag.pointwise, torch.Tag.reduction}


def _computed_in_kernels(node: torch.fx.Node) -> bool:
    """A pointwise op or reduction, or one result of one: Inductor fuses it."""
    op = node.args[0].target if node.target is operator.getitem else node.target
    return isinstance(op, torch._ops.OpOverload) and bool(_FUSED & set(op.tags))


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes reading ``node``'s value, through views, other than transfer ops."""
    found = []
    for user in node.users:
        if is_view(user) and user.args[0] is node:
            found += _readers(user)
        elif user.target not in ops.TRANSFERS:
            found.append(user)
    return found


def _written_anyway(node: torch.fx.Node) -> bool:
    """Whether compiled code writes ``node``'s value to memory with no transfer reading it:
    a kernel that is not fused makes it, or a graph output or an unfused kernel reads it."""
    readers = _readers(node)
    if any(u.target is torch.ops.aten.copy_.default for u in readers):
        return False
    if not _computed_in_kernels(node):
        return True
    return any(u.op == "output" or not _computed_in_kernels(u) for u in readers)


def test_ordering_tokens_are_values_the_compiled_code_writes_anyway():
    """A wait's tokens never make Inductor write out a value it would keep inside a kernel
    (a batch norm's variance), or a running statistic it writes in place."""
    from tests import zoo

    entry = zoo.ZOO["resnet"]
    backend = offload_pass.backend(fraction=1.0, min_bytes=0)
    compiled = torch.compile(entry.model(), backend=backend)
    entry.loss(compiled, entry.make_batch(0)).backward()
    tokens = [
        t
        for plan in backend.plans
        for graph in (plan.forward.graph, plan.backward.graph)
        for n in graph.nodes
        if n.target in (ops.OFFLOAD_WAIT, ops.RELOAD)
        for t in n.args[-1]
        if t.target not in ops.TICKETS
    ]
    assert tokens
    assert [t.name for t in tokens if not _written_anyway(t)] == []


def test_each_stage_of_the_pass_is_timed_in_the_order_it_ran(plan):
    assert list(plan.stage_seconds) == ["order", "analyse", "costs", "plan", "bucket", "rewrite"]
    assert all(seconds >= 0 for seconds in plan.stage_seconds.values())


def test_new_transfer_nodes_carry_the_values_their_ops_produce(plan):
    """The rewrite calls each op's fake implementation directly: the value must be what
    running the op under the fake mode gives."""
    from torch._guards import detect_fake_mode

    for graph in (plan.forward.graph, plan.backward.graph):
        for node in graph.nodes:
            if node.target not in ops.TRANSFERS:
                continue
            args = torch.fx.node.map_arg(node.args, lambda n: n.meta["val"])
            with detect_fake_mode(args):
                value = node.target(*args)
            assert _described(value) == _described(node.meta["val"])


def _described(value: torch.Tensor | list[torch.Tensor]) -> list[tuple]:
    tensors = value if isinstance(value, list) else [value]
    return [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]


def test_the_rewrites_node_values_are_the_ops_fake_values():
    """``ops.NODE_VALUES`` builds each new node's value directly; under the compile's fake
    mode (symbolic sizes, a second device) it must match what the op's registered fake
    implementation returns there."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 3)
    device = torch.device("cuda", 1)
    with mode:
        a = mode.from_tensor(torch.empty(2, 3, 4), symbolic_context=dynamic).to(device)
        b = mode.from_tensor(torch.empty(5, 6, dtype=torch.bfloat16)).to(device)
        layouts = [2, 0, 1, 1, 0]
        hosts = [
            torch.empty_permuted(a.shape, (2, 0, 1), dtype=a.dtype),
            torch.empty_permuted(b.shape, (1, 0), dtype=b.dtype),
        ]
        ticket = torch.empty((), dtype=torch.int64)
        arguments = {
            ops.OFFLOAD: ([a, b], layouts),
            ops.OFFLOAD_WAIT: (ticket, [a, b], layouts, [a]),
            ops.RELOAD: (hosts, device, [a]),
            ops.RELOAD_WAIT: (ticket, hosts, device),
        }
        for op, args in arguments.items():
            built, made = ops.NODE_VALUES[op](*args), op(*args)
            values = built if isinstance(built, list) else [built]
            assert all(v.fake_mode is mode for v in values), op
            assert _described(built) == _described(made), op


def test_a_bias_add_inductor_would_split_is_split_as_inductor_splits_it():
    """Before a transfer op can read the product as a token, which would keep Inductor
    from splitting it: the graph becomes the one Inductor's own pattern makes, and
    computes the same values."""
    from torch._inductor.fx_passes.post_grad import pass_patterns
    from torch._inductor.virtualized import V

    from offload_pass.rewrite import split_bias_adds

    ours, _ = models.biased_product_graph(torch.float32, "cuda", torch.ops.aten.mul.Tensor)
    theirs, mode = models.biased_product_graph(torch.float32, "cuda", torch.ops.aten.mul.Tensor)
    split_bias_adds(ours.graph)
    with V.set_fake_mode(mode):
        pass_patterns[2].apply(theirs.graph)

    def calls(gm: torch.fx.GraphModule) -> list[tuple[object, list[str]]]:
        return [
            (n.target, [a.op if isinstance(a, torch.fx.Node) else a for a in n.args])
            for n in _call_nodes(gm)
        ]

    assert calls(ours) == calls(theirs)
    assert [n.target for n in _call_nodes(ours)] == [
        torch.ops.aten.mm.default,
        torch.ops.aten.add.Tensor,
        torch.ops.aten.mul.Tensor,
    ]
    for node in _call_nodes(ours):
        assert node.meta["val"].shape == (4, 16) and node.meta["val"].device.type == "cuda"
    ours.recompile()
    unsplit, _ = models.biased_product_graph(torch.float32, "cuda", torch.ops.aten.mul.Tensor)
    inputs = (torch.randn(16), torch.randn(4, 8), torch.randn(8, 16))
    torch.testing.assert_close(ours(*inputs), unsplit(*inputs))


def _call_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]
