"""Plan a model without training it: compile, partition, plan and rewrite each chunk, but
run none of the model's kernels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from offload_pass import _compat
from offload_pass.backend import OffloadBackend
from offload_pass.options import OffloadOptions
from offload_pass.report import ModelReport


def _stand_ins(gm: torch.fx.GraphModule) -> Callable[..., tuple[Any, ...]]:
    """A function returning zeros shaped like the graph's outputs, in place of running it."""
    outputs = gm.graph.output_node().args[0]
    values = [
        node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node
        for node in outputs
    ]

    def stand_in(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            shape = [_compat.concrete_int(s) for s in value.shape]
            if None in shape:
                raise ValueError(f"explain needs output sizes it can know; got {value.shape}")
            return torch.zeros(shape, dtype=value.dtype, device=value.device)
        if isinstance(value, torch.SymInt):
            return _compat.concrete_int(value)
        return value

    return lambda *args: tuple(stand_in(v) for v in values)


class _PlanOnly:
    def __init__(self, backend: OffloadBackend) -> None:
        self.backend = backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable:
        """Partition and plan as the chosen compiler would (Inductor decomposes ops and
        runs its joint-graph passes first)."""
        partitioner = self.backend.partitioner_for(gm)
        partition_as_compiled(gm, example_inputs, partitioner, self.backend.options.compiler)
        return _stand_ins(gm)


def partition_as_compiled(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[object],
    partition: _compat.PartitionFn,
    compiler: str,
) -> Callable[..., Any]:
    """AOTAutograd with ``partition`` on the joint graph ``compiler`` would split:
    Inductor's, after its decompositions and joint-graph passes, where ``"inductor"``;
    the graphs themselves run as plain FX code."""
    if compiler == "inductor":
        decompositions = _compat.inductor_decompositions()
        after_passes = _compat.after_inductor_joint_passes(partition)
        return _compat.compile_with_eager(gm, example_inputs, after_passes, decompositions)
    return _compat.compile_with_eager(gm, example_inputs, partition)


def explain(model: torch.nn.Module, *example_inputs: Any, **backend_options: Any) -> ModelReport:
    """The plans ``offload_pass.backend(**backend_options)`` would make for ``model``.

    Compiles ``model`` on ``example_inputs`` and plans every chunk, without running the
    model: each chunk's outputs are stand-in zeros, so code between graph breaks runs on
    them. Inputs on the CPU plan for the device ``profile`` names (``"h200"``, say), so a
    model meant for a GPU can be planned before one is at hand.
    """
    backend = OffloadBackend(OffloadOptions(**backend_options))
    torch.compile(model, backend=_PlanOnly(backend))(*example_inputs)
    return ModelReport(tuple(backend.plans))
