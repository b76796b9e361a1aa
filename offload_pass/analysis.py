"""Analyse: find the saved activations of a partitioned chunk and which of them may move.

Saved values that are views of one storage form one group: the storage crosses PCIe
once, and backward re-derives each view from the reloaded storage.
"""

from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx

from offload_pass import _compat
from offload_pass.graphs import (
    ChunkGraphs,
    aliases,
    kernels_reading,
    storage_root,
    view_chain,
)
from offload_pass.layout import is_dense
from offload_pass.symbolic import SymbolSources

# Why a saved group cannot move at all (the planner adds its own reasons).
INPUT_ALIAS = "input or parameter"
USER_OUTPUT = "user output"
NON_DENSE = "non-dense layout"
NOT_REPLAYABLE = "view not replayable"
NO_SIZE_HINT = "unknown size"
EMPTY = "empty"
SCALAR = "scalar"
UNSUPPORTED_DEVICE = "unsupported device"
NOT_IN_BACKWARD = "not a backward input"
RANDOM_STATE = "random-number state"


@dataclasses.dataclass(frozen=True)
class SavedGroup:
    """One storage that forward saves for backward, and the saved values viewing it.

    ``forward_readers``: the nodes whose kernels read the storage in forward (a fused
    reader counts as the first node written to memory that it feeds);
    ``last_forward_use`` is the position of the last of them.
    """

    root: str
    members: tuple[str, ...]
    module_stack: tuple[tuple[str, int | None], ...]
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    produced_at: int
    last_forward_use: int
    forward_readers: tuple[str, ...]
    first_backward_use: int
    fixed_reason: str | None

    @property
    def module_path(self) -> str:
        return self.module_stack[-1][0] if self.module_stack else ""


def is_replayable(chain: tuple[torch.fx.Node, ...], sources: SymbolSources) -> bool:
    """Each view takes constants besides its input, or sizes backward can compute, so
    backward can apply it again."""
    return all(sources.can_derive((node.args[1:], node.kwargs)) for node in chain)


def _fixed_reason(
    root: torch.fx.Node,
    members: list[torch.fx.Node],
    user_outputs: set[torch.fx.Node],
    bw_inputs: dict[torch.fx.Node, torch.fx.Node],
    size_inputs: dict[sympy.Expr, torch.fx.Node],
) -> str | None:
    value = root.meta.get("val")
    if any(m not in bw_inputs or not bw_inputs[m].users for m in members):
        return NOT_IN_BACKWARD
    if root.op == "placeholder" or not isinstance(value, torch.Tensor):
        return INPUT_ALIAS
    if _compat.is_saved_random_state(root):
        # Inductor hands the saved state over as a real tensor, not a fake one, so no op
        # of the pass may take it; a few KiB, it frees nothing worth a copy.
        return RANDOM_STATE
    if any(alias in user_outputs for alias in aliases(root)):
        return USER_OUTPUT
    if value.device.type not in ("cuda", "cpu"):
        return UNSUPPORTED_DEVICE
    numel = _compat.concrete_int(value.numel())
    if numel is None:
        return NO_SIZE_HINT
    if numel == 0:
        return EMPTY
    if value.dim() == 0:
        # Some kernels return their scalars on the host whatever the traced device says
        # (CUDA attention's RNG seed and offset), and a scalar frees nothing worth a copy.
        return SCALAR
    if not is_dense(value):
        return NON_DENSE
    sources = SymbolSources.of(size_inputs, value)
    if not all(is_replayable(view_chain(m), sources) for m in members):
        return NOT_REPLAYABLE
    return None


def _op_name(node: torch.fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return f"{_op_name(node.args[0])}[{node.args[1]}]"
    return str(node.target)


def _forward_readers(
    root: torch.fx.Node,
    index: dict[torch.fx.Node, int],
    known: dict[torch.fx.Node, frozenset[torch.fx.Node]],
) -> list[torch.fx.Node]:
    readers = {
        k
        for a in aliases(root)
        for u in a.users
        if u.op != "output"
        for k in kernels_reading(u, known)
    }
    return sorted((r for r in readers if r.op != "output"), key=index.__getitem__)


def find_saved_groups(chunk: ChunkGraphs) -> tuple[SavedGroup, ...]:
    fw_index = {n: i for i, n in enumerate(chunk.forward.graph.nodes)}
    bw_index = {n: i for i, n in enumerate(chunk.backward.graph.nodes)}
    bw_inputs = chunk.backward_inputs()
    size_inputs = SymbolSources.inputs_of(chunk.backward.graph)
    user_outputs = set(chunk.user_outputs())

    by_root: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for value in dict.fromkeys(chunk.saved_values()):
        if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            by_root.setdefault(storage_root(value), []).append(value)

    groups = []
    kernels: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}
    for root, members in by_root.items():
        val = root.meta["val"]
        readers = [u for m in members if m in bw_inputs for u in bw_inputs[m].users]
        readers_fw = _forward_readers(root, fw_index, kernels)
        numel = _compat.concrete_int(val.numel()) if isinstance(val, torch.Tensor) else 0
        groups.append(
            SavedGroup(
                root=root.name,
                members=tuple(m.name for m in members),
                module_stack=_compat.module_stack(root),
                op=_op_name(root),
                shape=tuple(_compat.concrete_int(s) or 0 for s in val.shape),
                dtype=val.dtype,
                nbytes=(numel or 0) * val.element_size(),
                produced_at=fw_index[root],
                last_forward_use=max([fw_index[root], *(fw_index[r] for r in readers_fw)]),
                forward_readers=tuple(r.name for r in readers_fw),
                first_backward_use=min((bw_index[r] for r in readers), default=len(bw_index)),
                fixed_reason=_fixed_reason(root, members, user_outputs, bw_inputs, size_inputs),
            )
        )
    return tuple(sorted(groups, key=lambda g: g.produced_at))
