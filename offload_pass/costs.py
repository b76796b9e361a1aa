"""Cost model: what each node of a chunk takes in time, and when its memory is held.

A node's duration is the larger of its FLOPs over the device's matrix rate and the bytes
it reads and writes over the memory bandwidth; on a CUDA device present, matrix
products, convolutions and attention are timed on it instead (timing.py). Pointwise
ops and reductions fuse into their neighbours, as Inductor fuses them: a value that only
fusible ops read is never written to memory, and costs neither bytes nor memory; each
kernel that reads it computes it again, so what it is computed from is read there.
Each node whose result is written to memory is computed by a kernel the host issues, and
fusible ones computed together share one (``graphs.fused_kernels``).
Memory is tracked per storage: allocated where it is produced, freed after its last read
in forward or backward, except where a fused kernel writes its result into an input it
reads for the last time; the chunk's inputs (parameters, the batch) are resident
throughout, forward's outputs are held until forward returns (the caller drops them
before backward, which takes their gradients), and backward's outputs (gradients) are
kept to the end. An op with several results writes them all where it runs, beside its
inputs. A fused attention's backward also holds float32 accumulators while it runs
(``ATTENTION_BACKWARD_ACCUMULATORS``). Positions run over forward's nodes, then
backward's.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
from collections.abc import Sequence

import torch
import torch.fx

from offload_pass import _compat
from offload_pass.graphs import (
    ChunkGraphs,
    aliases,
    consumers,
    fused_kernels,
    is_fusible,
    is_view,
    keeps_element_order,
    kernels_reading,
    materializes,
    storage_root,
    tensor_bytes,
    tensor_values,
)
from offload_pass.profiles import DeviceProfile
from offload_pass.timing import NodeTimer, SettledTimer

ATTENTION_BACKWARD_ACCUMULATORS: dict[str, int] = {
    "_scaled_dot_product_cudnn_attention_backward": 1,
    "_scaled_dot_product_efficient_attention_backward": 1,
    "_scaled_dot_product_flash_attention_backward": 2,
}
"""Float32 copies of the query's gradient each CUDA attention backward holds while it
runs (its accumulator), beside a float32 statistic per query row. Measured on an H100
(torch 2.11, docs/gpu-validation.md, run 167): beyond its three gradients, each held
exactly that at five shapes, from (4, 12, 197, 64) to (1, 32, 16384, 128). The CPU's
kernel is not among them: the CPU's memory is not the device's."""


@dataclasses.dataclass(frozen=True)
class ReuseHold:
    """A buffer Inductor's wrapper keeps in its pool after its last read, from after
    position ``freed_at`` until the allocation at ``reused_at`` takes it over."""

    freed_at: int
    reused_at: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ChunkCosts:
    """Per position: seconds of each forward and backward node, and kernels the host
    issues there (``forward_launches``/``backward_launches``, 0 or 1); bytes
    ``allocated`` when it runs and ``freed`` after it. ``returned_bytes``: what forward
    returns that backward does not read, freed where forward returns but held between
    forward and backward by the caller where other forwards are in flight (a pipeline
    stage's outputs kept for their backward, a block's output the next block saves).
    ``backward_inputs``: backward's leading placeholders. ``forward_names``/
    ``backward_names``: the node at each position. ``kernel_slowdown``: what the kernels
    timed on the device were scaled by, their chunk's settled slowdown (1 where none was
    timed so). ``reuse_holds``: where Inductor's buffer reuse keeps a buffer longer than
    ``freed`` says; it is on only in graphs that hold no transfers
    (``_compat.TRANSFER_GRAPH_SETTINGS``)."""

    profile: DeviceProfile
    forward_seconds: tuple[float, ...]
    backward_seconds: tuple[float, ...]
    forward_launches: tuple[int, ...]
    backward_launches: tuple[int, ...]
    resident_bytes: int
    allocated: tuple[int, ...]
    freed: tuple[int, ...]
    backward_inputs: int
    forward_names: tuple[str, ...] = ()
    backward_names: tuple[str, ...] = ()
    kernel_slowdown: float = 1.0
    returned_bytes: int = 0
    reuse_holds: tuple[ReuseHold, ...] = ()

    @property
    def num_forward(self) -> int:
        return len(self.forward_seconds)

    @property
    def launches(self) -> int:
        """Kernels the host issues in one step of the chunk."""
        return sum(self.forward_launches) + sum(self.backward_launches)

    def offload_seconds(self, nbytes: int) -> float:
        return nbytes / self.profile.device_to_host

    def reload_seconds(self, nbytes: int) -> float:
        return nbytes / self.profile.host_to_device


def node_seconds(
    node: torch.fx.Node, profile: DeviceProfile, timer: NodeTimer | None = None
) -> float:
    """The node's measured time where ``timer`` gives one (the nodes with FLOPs, on the
    device present), else the larger of its FLOPs and its traffic over the rates."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return 0.0
    flops = _compat.flop_count(node)
    measured = timer(node) if timer is not None and flops else None
    if measured is not None:
        return measured
    value = node.meta.get("val")
    read = (arg for arg in node.all_input_nodes if materializes(storage_root(arg)))
    traffic = sum(tensor_bytes(arg.meta.get("val")) for arg in read)
    if materializes(node):
        traffic += sum(tensor_bytes(v) for v in tensor_values(value))
    return max(
        flops / profile.matrix_rate(_computed_dtype(node)), traffic / profile.memory_bandwidth
    )


def _computed_dtype(node: torch.fx.Node) -> torch.dtype:
    """The dtype ``node`` computes in: its op's value's, else (the partitioner leaves the
    random-state wrappers it writes without one) its first tensor argument's."""
    op = _compat.computed_op(node)
    inputs = (a.meta.get("val") for a in op.args if isinstance(a, torch.fx.Node))
    values = itertools.chain(tensor_values(op.value), *(tensor_values(v) for v in inputs))
    return next((v.dtype for v in values), torch.float32)


def kernel_seconds(
    nodes: Sequence[torch.fx.Node],
    kernels: dict[torch.fx.Node, torch.fx.Node],
    profile: DeviceProfile,
    timer: NodeTimer | None = None,
) -> tuple[float, ...]:
    """Each node's device seconds (:func:`node_seconds`), a kernel taking no less than
    the profile's ``kernel_floor_seconds``: what its nodes leave short of the floor is
    counted at its first node, where the host issues it (``kernels``:
    ``graphs.fused_kernels`` of ``nodes``)."""
    seconds = [node_seconds(n, profile, timer) for n in nodes]
    per_kernel: dict[torch.fx.Node, float] = collections.defaultdict(float)
    for node, s in zip(nodes, seconds, strict=True):
        if node in kernels:
            per_kernel[kernels[node]] += s
    floor = profile.kernel_floor_seconds
    return tuple(
        s + max(0.0, floor - per_kernel[n]) if kernels.get(n) is n else s
        for n, s in zip(nodes, seconds, strict=True)
    )


def kernel_launches(
    nodes: Sequence[torch.fx.Node], kernels: dict[torch.fx.Node, torch.fx.Node] | None = None
) -> tuple[int, ...]:
    """Kernels the host issues at each node: one at the first node of each kernel, as the
    generated code fuses them (``kernels``: ``graphs.fused_kernels`` of ``nodes``)."""
    kernels = fused_kernels(nodes) if kernels is None else kernels
    return tuple(int(kernels.get(n) is n) for n in nodes)


def estimate_costs(
    chunk: ChunkGraphs, profile: DeviceProfile, timer: NodeTimer | None = None
) -> ChunkCosts:
    forward = list(chunk.forward.graph.nodes)
    backward = list(chunk.backward.graph.nodes)
    kernels = {**fused_kernels(forward), **fused_kernels(backward)}
    allocated, freed, returned_bytes, holds = _memory_events(chunk, forward, backward, kernels)
    return ChunkCosts(
        profile=profile,
        forward_seconds=kernel_seconds(forward, kernels, profile, timer),
        backward_seconds=kernel_seconds(backward, kernels, profile, timer),
        forward_launches=kernel_launches(forward, kernels),
        backward_launches=kernel_launches(backward, kernels),
        resident_bytes=sum(
            tensor_bytes(n.meta.get("val")) for n in forward if n.op == "placeholder"
        ),
        allocated=allocated,
        freed=freed,
        backward_inputs=sum(n.op == "placeholder" for n in backward),
        forward_names=tuple(n.name for n in forward),
        backward_names=tuple(n.name for n in backward),
        kernel_slowdown=timer.slowdown if isinstance(timer, SettledTimer) else 1.0,
        returned_bytes=returned_bytes,
        reuse_holds=holds,
    )


def _memory_events(
    chunk: ChunkGraphs,
    forward: list[torch.fx.Node],
    backward: list[torch.fx.Node],
    fused: dict[torch.fx.Node, torch.fx.Node],
) -> tuple[tuple[int, ...], tuple[int, ...], int, tuple[ReuseHold, ...]]:
    """Bytes allocated at each position, bytes freed after it, the bytes forward returns
    that backward does not read, and the buffers Inductor's reuse would hold longer
    (``fused``: the first node of the kernel writing each value, ``graphs.fused_kernels``)."""
    received = chunk.saved_values_by_input()
    position = {n: i for i, n in enumerate(itertools.chain(forward, backward))}
    user_outputs = set(chunk.user_outputs())

    def storage(node: torch.fx.Node) -> torch.fx.Node | None:
        root = storage_root(node)
        if root.op == "placeholder" and root in position and position[root] >= len(forward):
            root = storage_root(received[root]) if root in received else root
        return None if root.op == "placeholder" and position[root] < len(forward) else root

    kernels: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}
    kernel_at = _kernel_positions(fused, position)

    def runs_at(node: torch.fx.Node) -> int:
        if node in kernel_at:
            return kernel_at[node]
        source = node.args[0] if node.target is operator.getitem else None
        if isinstance(source, torch.fx.Node) and source.op == "call_function":
            return runs_at(source)  # one result of an op that writes them all at once
        return position[node]

    def read_at(node: torch.fx.Node) -> int:
        """Where ``node`` reads its inputs: a fused node in each kernel it feeds."""
        return max((runs_at(k) for k in kernels_reading(node, kernels)), default=position[node])

    start: dict[torch.fx.Node, int] = {}
    last_use: dict[torch.fx.Node, int] = {}
    for node in itertools.chain(forward, backward):
        root = storage(node)
        if root is not None and root is node and materializes(node):
            start[node] = runs_at(node)
        for arg in node.all_input_nodes:
            used = storage(arg)
            if used is None or (node is forward[-1] and arg not in user_outputs):
                continue  # a saved value lives until backward's last read of it
            # what forward returns lives until it returns, the caller dropping it before
            # backward (docs/design.md); backward's results live to the end
            last_use[used] = max(last_use.get(used, 0), read_at(node))

    for root, at in start.items():  # a reader placed before the kernel runs after it
        last_use[root] = max(at, last_use.get(root, at))
    allocated = [0] * len(position)
    freed = [0] * len(position)
    for root, at in start.items():
        nbytes = tensor_bytes(root.meta.get("val"))
        allocated[at] += nbytes
        freed[last_use[root]] += nbytes
    for node, at in position.items():
        nbytes = workspace_bytes(node)
        allocated[at] += nbytes
        freed[at] += nbytes
    # A kernel may write into a storage the step allocated, a saved value among them
    # (AOTAutograd donates those to backward), but not into backward's other inputs (the
    # tangents are the caller's), into what forward returns (not donated), or into a saved
    # value backward receives through a view that reorders its elements.
    returned = {r for r in map(storage, user_outputs) if r in start}
    tangents = {n for n in backward if n.op == "placeholder" and n not in received}
    reordered = {storage(v) for v in received.values() if not keeps_element_order(v)}
    not_donated = tangents | returned | reordered
    dying: dict[int, list[torch.fx.Node]] = {}  # the storages each position reads last
    for root, at in last_use.items():
        if root in start and root not in not_donated:
            dying.setdefault(at, []).append(root)
    received_as: dict[torch.fx.Node, tuple[torch.fx.Node, ...]] = {}
    for given in received:
        received_as[storage(given)] = (*received_as.get(storage(given), ()), given)

    def read_through(donor: torch.fx.Node, at: int) -> tuple[torch.fx.Node, ...]:
        """The nodes of the graph running at ``at`` that hold ``donor``: backward reads a
        saved value through the inputs that receive it."""
        return received_as.get(donor, (donor,)) if at >= len(forward) else (donor,)

    in_place: dict[torch.fx.Node, torch.fx.Node] = {}  # each writer, and its donor
    taken: set[torch.fx.Node] = set()
    for root, at in start.items():
        # not one the kernel writes, nor one another writer took
        dead = (d for d in dying.get(at, ()) if start[d] < at and d not in taken)
        donors = (d for d in dead if _writes_in_place(root, d, read_through(d, at), fused, kernels))
        donor = next(donors, None)
        if donor is not None:
            nbytes = tensor_bytes(root.meta.get("val"))
            allocated[at] -= nbytes
            freed[at] -= nbytes
            in_place[root] = donor
            taken.add(donor)
    holds = _reuse_holds(start, last_use, len(forward), in_place)
    unread = (r for r in returned if last_use[r] == len(forward) - 1)  # by backward
    returned_bytes = sum(tensor_bytes(r.meta.get("val")) for r in unread)
    return tuple(allocated), tuple(freed), returned_bytes, holds


def workspace_bytes(node: torch.fx.Node) -> int:
    """What ``node``'s kernel holds only while it runs: a CUDA attention backward's
    float32 accumulators (``ATTENTION_BACKWARD_ACCUMULATORS``); 0 for other nodes."""
    target = node.target
    name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    copies = ATTENTION_BACKWARD_ACCUMULATORS.get(name, 0)
    query = node.args[1].meta.get("val") if copies else None
    if not isinstance(query, torch.Tensor):
        return 0
    rows = query.numel() // query.shape[-1]
    return 4 * (copies * query.numel() + rows)


def _kernel_positions(
    fused: dict[torch.fx.Node, torch.fx.Node], position: dict[torch.fx.Node, int]
) -> dict[torch.fx.Node, int]:
    """Where the kernel writing each fused node runs: at its last node, once every input
    of every value it writes is there (values fused side by side, one before a matrix
    product the other waits for, are both written after it), but before a kernel that
    cannot fuse reads one of its values, where every input is there by then (an
    activation computed again beside its gradient is written before the product of the
    weight's gradient that reads it, and held through it)."""
    inputs_at = _inputs_written_at(position, fused)
    last: dict[torch.fx.Node, int] = {}
    ready: dict[torch.fx.Node, int] = {}
    first_read: dict[torch.fx.Node, int] = {}
    for node, kernel in fused.items():
        last[kernel] = max(last.get(kernel, 0), position[node])
        ready[kernel] = max(ready.get(kernel, 0), inputs_at[node])
        unfused_reads = [
            position[r] for r in consumers(node) if r.op == "call_function" and not is_fusible(r)
        ]
        first_read[kernel] = min([first_read.get(kernel, len(position)), *unfused_reads])
    runs = {k: _run_position(last[k], ready[k], first_read[k] - 1) for k in last}
    return {node: runs[kernel] for node, kernel in fused.items()}


def _run_position(last: int, ready: int, before_first_read: int) -> int:
    """A kernel's position: just before a kernel that cannot fuse reads one of its
    values, where that is before its last node and its inputs are there, else its last."""
    return before_first_read if ready <= before_first_read < last else last


def _inputs_written_at(
    position: dict[torch.fx.Node, int], fused: dict[torch.fx.Node, torch.fx.Node]
) -> dict[torch.fx.Node, int]:
    """For each node (``position``'s keys, in order), the position of the last value in
    memory that computing it reads: through the views and fused values it reads, down to
    written values and inputs."""
    at: dict[torch.fx.Node, int] = {}
    for node in position:
        at[node] = max(
            (
                position[read] if read in fused or read.op == "placeholder" else at[read]
                for read in node.all_input_nodes
            ),
            default=0,
        )
    return at


def _reuse_holds(
    start: dict[torch.fx.Node, int],
    last_use: dict[torch.fx.Node, int],
    num_forward: int,
    in_place: dict[torch.fx.Node, torch.fx.Node],
) -> tuple[ReuseHold, ...]:
    """Storages Inductor keeps after their last read for a later buffer of the same
    dtype and size to take over (its wrapper's buffer reuse: a freed buffer goes to a
    pool, and the next allocation of its dtype and size in the same program takes the one
    freed last). Only tensors a program allocates and frees itself are pooled (forward
    and backward are programs of their own), not those a kernel wrote into in place
    (``in_place``: each writer and its donor), which pass their memory on already."""
    donors = set(in_place.values())
    events = []
    for root, at in start.items():
        value = root.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        key = (at < num_forward, value.dtype, tensor_bytes(value))
        if root not in in_place:
            events.append((at, False, key))
        dies = last_use[root]
        if root not in donors and (at < num_forward) == (dies < num_forward):
            events.append((dies, True, key))
    pools: dict[tuple[bool, torch.dtype, int], list[int]] = {}  # where each was freed
    held = []
    for at, freeing, key in sorted(events, key=lambda e: (e[0], e[1])):
        pool = pools.setdefault(key, [])
        if freeing:
            pool.append(at)
        elif pool:
            held.append(ReuseHold(pool.pop(), at, key[2]))
    return tuple(held)


def _writes_in_place(
    node: torch.fx.Node,
    donor: torch.fx.Node,
    read_as: tuple[torch.fx.Node, ...],
    fused: dict[torch.fx.Node, torch.fx.Node],
    kernels: dict[torch.fx.Node, frozenset[torch.fx.Node]],
) -> bool:
    """Whether Inductor computes ``node`` into ``donor``'s storage, which ``node``'s
    kernel reads for the last time (its scheduler's ``decide_inplace_update``), where
    ``node``'s graph holds it as ``read_as`` (``donor`` itself, or backward's inputs that
    receive it): ``node`` is a fused kernel's result (pointwise, or a reduction's last
    loop) as many elements of the same dtype as ``donor``; it reads ``donor``, only where
    it writes, through views that keep the order of its elements; and no other result of
    its kernel reads ``donor``. A cross-entropy's logits gradient takes over the saved
    logits so, and a residual add the matrix product it adds."""
    value, given = node.meta.get("val"), donor.meta.get("val")
    if not (
        is_fusible(node)
        and isinstance(value, torch.Tensor)
        and isinstance(given, torch.Tensor)
        and donor is not node
        and given.dtype == value.dtype
        and tensor_bytes(given) == tensor_bytes(value)
    ):
        return False
    kernel = fused.get(node, node)
    reads = False
    for alias in (a for held in read_as for a in aliases(held)):
        for user in alias.users:
            if is_view(user) and user.args[0] is alias:
                continue
            readers = kernels_reading(user, kernels)
            if any(r is not node and fused.get(r, r) is kernel for r in readers):
                return False
            if node in readers and not keeps_element_order(alias):
                return False
            reads = reads or node in readers
    return reads
