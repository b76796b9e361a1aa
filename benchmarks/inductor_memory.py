"""The memory of Inductor's generated CPU code, beside the cost model's predicted peaks:
a CPU check of what the cost model assumes Inductor fuses.

    python -m benchmarks.inductor_memory --workload W1 --recompute-budget 0.7
    python -m benchmarks.inductor_memory --workload W2 --fraction auto
    python -m benchmarks.inductor_memory --zoo qwen2_gqa

The workload (W1 unless ``--workload`` names another; ``--layers`` blocks if given), or a
model-zoo architecture at ``ZOO_SIZES`` in bf16 (``--zoo``), is planned on the CPU with
the H200 profile, moving nothing unless ``--fraction`` says so. The wrapper code of
forward and of backward is generated as the backend compiles it (kernels compiled, not
run) and read in order: parameters and the batch are resident, backward's saved tensors
are freed where the code deletes their last alias, buffers and reloads are allocated and
freed where the code says; host buffers do not count. Forward's outputs (what it saves)
stay. Inductor's CPU code fuses a little differently from its GPU code, so this is a lead.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

import offload_pass
from benchmarks import workloads, zoo
from offload_pass import _compat, ops
from offload_pass.costs import ChunkCosts
from offload_pass.simulate import MemoryTimeline
from offload_pass.units import format_bytes

_ALLOCATION = re.compile(r"\s*(buf\d+) = empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")
_REUSE = re.compile(r"\s*(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b.*; del \2\s+# reuse")
_RELOAD = re.compile(r"\s*(buf\d+) = torch\.ops\.offload_pass\.reload\.default\(\[([\w, ]+)\],")
_RELOAD_WAIT = re.compile(r"\s*(buf\d+) = torch\.ops\.offload_pass\.reload_wait\.default\((\w+),")
_ALIAS = re.compile(r"\s*(buf\d+) = (buf\d+)$")
_ITEM = re.compile(r"\s*(buf\d+) = (buf\d+)\[(\d+)\]$")
_DELETE = re.compile(r"\bdel (\w+)")
_UNPACK = re.compile(r"\s*(\w+(?:, \w+)*),? = args$")


@dataclasses.dataclass(frozen=True)
class CodePeak:
    """Predicted and generated-code peaks of one graph; ``at_line``: the code's line at
    its peak."""

    predicted_bytes: int
    code_bytes: int
    at_line: str


def generated_code(gm: torch.fx.GraphModule, is_backward: bool) -> str:
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    with detect_fake_mode(inputs):
        compile_graph = _compat.inductor_graph_compiler(ops.holds_transfers, ops.RELOAD)
        return compile_graph(gm, inputs, is_backward=is_backward).source_code


def code_input_names(code: str, gm: torch.fx.GraphModule) -> dict[str, str]:
    """Each placeholder's name in the generated code, which unpacks its arguments in
    placeholder order under names of its own where the compile renamed the graph's."""
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    for line in code.splitlines():
        if unpack := _UNPACK.match(line):
            return dict(zip(placeholders, unpack.group(1).split(", "), strict=True))
    return {name: name for name in placeholders}


def code_peak(
    code: str, resident: int, saved: dict[str, torch.Tensor], host: Mapping[str, int]
) -> tuple[int, str]:
    """The most the code holds at once: ``resident`` bytes, the ``saved`` inputs until the
    code deletes every alias of each storage, its own buffers, and what it reloads from
    the ``host`` inputs (their bytes by name): held by the reload's ticket from the reload
    on, then by the list its reload_wait returns, then each by the tensor taken from it."""
    owner: dict[str, StorageWeakRef] = {}
    names: dict[StorageWeakRef, set[str]] = {}
    live: dict[object, int] = {}
    for name, value in saved.items():
        ref = StorageWeakRef(value.untyped_storage())
        owner[name] = ref
        names.setdefault(ref, set()).add(name)
        live[ref] = value.untyped_storage().nbytes()
    total = peak = resident + sum(live.values())
    at = "start"
    reloaded: dict[str, list[int]] = {}  # each ticket's, then list's, bytes per tensor
    for line in code.splitlines():
        item = _ITEM.match(line)
        if item and item.group(2) in reloaded:
            nbytes = reloaded[item.group(2)][int(item.group(3))]
            live[item.group(2)] -= nbytes
            live[item.group(1)] = nbytes
            continue
        if reuse := _REUSE.match(line) or _ALIAS.match(line) or _RELOAD_WAIT.match(line):
            live[reuse.group(1)] = live.pop(reuse.group(2), 0)
            if reuse.group(2) in reloaded:
                reloaded[reuse.group(1)] = reloaded.pop(reuse.group(2))
            continue
        if reload := _RELOAD.match(line):
            reloaded[reload.group(1)] = [host[name] for name in reload.group(2).split(", ")]
            live[reload.group(1)] = sum(reloaded[reload.group(1)])
            total += live[reload.group(1)]
        if allocation := _ALLOCATION.match(line):
            numel = 1
            for size in filter(str.strip, allocation.group(2).split(",")):
                numel *= int(size)
            dtype = getattr(torch, allocation.group(3))
            live[allocation.group(1)] = numel * dtype.itemsize
            total += live[allocation.group(1)]
        for name in _DELETE.findall(line):
            key = owner.get(name, name)
            aliases = names.get(key)
            if aliases is not None:
                aliases.discard(name)
                if aliases:
                    continue
            total -= live.pop(key, 0)
        if total > peak:
            peak, at = total, line.strip()
    return peak, at


ZOO_SIZES = zoo.Sizes(512, 2, 8, 2, 1408, 32000, 2, 1024)
"""A zoo language model small enough to compile on a CPU in a minute, with a real
vocabulary: the logits' buffers are what the peak is made of."""


def _predicted_forward_peak(costs: ChunkCosts) -> int:
    """The most the cost model holds in forward, nothing moved."""
    timeline = MemoryTimeline(costs, ())
    return timeline.resident + timeline.live.max(0, costs.num_forward)


def measure(
    model: torch.nn.Module, inputs: Sequence[object], **options: object
) -> tuple[CodePeak, CodePeak]:
    """Forward's and backward's peaks, predicted and in Inductor's CPU code, planned with
    the backend ``options``."""
    report = offload_pass.explain(model, *inputs, profile="h200", **options)
    (plan,) = report.plans
    resident = plan.costs.resident_bytes  # forward's inputs: parameters and the batch
    forward_peak, forward_at = code_peak(generated_code(plan.forward, False), resident, {}, {})
    backward_inputs = [
        n
        for n in plan.backward.graph.find_nodes(op="placeholder")
        if not n.name.startswith("primals")
    ]
    reloaded = {n for n in backward_inputs if any(u.target is ops.RELOAD for u in n.users)}
    code = generated_code(plan.backward, True)
    named = code_input_names(code, plan.backward)
    saved = {named[n.name]: n.meta["val"] for n in backward_inputs if n not in reloaded}
    host = {named[n.name]: n.meta["val"].untyped_storage().nbytes() for n in reloaded}
    backward_peak, backward_at = code_peak(code, resident, saved, host)
    return (
        CodePeak(_predicted_forward_peak(plan.costs), forward_peak, forward_at),
        CodePeak(plan.prediction.peak_bytes, backward_peak, backward_at),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(workloads.BY_NAME), default="W1")
    parser.add_argument("--zoo", choices=sorted(zoo.MODELS), help="a zoo model instead")
    parser.add_argument("--layers", type=int, help="blocks (default: the workload's)")
    parser.add_argument("--recompute-budget", type=float)
    parser.add_argument(
        "--fraction", default="0", help="share of each module's candidates to move, or auto"
    )
    parser.add_argument(
        "--memory-budget-gib", type=float, help="plan for this budget instead of a fraction"
    )
    args = parser.parse_args(argv)
    options: dict[str, object] = {"recompute_budget": args.recompute_budget}
    if args.memory_budget_gib is not None:
        options["memory_budget"] = round(args.memory_budget_gib * 2**30)
    elif args.fraction != "auto":
        options["fraction"] = float(args.fraction)
    if args.zoo:
        sizes = dataclasses.replace(ZOO_SIZES, layers=args.layers or ZOO_SIZES.layers)
        torch.manual_seed(0)
        built = zoo.MODELS[args.zoo]
        task, batch = built.task(
            built.make(sizes).to(torch.bfloat16), sizes, torch.device("cpu"), torch.bfloat16
        )
        name, inputs = f"{args.zoo} (bf16, {sizes.layers} layers)", (task, (batch,))
    else:
        workload = workloads.BY_NAME[args.workload]
        workload = dataclasses.replace(workload, layers=args.layers or workload.layers)
        model, x = workloads.build(workload, "cpu")
        name, inputs = (
            f"{workload.name}, {workload.layers} layers",
            (workloads.WithLoss(model), (x,)),
        )
    forward, backward = measure(*inputs, **options)
    print(f"{name}, {', '.join(f'{k} {v}' for k, v in options.items())}:")
    for graph, peak in (("forward", forward), ("backward", backward)):
        print(
            f"  {graph}: predicted peak {format_bytes(peak.predicted_bytes)}, Inductor's CPU "
            f"code {format_bytes(peak.code_bytes)} (at `{peak.at_line[:90]}`)"
        )


if __name__ == "__main__":
    main()
