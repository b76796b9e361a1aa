"""Every use of a torch internal lives here, each behind one small function.

Supported: torch 2.11 to 2.15. Each branch taken on some version has a test in
tests/test_compat.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import operator
import re
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

PartitionFn = Callable[..., tuple[torch.fx.GraphModule, torch.fx.GraphModule]]
PartitionerBase = CustomPartitionerFn


def flexible_layout_tags(tag_namespace: Any = torch.Tag) -> tuple[torch.Tag, ...]:
    """Tags that let Inductor hand a custom op its inputs in whatever layout they have.

    Without one, Inductor constrains a custom op's inputs to their traced strides, fixing
    the layout of the kernels that produce them or copying them. The transfer ops copy
    from any layout, and their ordering inputs are only there for order.
    """
    return (tag_namespace.flexible_layout,) if hasattr(tag_namespace, "flexible_layout") else ()


def cudagraph_unsafe_tags(tag_namespace: Any = torch.Tag) -> tuple[torch.Tag, ...]:
    """Tags that keep an op out of CUDA graphs: with graph partitioning on, Inductor
    captures the rest of the graph around it. A replay repeats only kernels, and the
    transfer ops switch streams, record and wait for events and hand out buffers from
    outside the graph's memory pool on every call."""
    return (tag_namespace.cudagraph_unsafe,) if hasattr(tag_namespace, "cudagraph_unsafe") else ()


def fusible_tags(tag_namespace: Any = torch.Tag) -> tuple[torch.Tag, ...]:
    """Tags of ops Inductor fuses into neighbouring kernels (pointwise, reductions)."""
    return tuple(
        getattr(tag_namespace, name)
        for name in ("pointwise", "reduction")
        if hasattr(tag_namespace, name)
    )


def stock_partition(
    joint: torch.fx.GraphModule,
    joint_inputs: Sequence[object],
    recompute_budget: float | None = None,
    recompute_seconds: Callable[[torch.fx.Node], float] | None = None,
    **kwargs: Any,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The min-cut partitioner, with ``recompute_budget`` as torch's
    ``activation_memory_budget`` where given (torch's own setting where None). Under a
    budget below 1 its knapsack chooses what to recompute, cheapest first: priced by
    ``recompute_seconds`` where given and torch takes a runtime estimator of its own
    (:func:`runtime_estimator`), else by torch's FLOP counts. A joint partitioned again
    skips the partitioner's common subexpression pass (:data:`_DEDUPLICATED`)."""
    from torch._functorch import config

    budget = config.activation_memory_budget if recompute_budget is None else recompute_budget
    settings: dict[str, Any] = {"activation_memory_budget": budget}
    estimator = None if recompute_seconds is None else runtime_estimator(recompute_seconds)
    if estimator is not None:
        settings["activation_memory_budget_runtime_estimator"] = estimator
    if joint.graph in _DEDUPLICATED:
        settings["cse"] = False
    before = joint.graph
    with config.patch(**settings):
        graphs = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        if config.cse and joint.graph is not before:
            _DEDUPLICATED.add(joint.graph)
    return graphs


_DEDUPLICATED: weakref.WeakSet[torch.fx.Graph] = weakref.WeakSet()
"""Joint graphs made by the partitioner's common subexpression pass, which replaces the
joint's graph by its result: a search partitioning one joint several times runs the pass
once (on W1, 0.1 s of each partition's 0.5, the pass and the joint's recompile). On a
graph it made, the pass merges nothing more."""


def runtime_estimator(seconds: Callable[[torch.fx.Node], float]) -> object | None:
    """``seconds`` as the partitioner's runtime estimator, on a torch that takes one
    (``CustomRuntimeEstimator``); None on one that prices by its own modes alone. Its
    ``uuid`` is None: AOTAutograd's cache is bypassed, as for the pass's partitioner."""
    from torch._inductor import custom_graph_pass

    base = getattr(custom_graph_pass, "CustomRuntimeEstimator", None)
    if base is None:
        return None

    class _Estimator(base):  # type: ignore[misc, valid-type]
        def __call__(self, node: torch.fx.Node) -> float:
            return seconds(node)

        def uuid(self) -> None:
            return None

    return _Estimator()


@contextlib.contextmanager
def partitioner_policies(
    joint: torch.fx.GraphModule,
    saved: frozenset[str] = frozenset(),
    recomputed: Mapping[str, int] | None = None,
) -> Iterator[None]:
    """While open, the partitioner must save the joint graph's nodes named in ``saved``
    and compute those named in ``recomputed`` again in backward, each in the region its
    number gives (the partitioner saves a value one region makes and a later one reads,
    as at the boundary of two checkpointed blocks). The marks are the selective-
    checkpointing policies ``MUST_SAVE`` and ``MUST_RECOMPUTE``, and ``ac_graph_id``,
    which the min-cut partitioner reads. Nodes that carry a policy of their own keep it.
    The partitioner's common subexpression pass replaces ``joint.graph`` by a copy, marks
    and all: the marks are lifted from both."""
    from torch.utils.checkpoint import CheckpointPolicy

    regions = recomputed or {}
    unmarked = [n for n in joint.graph.nodes if "recompute" not in n.meta]
    marked = [n for n in unmarked if n.name in regions or n.name in saved]
    for node in marked:
        if node.name in regions:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = regions[node.name]
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    try:
        yield
    finally:
        marked_names = {n.name for n in marked}
        copies = [n for n in joint.graph.nodes if n.name in marked_names]
        for node in (*marked, *copies):
            node.meta.pop("recompute", None)
            node.meta.pop("ac_graph_id", None)


GEN2_THRESHOLD_WHILE_COMPILING = 1000
"""The oldest generation's collection threshold while the pass runs, on a torch whose
Dynamo does not set one: the default of torch 2.15's
``torch._dynamo.config.gc_gen2_threshold_during_compile``."""


@dataclasses.dataclass
class _Gen2Deferral:
    """Nested uses of ``_gen2_threshold_raised`` open now, and the thresholds before the
    outermost (the threshold is process-wide, so the count is too)."""

    depth: int = 0
    saved: tuple[int, int, int] = (0, 0, 0)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_gen2_deferral = _Gen2Deferral()


def full_collections_deferred() -> contextlib.AbstractContextManager[None]:
    """Python's full (oldest-generation) garbage collections deferred while open.

    A full collection walks every tracked object, and a compile of a deep model holds
    over a million (FX nodes, fake tensors, sympy expressions): each one pauses the pass
    for about a second at 20,000 joint-graph nodes, and the pass makes enough objects to
    trigger one. From torch 2.15, Dynamo defers them for the whole compile
    (``torch._dynamo.utils.deferred_full_gc``, reentrant), and this is that; before, the
    pass defers them over its own part of the compile in the same way. Younger
    generations keep collecting; the deferred full collection follows after."""
    deferred = getattr(torch._dynamo.utils, "deferred_full_gc", None)
    return deferred() if deferred is not None else _gen2_threshold_raised()


@contextlib.contextmanager
def _gen2_threshold_raised() -> Iterator[None]:
    """``GEN2_THRESHOLD_WHILE_COMPILING`` as the oldest generation's threshold while
    open (never lowering a higher one), restored when the outermost of nested uses
    closes."""
    deferral = _gen2_deferral
    with deferral.lock:
        if deferral.depth == 0:
            deferral.saved = gc.get_threshold()
            young, middle, oldest = deferral.saved
            gc.set_threshold(young, middle, max(oldest, GEN2_THRESHOLD_WHILE_COMPILING))
        deferral.depth += 1
    try:
        yield
    finally:
        with deferral.lock:
            deferral.depth -= 1
            if deferral.depth == 0:
                gc.set_threshold(*deferral.saved)


def realize_reads_threshold() -> int:
    """How many buffers Inductor lets a pointwise value read, computed inside each kernel
    that reads it, before it writes the value out once instead."""
    from torch._inductor import config

    return config.realize_reads_threshold


def activation_memory_budget() -> float:
    """The partitioner's own recompute budget (``torch._functorch.config``)."""
    from torch._functorch import config

    return config.activation_memory_budget


def partitions_sync_across_ranks() -> bool:
    """Whether the partitioner agrees its choices across ranks, each call a collective."""
    from torch._functorch import config

    return bool(getattr(config, "_sync_decision_cross_ranks", False))


def _region_budget_reader() -> Callable[[torch.fx.Node], float | None]:
    """What reads the budget ``torch.autograd.graph.region_activation_memory_budget`` wrote
    on a node (torch >= 2.13; earlier versions have no such regions)."""
    try:
        from torch.fx.traceback import _get_memory_budget_annotation
    except ImportError:
        return lambda node: None
    return _get_memory_budget_annotation


def budget_annotated(joint: torch.fx.GraphModule) -> bool:
    """Whether nodes of the joint graph carry their own recompute budget (a region's, or
    the older per-node ``memory_budget``), which the partitioner takes over its setting."""
    region_budget = _region_budget_reader()
    return any(
        isinstance(n.meta.get("memory_budget"), float) or region_budget(n) is not None
        for n in joint.graph.nodes
    )


def inductor_config(mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """The Inductor settings ``torch.compile(mode=..., options=...)`` stands for, checked
    as torch.compile checks them for its own Inductor backend."""
    return dict(torch._TorchCompileInductorWrapper(mode, options, None).config)


def compile_with_inductor(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    partitioner: CustomPartitionerFn,
    holds_transfers: Callable[[torch.fx.GraphModule], bool],
    reload_op: object,
    config: dict[str, Any],
) -> Callable[..., Any]:
    """Inductor with ``partitioner`` in place of its own, under ``config`` (from
    :func:`inductor_config`); ``holds_transfers`` and ``reload_op`` as
    :func:`inductor_graph_compiler` takes them.

    Compile caches are off for these graphs: a cached graph would skip the partitioner,
    and with it the current plan (fractions change between compiles).
    """
    from torch._inductor.compile_fx import compile_fx

    patches = {**config, "custom_partitioner_fn": partitioner, "fx_graph_cache": False}
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(
            gm,
            example_inputs,
            inner_compile=inductor_graph_compiler(holds_transfers, reload_op),
            config_patches=patches,
        )


def lower_with_aligned_outputs(op: Any) -> None:
    """Have Inductor lower ``op`` as the fallback it makes for a custom op, except that
    the tensors ``op`` returns count as aligned: meant for an op that returns fresh
    allocations. Inductor counts a fallback's results as unaligned wherever one input
    is, and it counts every CPU input so; a kernel reading an unaligned buffer (or one
    reusing its memory) is compiled without the alignment that vector loads need, and
    can sum in another order (a reloaded fp32 stack's bias gradients differed from
    stock's in their last bits). Done once per op."""
    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import V
    from torch._library.utils import get_layout_constraint_tag

    if op in _LOWERED_ALIGNED:
        return
    if op not in lowering.lowerings:
        tag = get_layout_constraint_tag(op, with_default=True)
        lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))
    fallback = lowering.lowerings[op]

    def lower(*args: Any, **kwargs: Any) -> Any:
        results = fallback(*args, **kwargs)
        for result in pytree.tree_leaves(results):
            if isinstance(result, ir.TensorBox):
                V.graph.unaligned_buffers.discard(result.get_name())
        return results

    lowering.lowerings[op] = lower
    _LOWERED_ALIGNED.add(op)


_LOWERED_ALIGNED: set[Any] = set()


TRANSFER_GRAPH_SETTINGS = {"reorder_for_peak_memory": False, "allow_buffer_reuse": False}
"""Inductor settings in graphs that hold transfers. Peak-memory reordering would sink each
reload to its first use, where its copy cannot overlap anything, and the plan has already
ordered those graphs for memory. Buffer reuse keeps a freed buffer until a later one of its
size takes it over, while reloads allocate beside it: on W1 at a 7.35 GiB budget it held
0.31 GiB more in backward's CPU code (7.63 against 7.32 GiB without it; at fraction 1,
7.00 against 6.69; `benchmarks.inductor_memory`). Without it, each buffer is freed at its
last use, as the cost model assumes."""


def inductor_graph_compiler(
    holds_transfers: Callable[[torch.fx.GraphModule], bool], reload_op: object
) -> Callable[..., Any]:
    """Inductor's per-graph compile, with ``TRANSFER_GRAPH_SETTINGS`` in graphs that hold
    transfers, and there each call of ``reload_op`` issued where the graph places it
    (:func:`reloads_issued_where_placed`). Under CUDA graphs it warns what they do to
    those graphs (:func:`cuda_graph_caveat`)."""
    from torch._inductor import compile_fx, config

    def compile_graph(graph: torch.fx.GraphModule, inputs: Sequence[object], **kwargs: Any) -> Any:
        if not holds_transfers(graph):
            return compile_fx.compile_fx_inner(graph, inputs, **kwargs)
        caveat = cuda_graph_caveat(config)
        if caveat:
            warnings.warn(f"offload_pass: {caveat}", stacklevel=2)
        after_fusion = functools.partial(
            reloads_issued_where_placed, reload_op, config._post_fusion_custom_pass
        )
        with config.patch({**TRANSFER_GRAPH_SETTINGS, "_post_fusion_custom_pass": after_fusion}):
            return compile_fx.compile_fx_inner(graph, inputs, **kwargs)

    return compile_graph


def reloads_issued_where_placed(
    reload_op: object,
    earlier_pass: Callable[[list[Any]], list[Any]] | None,
    nodes: list[Any],
) -> list[Any]:
    """Inductor's scheduler nodes after fusion (``_post_fusion_custom_pass``, after
    ``earlier_pass``, one already set), with each call of ``reload_op`` moved back to
    right after the last node it reads: where the rewrite placed it, after the values in
    its ``after`` list.

    Fusion orders a fused kernel by its earliest node and runs everything it reads before
    it. A kernel that fuses a reduction planned early with work planned after a reload so
    pulls that work, and what it reads, ahead of the reload. The copy then starts only
    when compute reaches it, and the next kernels wait for all of it: in a block of Llama
    at 16k tokens, Inductor issued the reload of the first norm's output after the
    attention backward it was placed to run under, and each block's backward waited its
    whole 1.2 ms copy (docs/gpu-validation.md, run 184). Moving a reload earlier keeps the
    order valid: it stays after what it reads, and everything reading it followed it.
    Reloads keep their order among themselves, the order of their queue."""
    if earlier_pass is not None:
        nodes = list(earlier_pass(nodes))
    position = {name: i for i, node in enumerate(nodes) for name in node.get_buffer_names()}
    slot: dict[int, int] = {}  # each reload's index -> the index of the node it follows
    behind: dict[int, list[Any]] = {}
    floor = -1
    for i, node in enumerate(nodes):
        op = getattr(getattr(node, "node", None), "op_overload", None)
        if op is None or op is not reload_op:
            continue
        read = [position[d.name] for d in node.unmet_dependencies if d.name in position]
        floor = max([floor, *(slot.get(j, j) for j in read)])
        slot[i] = floor
        behind.setdefault(floor, []).append(node)
    placed = behind.get(-1, [])
    for i, node in enumerate(nodes):
        if i not in slot:
            placed += [node, *behind.get(i, [])]
    return placed


def cuda_graph_caveat(inductor_config: Any) -> str | None:
    """What CUDA graphs do to a graph that holds transfers under ``inductor_config``
    (``torch._inductor.config``), or None where they are off.

    The transfer ops cannot be captured. Without graph partitioning the whole graph then
    runs uncaptured. With it the rest is captured, but the reordering that minimizes
    partitions (a breadth-first order that runs every ready kernel before the next ops
    that cannot be captured) runs all compute that does not read a transfer's result
    first: in forward, nothing does, so every offload and its wait land after the last
    kernel. Switching that reordering off crashed CUDA graph trees on torch 2.11
    (docs/gpu-validation.md, run 45)."""
    if not inductor_config.triton.cudagraphs:
        return None
    if not captures_around_transfers(inductor_config):
        return (
            "CUDA graphs (torch.compile mode 'reduce-overhead' or 'max-autotune') are not "
            "captured for a graph "
            "that holds transfers without Inductor's graph_partition; Inductor runs that "
            "graph without them"
        )
    return (
        "under CUDA graphs (torch.compile mode 'reduce-overhead' or 'max-autotune'), "
        "Inductor captures a graph "
        "that holds transfers in partitions between them, reordered so that the transfers "
        "run after the compute that does not read them: copies do not overlap compute, so "
        "moving costs the full copy time"
    )


def captures_around_transfers(inductor_config: Any) -> bool:
    """Whether Inductor under ``inductor_config`` (``torch._inductor.config``) captures CUDA
    graphs in partitions around the ops it cannot capture, the transfers among them
    (:func:`cuda_graph_caveat` says what that does to the copies). Graph partitioning is
    a setting from torch 2.9 on; without it no graph holding transfers is captured."""
    return bool(
        inductor_config.triton.cudagraphs and getattr(inductor_config, "graph_partition", False)
    )


def inductor_captures_around_transfers() -> bool:
    """:func:`captures_around_transfers` under the Inductor settings in force: those of
    the compile in progress, where one is (``torch.compile``'s ``mode``, ``options``)."""
    from torch._inductor import config

    return captures_around_transfers(config)


def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def after_inductor_joint_passes(partition: PartitionFn) -> PartitionFn:
    """``partition`` after Inductor's joint-graph passes, as Inductor's own compile runs
    them before its partitioner: they rewrite patterns (a scatter into a constant becomes
    a pointwise ``where``, say), so the graphs planned are those Inductor compiles. They
    run under the trace's fake mode, or a new one, as in Inductor's compile (the pass that
    seeds random ops, dropout's, creates its seed tensor under it)."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    def partition_after_passes(
        joint: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        if config.use_joint_graph_passes:
            fake_mode = detect_fake_mode(joint_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
            with V.set_fake_mode(fake_mode):
                joint = joint_graph_passes(joint)
        return partition(joint, joint_inputs, **kwargs)

    return partition_after_passes


def compile_with_eager(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    partition: PartitionFn,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """AOTAutograd with ``partition``, running the rewritten graphs as plain FX code."""
    from functorch.compile import make_boxed_func

    def run_graph(graph: torch.fx.GraphModule, _: Sequence[object]) -> Any:
        return make_boxed_func(graph.forward)

    backend = aot_autograd(
        fw_compiler=run_graph,
        bw_compiler=run_graph,
        partition_fn=partition,
        decompositions=decompositions or {},
    )
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return backend(gm, example_inputs)


def lazy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` as a graph module that writes its Python code when first run or read, not
    at each ``recompile``: the pass edits graphs that Inductor compiles from the graph
    itself, and writing the code of a deep graph takes a third of a second."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule.from_graphmodule(gm)


def view_of_fakes(target: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """What view op ``target`` returns for fake tensors ``args``, sharing the input's
    storage. Where no size is symbolic, its C++ meta kernel runs as the fake mode runs
    one, and the results are made fake directly, without the mode's dispatch and cache or
    the Python dispatcher's meta functions: those took two thirds of the rewrite on deep
    graphs. Symbolic sizes go through the mode, which routes them to the Python meta
    functions that take them."""
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    base = args[0]
    mode = base.fake_mode
    symbolic = base._has_symbolic_sizes_strides or _holds_symint((args[1:], kwargs))
    if symbolic:
        with mode:
            return target(*args, **kwargs)
    with in_kernel_invocation_manager(mode), torch._C._DisablePythonDispatcher():
        out = target(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        return FakeTensor(mode, out, base.device)
    return type(out)(FakeTensor(mode, meta, base.device) for meta in out)


def _holds_symint(value: object) -> bool:
    """Whether a view op's other arguments (sizes, dimensions, lists of them) hold a
    symbolic size; ``pytree.tree_leaves`` answers the same, several times slower."""
    if isinstance(value, torch.SymInt):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_symint(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_symint(v) for v in value.values())
    return False


def call_on_fakes(target: Callable[..., Any], args: tuple) -> Any:
    """``target`` called on fake tensors ``args``, in the fake mode of the first."""
    with args[0].fake_mode:
        return target(*args)


def fake_from_meta(
    mode: Any, make_meta: Callable[[], torch.Tensor], device: torch.device
) -> torch.Tensor:
    """The tensor ``make_meta`` builds on the meta device, as a fake tensor on ``device``
    in fake mode ``mode``: what a factory call in that mode returns, without the trip
    through the mode's dispatch and cache. ``make_meta`` runs with no fake mode active
    (the partitioner runs inside the compile's), so that it builds a plain meta tensor."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    with unset_fake_temporarily():
        meta = make_meta()
    return FakeTensor(mode, meta, device)


def concrete_int(value: int | torch.SymInt) -> int | None:
    """``value`` as a plain int, from its hint when symbolic; None when it has none."""
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return None if hint is None else int(hint)
    return int(value)


_SOURCE = re.compile(r"^(?P<scope>[LG])\['(?P<name>[^']+)'\]$")


def root_modules_being_compiled() -> dict[str, torch.nn.Module]:
    """The modules Dynamo is tracing from, by source name (``L['self']``).

    Known only while Dynamo calls the backend; empty when this torch does not say.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError, AssertionError):
        return {}
    if tx is None:
        return {}
    scopes = {"L": getattr(tx, "f_locals", {}), "G": getattr(tx, "f_globals", {})}
    roots = {}
    for scope, values in scopes.items():
        for name, value in values.items():
            if isinstance(value, torch.nn.Module):
                roots[f"{scope}['{name}']"] = value
    return roots


def frame_code_being_compiled() -> types.CodeType | None:
    """The code object of the frame Dynamo is compiling, while it calls the backend."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError, AssertionError):
        return None
    return getattr(tx, "f_code", None) if tx is not None else None


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpointed
    region's forward runs again there)."""
    return torch._C._current_graph_task_id() != -1


def at_backward_end(callback: Callable[[], None]) -> None:
    """Have autograd's engine call ``callback`` once the backward running on this thread
    is done (call it from inside that backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def discard_compiled_code(code: types.CodeType) -> None:
    """Drop what Dynamo compiled for ``code``, so that its next call compiles again."""
    from torch._C._dynamo.eval_frame import reset_code

    reset_code(code)


def split_source_path(path: str) -> tuple[str, str]:
    """``"L['self'].blocks[0]"`` -> (``"L['self']"``, ``"blocks.0"``)."""
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    root, _, rest = path.partition(".")
    if _SOURCE.match(root) is None:
        return "", path
    return root, rest


def _stack_entries(node: torch.fx.Node) -> list[tuple[str, str, int | None, str]]:
    """(root source, path below it, id of the module or None, the module's class name),
    outermost first.

    Dynamo keys ``nn_module_stack`` by the id of each module it inlined.
    """
    stack = node.meta.get("nn_module_stack") or {}
    entries = []
    for key, (source, kind) in stack.items():
        root, path = split_source_path(source)
        module_id = int(key) if str(key).isdigit() else None
        entries.append((root, path, module_id, getattr(kind, "__qualname__", str(kind))))
    return entries


def module_stack(node: torch.fx.Node) -> tuple[tuple[str, int | None], ...]:
    """(path below the compiled root, id of the module or None), outermost first."""
    return tuple((path, module_id) for _, path, module_id, _ in _stack_entries(node))


def module_classes(node: torch.fx.Node) -> tuple[tuple[str, str], ...]:
    """(path below the compiled root, the module's class name), outermost first."""
    return tuple((path, kind) for _, path, _, kind in _stack_entries(node))


def module_stack_sources(node: torch.fx.Node) -> set[str]:
    return {root for root, _, _, _ in _stack_entries(node)}


def register_backend_name(name: str, compiler_fn: Callable[..., Any]) -> None:
    """Make ``torch.compile(backend=name)`` find ``compiler_fn`` (once per process)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if name not in _BACKENDS or _BACKENDS[name] is None:
        register_backend(compiler_fn=compiler_fn, name=name)


def is_aten_op(target: object) -> bool:
    """Whether a graph node's target is one overload of an ATen (or custom library) op."""
    return isinstance(target, torch._ops.OpOverload)


def inductor_splits_bias_add(node: torch.fx.Node) -> bool:
    """Whether Inductor's post-grad pattern ``unfuse_bias_add_to_pointwise`` splits
    ``node``, a biased product (``addmm``) as the graph stands, into a product and a bias
    add computed inside its uses. Asked of the pattern's own check (a GPU, every use
    pointwise, and on newer torch a bias-like input), with the rule that keeps products in
    half precision whole; False where the check cannot be asked."""
    from torch._inductor import config
    from torch._inductor.fx_passes import post_grad

    if node.target is not torch.ops.aten.addmm.default or node.kwargs or len(node.args) != 3:
        return False
    bias, mat1, mat2 = node.args
    match = types.SimpleNamespace(
        args=[mat1, mat2], kwargs={"inp": bias, "alpha": 1, "beta": 1}, output_node=lambda: node
    )
    try:
        prefers_split = bool(post_grad.should_prefer_unfused_addmm(match))
    except Exception:  # noqa: BLE001  (a torch whose check reads more than this match holds)
        return False
    half = bias.meta["val"].dtype in (torch.bfloat16, torch.float16)
    kept_whole = half and getattr(config, "keep_addmm_fused_for_half_dtypes", True)
    return prefers_split and not kept_whole


def is_view_op(target: object) -> bool:
    """Whether ``target`` is a view op: an overload with an input it aliases and none it
    writes (``unbind``'s list of views among them), as torch's own ``is_view`` says. Read
    off the overload rather than its schema: the stages ask it of every node, often."""
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def argument_names(op: Any) -> list[str]:
    """The names of an ATen op's arguments, in its schema's order."""
    return [argument.name for argument in op._schema.arguments]


def backend_names() -> list[str]:
    """Every name ``torch.compile(backend=...)`` accepts now, whatever its tags."""
    return torch._dynamo.list_backends(exclude_tags=())


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def grouped_mm_flops(
    mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    """FLOPs of ``aten._grouped_mm``: each output element is one dot product along the
    dimension the operands share. A 2-D operand's rows (or, 2-D by 2-D, the shared
    dimension) are split among the groups, so the work is that of one product over all
    of them: for ``(M, K)`` by ``(G, K, N)``, ``2 M K N``; for ``(G, M, K)`` by
    ``(K, N)``, whose columns are split, ``2 M K N``."""
    if mat_a.dim() == 3 and mat_b.dim() == 2:
        return 2 * mat_b.numel() * mat_a.shape[-2]
    return 2 * mat_a.numel() * mat_b.shape[-1]


def _flop_formulas(
    registry: dict[Any, Any] | None = None, grouped_heads: bool | None = None
) -> dict[Any, Callable[..., int]]:
    """torch's flop formulas (``registry``, default torch's own), plus its attention
    formulas for the CPU attention kernels where the registry lacks them, as torch
    before 2.15 does (so a graph traced on the CPU prices attention as the GPU kernels
    would); torch 2.15 registers the same formulas for them itself, which are kept. And
    one for the grouped product (``_grouped_mm``, a mixture of experts' projections),
    which no torch up to 2.15 counts; a registry's own is kept.

    torch before 2.13 counts attention only with as many key/value heads as query heads
    and raises on grouped-query attention (``grouped_heads``, default: probed on this
    torch); there the attention formulas see key and value broadcast to the query's heads,
    which is what the kernels compute."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    formulas = dict(flop_counter.flop_registry if registry is None else registry)
    for op, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", flop_counter.sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", flop_counter.sdpa_backward_flop),
    ):
        if hasattr(aten, op):
            formulas.setdefault(getattr(aten, op), formula)
    if hasattr(aten, "_grouped_mm"):
        formulas.setdefault(aten._grouped_mm, grouped_mm_flops)
    if grouped_heads is None:
        grouped_heads = _counts_grouped_heads(flop_counter.sdpa_flop_count)
    if not grouped_heads:
        for packet, formula in formulas.items():
            if str(packet).startswith("aten._scaled_dot_product_"):
                query_at = 1 if str(packet).endswith("_backward") else 0  # after grad_out
                formulas[packet] = _broadcasting_heads(formula, query_at)
    return formulas


def _counts_grouped_heads(sdpa_flop_count: Callable[..., int]) -> bool:
    try:
        sdpa_flop_count((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
    except AssertionError:
        return False
    return True


def _broadcasting_heads(formula: Callable[..., int], query_at: int) -> Callable[..., int]:
    """``formula`` with key and value given the query's head count; the kernel takes
    query, key and value in a row from argument ``query_at``."""

    def count(*args: Any, **kwargs: Any) -> int:
        query, key, value = args[query_at : query_at + 3]
        if key.shape[1] != query.shape[1]:
            heads = query.shape[1]
            key = key.new_empty((key.shape[0], heads, *key.shape[2:]))
            value = value.new_empty((value.shape[0], heads, *value.shape[2:]))
            args = (*args[:query_at], query, key, value, *args[query_at + 3 :])
        return formula(*args, **kwargs)

    return count


@dataclasses.dataclass(frozen=True)
class ComputedOp:
    """The ATen op a node computes, its arguments (nodes and constants, as the graph
    holds them) and the value the op itself returns."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    value: Any


_RANDOM_STATE_WRAPPERS = {
    "run_and_save_rng_state": 0,
    "run_with_rng_state": 1,
    "graphsafe_run_with_rng_state": 0,
}
"""Torch's higher-order ops that run an ATen op under a saved random-number state, as the
partitioner writes an op it computes again in backward that draws random numbers: the
place of the op among their arguments."""


def computed_op(node: torch.fx.Node) -> ComputedOp:
    """What ``node`` computes: its own target, or the op a random-state wrapper runs
    (``run_and_save_rng_state`` returns the state beside the op's value)."""
    name = getattr(node.target, "__name__", None)
    value = node.meta.get("val")
    at = _RANDOM_STATE_WRAPPERS.get(name) if isinstance(name, str) else None
    if at is None or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return ComputedOp(node.target, tuple(node.args), dict(node.kwargs), value)
    kwargs = {k: v for k, v in node.kwargs.items() if k != "rng_state"}
    if name == "run_and_save_rng_state" and isinstance(value, tuple):
        value = value[1]
    return ComputedOp(node.args[at], tuple(node.args[at + 1 :]), kwargs, value)


def is_saved_random_state(node: torch.fx.Node) -> bool:
    """Whether ``node`` is the generator state ``run_and_save_rng_state`` saves in forward
    for backward to draw the same numbers again from."""
    if node.target is not operator.getitem or node.args[1] != 0:
        return False
    wrapper = node.args[0]
    return isinstance(wrapper, torch.fx.Node) and (
        getattr(wrapper.target, "__name__", None) == "run_and_save_rng_state"
    )


def flop_count(node: torch.fx.Node) -> int:
    """FLOPs of one ATen node, or of the op a random-state wrapper runs
    (:func:`computed_op`), by torch's flop formulas on its fake values; 0 if none."""
    op = computed_op(node)
    if not isinstance(op.target, torch._ops.OpOverload):
        return 0
    formula = _FLOP_FORMULAS.get(op.target.overloadpacket)
    if formula is None:
        return 0
    args, kwargs = torch.fx.node.map_arg((op.args, op.kwargs), lambda n: n.meta.get("val"))
    return concrete_int(formula(*args, **kwargs, out_val=op.value)) or 0


_FLOP_FORMULAS = _flop_formulas()


def register_log_name(name: str) -> None:
    """Let ``TORCH_LOGS=<name>`` turn on the ``logging`` logger ``name``, where this torch
    offers it; plain ``logging`` configuration works everywhere."""
    try:
        from torch._logging._internal import log_registry, register_log
    except ImportError:
        return
    if name not in log_registry.log_alias_to_log_qnames:
        register_log(name, name)


def cuda_allocation_trace(step: Callable[[], None], device: int) -> list[dict[str, Any]]:
    """The CUDA caching allocator's alloc and free events during ``step``, each with the
    Python frames that made it (innermost first)."""
    from torch.cuda import memory

    memory._record_memory_history("all", context="all", stacks="python", device=device)
    try:
        already = len(memory._snapshot(device)["device_traces"][device])
        step()
        torch.cuda.synchronize(device)
        return memory._snapshot(device)["device_traces"][device][already:]
    finally:
        memory._record_memory_history(None, device=device)


def inductor_caches_forced_off() -> bool:
    """Whether Inductor's caches are forced off (``force_disable_caches``, also set by
    ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``)."""
    from torch._inductor import config

    return bool(config.force_disable_caches)


@contextlib.contextmanager
def outside_compile() -> Iterator[None]:
    """A context in which new tensors are real and ops dispatch as in training, though a
    compile is under way (the partitioner runs inside its fake mode, with the Python
    dispatcher on, which makes each op call cost the host about twice as much): for
    measuring kernels and the transfer ops."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch._C._DisablePythonDispatcher():
        yield


def current_stream(device_index: int) -> torch.cuda.Stream:
    """The current CUDA stream of device ``device_index``: ``torch.cuda.current_stream``
    without its device lookup and a new ``Stream`` built on every call, which cost each
    transfer op several microseconds of host time."""
    return _stream(*torch._C._cuda_getCurrentStream(device_index))


@functools.lru_cache(maxsize=64)
def _stream(stream_id: int, device_index: int, device_type: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(
        stream_id=stream_id, device_index=device_index, device_type=device_type
    )


def spin_device(device: torch.device, cycles: int) -> None:
    """Keep ``device``'s current stream busy for about ``cycles`` clock cycles, so that
    work the host queues meanwhile is timed on the device without the host's launch
    latency."""
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)
