"""Where a step's device time goes, by kind of kernel, beside what the cost model predicts
for each kind (CUDA only): matrix products, attention, and everything else (Inductor's
fused kernels), for the step with nothing moved (``fraction=0``). It shows which kind of
work a wrong step prediction misprices.

    python -m benchmarks.step_breakdown --workload W1
    python -m benchmarks.step_breakdown --model llama gpt2   # models of benchmarks/zoo.py
"""

from __future__ import annotations

import argparse
import collections
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import tabulate
import torch

import offload_pass
from benchmarks import workloads, zoo
from offload_pass.plan import Plan

WARM_UP_STEPS = 2
PRODUCT_TARGETS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_grouped_mm",
    "convolution",
    "convolution_backward",
)
PRODUCT_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "conv", "wgrad", "dgrad")
ATTENTION_KERNELS = ("flash", "fmha", "cudnn", "attention", "sdpa")


def node_kind(target: object) -> str:
    name = getattr(target, "__name__", str(target)).split(".")[0]
    if "scaled_dot_product" in name:
        return "attention"
    return "products" if name in PRODUCT_TARGETS else "other"


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if "memcpy" in lowered or "memset" in lowered:
        return "copies"
    if any(k in lowered for k in ATTENTION_KERNELS):
        return "attention"
    return "products" if any(k in lowered for k in PRODUCT_KERNELS) else "other"


def predicted_by_kind(plans: Iterable[Plan]) -> dict[str, float]:
    """Seconds of each kind of node, as the cost model prices them."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for plan in plans:
        graphs = (plan.forward, plan.backward)
        names = (plan.costs.forward_names, plan.costs.backward_names)
        times = (plan.costs.forward_seconds, plan.costs.backward_seconds)
        for graph, graph_names, graph_times in zip(graphs, names, times, strict=True):
            target = {n.name: n.target for n in graph.graph.nodes}
            for name, t in zip(graph_names, graph_times, strict=True):
                seconds[node_kind(target.get(name))] += t
    return seconds


def measured_by_kind(profile: torch.profiler.profile) -> tuple[dict[str, float], list[str]]:
    """Seconds of each kind of kernel in the profiled step, and the names taken as other
    (so that a misread name shows)."""
    seconds: dict[str, float] = collections.defaultdict(float)
    other: collections.Counter[str] = collections.Counter()
    for event in profile.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = kernel_kind(event.name)
        seconds[kind] += event.device_time_total / 1e6
        if kind == "other":
            other[event.name[:60]] += 1
    return seconds, [f"{n} x{c}" for n, c in other.most_common(8)]


def _workload_task(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    model, x = workloads.build(workloads.BY_NAME[name], "cuda")
    return workloads.WithLoss(model), x


def breakdown(name: str, build: Callable[[], tuple[torch.nn.Module, Any]]) -> str:
    """The table for the task ``build`` makes: a module that returns the loss, and its
    input."""
    torch.compiler.reset()
    torch.manual_seed(0)
    task, x = build()
    backend = offload_pass.backend(fraction=0.0)
    compiled = torch.compile(task, backend=backend)

    start, forward_end, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))

    def step() -> None:
        start.record()
        loss = compiled(x)
        forward_end.record()
        loss.backward()
        end.record()
        task.zero_grad(set_to_none=True)

    for _ in range(WARM_UP_STEPS):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        step()
        torch.cuda.synchronize()
    predicted = predicted_by_kind(backend.plans)
    measured, other_names = measured_by_kind(profile)
    rows = [
        [kind, measured.get(kind, 0.0) * 1e3, predicted.get(kind, 0.0) * 1e3]
        for kind in ("products", "attention", "other", "copies")
    ]
    rows.append(["sum", sum(measured.values()) * 1e3, sum(predicted.values()) * 1e3])
    predictions = [p.prediction for p in backend.plans]
    forward_ms = sum(p.forward_seconds for p in predictions) * 1e3
    rows.append(["forward", start.elapsed_time(forward_end), forward_ms])
    rows.append(["step", start.elapsed_time(end), sum(p.step_seconds for p in predictions) * 1e3])
    table = tabulate.tabulate(rows, headers=["kind", "measured ms", "predicted ms"], floatfmt=".1f")
    slowdowns = ", ".join(f"{p.costs.kernel_slowdown:.3f}" for p in backend.plans)
    return (
        f"## {name}\n{table}\ntimed kernels scaled by each chunk's settled slowdown "
        f"({slowdowns}); kernels taken as other: {', '.join(other_names)}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=[], choices=sorted(workloads.BY_NAME))
    parser.add_argument("--model", nargs="+", default=[], choices=sorted(zoo.MODELS))
    args = parser.parse_args(argv)
    if not args.workload and not args.model:
        args.workload = ["W1"]
    tasks = [(name, functools.partial(_workload_task, name)) for name in args.workload]
    device = torch.device("cuda")
    tasks += [(name, functools.partial(zoo.MODELS[name].build, device)) for name in args.model]
    for name, build in tasks:
        print(breakdown(name, build), flush=True)


if __name__ == "__main__":
    main()
