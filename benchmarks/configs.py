"""The configurations compared: no offload, the peers, and offload_pass.

Each configuration turns a fresh model into a forward function (the loss of one batch);
the harness runs backward itself. A configuration that cannot run on this machine raises
:class:`Unavailable`, and the harness records why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

import offload_pass
from benchmarks.workloads import WithLoss

Forward = Callable[[torch.Tensor], torch.Tensor]
MEGATRON_ATTENTION = ("attn_norm", "qkv_linear", "core_attn", "attn_proj")
MEGATRON_ALL = (*MEGATRON_ATTENTION, "mlp_norm")  # every dense-layer choice of offload_modules


class Unavailable(RuntimeError):
    """This configuration cannot run here (a missing package, no CUDA device)."""


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    family: str
    prepare: Callable[[nn.Module, dict[str, Any]], Forward]
    cuda_only: bool = False


def _compiled(model: nn.Module, **compile_kwargs: Any) -> Forward:
    return torch.compile(WithLoss(model), **compile_kwargs)


def _under(context: Callable[[], contextlib.AbstractContextManager], forward: Forward) -> Forward:
    def run(x: torch.Tensor) -> torch.Tensor:
        with context():
            return forward(x)

    return run


def eager(model: nn.Module, shared: dict[str, Any]) -> Forward:
    return WithLoss(model)


def compiled(model: nn.Module, shared: dict[str, Any]) -> Forward:
    return _compiled(model)


def save_on_cpu(model: nn.Module, shared: dict[str, Any]) -> Forward:
    return _under(lambda: torch.autograd.graph.save_on_cpu(pin_memory=True), eager(model, shared))


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _checkpoint_each_block(model: nn.Module) -> nn.Module:
    model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    return model


def checkpoint_blocks(model: nn.Module, shared: dict[str, Any]) -> Forward:
    return _compiled(_checkpoint_each_block(model))


def checkpointed_ours(**options: Any) -> Callable[[nn.Module, dict[str, Any]], Forward]:
    """Blocks checkpointed, and the pass moving what they save (their inputs): the way
    save_on_cpu and torchtune reach their low peaks, with the copies off the compute
    stream. Named "checkpoint blocks, ...", so that the targets do not count it against
    checkpointing alone (``compare._builds_on``)."""

    def prepare(model: nn.Module, shared: dict[str, Any]) -> Forward:
        return ours(**options)(_checkpoint_each_block(model), shared)

    return prepare


def memory_budget_partitioner(budget: float) -> Callable[[nn.Module, dict[str, Any]], Forward]:
    def prepare(model: nn.Module, shared: dict[str, Any]) -> Forward:
        return _under(
            lambda: torch._functorch.config.patch(activation_memory_budget=budget),
            _compiled(model),
        )

    return prepare


def _mark_for_builtin_offload(names: set[str]) -> Callable[..., torch.fx.GraphModule]:
    """A ``joint_custom_pass`` marking the joint-graph nodes ``names`` (the activations
    offload_pass moved) for PyTorch's own offloading; matrix products if none match."""
    products = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def mark(joint: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        nodes = [n for n in joint.graph.nodes if n.name in names]
        if not nodes:
            nodes = [n for n in joint.graph.nodes if n.target in products]
        for node in nodes:
            node.meta["should_offload"] = True
        return joint

    return mark


def builtin_offload(streams: bool) -> Callable[[nn.Module, dict[str, Any]], Forward]:
    def prepare(model: nn.Module, shared: dict[str, Any]) -> Forward:
        flags = {
            "enable_activation_offloading": True,
            "joint_custom_pass": _mark_for_builtin_offload(shared.get("moved_names", set())),
        }
        if streams:
            flags |= {
                "activation_offload_separate_stream": True,
                "activation_offload_sink_wait": True,
                "activation_reload_prefetch": True,
            }
        return _under(lambda: torch._functorch.config.patch(**flags), _compiled(model))

    return prepare


def _torchtune_offloading() -> type:
    try:
        from torchtune.training import OffloadActivations
    except ImportError as error:
        raise Unavailable(f"torchtune does not import here: {error}") from error
    return OffloadActivations


def megatron_core(offload: tuple[str, ...]) -> Callable[[nn.Module, dict[str, Any]], Forward]:
    def prepare(model: nn.Module, shared: dict[str, Any]) -> Forward:
        from benchmarks.megatron import megatron_forward

        return megatron_forward(model, offload)

    return prepare


def _no_offload_fraction(model: nn.Module, shared: dict[str, Any]) -> Forward:
    raise Unavailable(
        "not run: megatron-core 0.16.1, the newest release in the package index, has no "
        "activation_offload_fraction; its offload_modules rows are the nearest it offers"
    )


def torchtune_offload(model: nn.Module, shared: dict[str, Any]) -> Forward:
    offload_activations = _torchtune_offloading()
    return _under(lambda: offload_activations(use_streams=True), eager(model, shared))


def ours(**options: Any) -> Callable[[nn.Module, dict[str, Any]], Forward]:
    def prepare(model: nn.Module, shared: dict[str, Any]) -> Forward:
        backend = offload_pass.backend(**options)
        shared["backend"] = backend
        return _compiled(model, backend=backend)

    return prepare


def fitted_step(task: nn.Module, target_bytes: int, shared: dict[str, Any]) -> Forward:
    """``task`` (a module returning the loss) compiled with offload_pass under a
    ``memory_budget`` fitted to the measured peak (:func:`offload_pass.fit_memory_budget`):
    the first call runs the trials on its batch, each a compiling step and then one step
    whose peak is measured (as the harness measures its target, after the compiling one),
    and keeps the chosen trial's compiled step, so the trials' compiles count in the first
    step's time. Where a later trial ran after the chosen one, the chosen budget is
    compiled afresh under a new backend: the old one would plan its recompile beside its
    first plan, and the harness sums a backend's plans."""
    latest: dict[int, tuple[Forward, offload_pass.OffloadBackend]] = {}  # the last trial's
    kept: list[Forward] = []

    def compiled_at(budget: int) -> tuple[Forward, offload_pass.OffloadBackend]:
        torch.compiler.reset()
        backend = offload_pass.backend(memory_budget=budget)
        return torch.compile(task, backend=backend), backend

    def run_at(budget: int, batch: Any) -> int:
        step, backend = compiled_at(budget)

        def train_step() -> None:
            step(batch).backward()
            task.zero_grad(set_to_none=True)

        latest.clear()
        latest[budget] = step, backend
        train_step()  # compiles
        return offload_pass.cuda_peak(train_step)

    def forward(batch: Any) -> torch.Tensor:
        if not kept:
            fit = offload_pass.fit_memory_budget(lambda b: run_at(b, batch), target_bytes)
            print(f"fitted budget: {fit}", flush=True)
            step, backend = latest.get(fit.planned_bytes) or compiled_at(fit.planned_bytes)
            shared["backend"] = backend
            kept.append(step)
        return kept[0](batch)

    return forward


def fitted_ours(target_bytes: int) -> Callable[[nn.Module, dict[str, Any]], Forward]:
    def prepare(model: nn.Module, shared: dict[str, Any]) -> Forward:
        return fitted_step(WithLoss(model), target_bytes, shared)

    return prepare


def our_configs(budgets: tuple[float, ...]) -> list[Config]:
    configs = [Config("offload_pass auto", "offload_pass", ours())]
    configs += [
        Config(f"offload_pass fraction {f:g}", "offload_pass", ours(fraction=f))
        for f in (0.0, 0.25, 0.5, 0.75, 1.0)
    ]
    configs += [
        Config(f"offload_pass budget {b:g}", "offload_pass", ours(memory_budget=b)) for b in budgets
    ]
    configs += [
        Config(f"offload_pass auto, recompute {r:g}", "offload_pass", ours(recompute_budget=r))
        for r in (0.7, 0.5)
    ]
    search = ours(recompute_budget="search")
    configs.append(Config("offload_pass auto, recompute search", "offload_pass", search))
    return configs


def budget_configs(gib: str) -> tuple[Config, Config]:
    """offload_pass under a budget of ``gib`` GiB (a positive number, named as written), as
    planned and fitted to the measured peak."""
    target = round(float(gib) * 2**30)
    if target <= 0:
        raise ValueError(f"a budget in GiB must be positive, got {gib!r}")
    return (
        Config(f"offload_pass budget {gib} GiB", "offload_pass", ours(memory_budget=target)),
        Config(
            f"offload_pass budget {gib} GiB, fitted",
            "offload_pass",
            fitted_ours(target),
            cuda_only=True,
        ),
    )


_BUDGET_IN_GIB = re.compile(r"offload_pass budget (\d+(?:\.\d+)?) GiB(?:, fitted)?")


def named(names: Sequence[str]) -> list[Config]:
    """The configurations called ``names``, in that order (all of :func:`all_configs`
    when ``names`` is empty); ``"offload_pass budget <x> GiB"`` and its ``", fitted"``
    form name a budget of any size. Raises ``ValueError`` naming what is unknown."""
    known = all_configs()
    budgets = {m.group(1) for m in map(_BUDGET_IN_GIB.fullmatch, names) if m is not None}
    by_name = {c.name: c for gib in budgets for c in budget_configs(gib)}
    by_name.update((c.name, c) for c in known)
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(
            f"unknown configurations {unknown}; known: {sorted(by_name)}, and "
            "'offload_pass budget <x> GiB' with or without ', fitted'"
        )
    return [by_name[name] for name in dict.fromkeys(names)] if names else known


def all_configs() -> list[Config]:
    return [
        Config("eager", "no offload", eager),
        Config("compiled", "no offload", compiled),
        *our_configs(budgets=(0.7, 0.6, 0.5)),
        # checkpointing's peaks as budgets in bytes (W1: runs 17 and 56; W2: run 17)
        *(config for gib in ("7.35", "12.45") for config in budget_configs(gib)),
        Config("save_on_cpu", "save_on_cpu", save_on_cpu, cuda_only=True),
        Config("checkpoint blocks", "checkpointing", checkpoint_blocks),
        Config("checkpoint blocks, offload_pass auto", "offload_pass", checkpointed_ours()),
        Config(
            "checkpoint blocks, offload_pass fraction 1",
            "offload_pass",
            checkpointed_ours(fraction=1.0),
        ),
        *(
            Config(f"memory_budget {b:g}", "memory_budget", memory_budget_partitioner(b))
            for b in (0.7, 0.5, 0.3)
        ),
        Config("builtin sync", "builtin offload", builtin_offload(streams=False), cuda_only=True),
        Config("builtin streams", "builtin offload", builtin_offload(streams=True), cuda_only=True),
        Config("torchtune streams", "torchtune", torchtune_offload, cuda_only=True),
        Config("megatron-core", "megatron-core", megatron_core(())),
        Config(
            "megatron-core offload attention",
            "megatron-core",
            megatron_core(MEGATRON_ATTENTION),
            cuda_only=True,
        ),
        Config(
            "megatron-core offload all",
            "megatron-core",
            megatron_core(MEGATRON_ALL),
            cuda_only=True,
        ),
        Config("megatron-core fraction 0.5", "megatron-core", _no_offload_fraction, cuda_only=True),
    ]
