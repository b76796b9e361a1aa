"""Where a step's device time goes, by kind of kernel, beside what the cost model predicts
for each kind (CUDA only): matrix products, attention, and everything else (Inductor's
fused kernels), for the step with nothing moved (``fraction=0``). It shows which kind of
work a wrong step prediction misprices.

    python -m benchmarks.step_breakdown --workload W1
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterable, Sequence

import tabulate
import torch

import offload_pass
from benchmarks import workloads
from offload_pass.plan import Plan
from offload_pass.timing import sustained_slowdown

WARM_UP_STEPS = 2
PRODUCT_TARGETS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward")
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


def breakdown(workload: workloads.Workload) -> str:
    torch.compiler.reset()
    torch.manual_seed(0)
    model, x = workloads.build(workload, "cuda")
    backend = offload_pass.backend(fraction=0.0)
    compiled = torch.compile(workloads.WithLoss(model), backend=backend)

    def step() -> None:
        compiled(x).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(WARM_UP_STEPS):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    predicted = predicted_by_kind(backend.plans)
    measured, other_names = measured_by_kind(profile)
    rows = [
        [kind, measured.get(kind, 0.0) * 1e3, predicted.get(kind, 0.0) * 1e3]
        for kind in ("products", "attention", "other", "copies")
    ]
    rows.append(["sum", sum(measured.values()) * 1e3, sum(predicted.values()) * 1e3])
    step_ms = start.elapsed_time(end)
    predicted_step = sum(p.prediction.step_seconds for p in backend.plans) * 1e3
    rows.append(["step", step_ms, predicted_step])
    table = tabulate.tabulate(rows, headers=["kind", "measured ms", "predicted ms"], floatfmt=".1f")
    slowdown = sustained_slowdown(torch.device("cuda", torch.cuda.current_device()))
    return (
        f"## {workload.name}\n{table}\ntimed kernels scaled by the sustained slowdown "
        f"{slowdown:.3f}; kernels taken as other: {', '.join(other_names)}\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["W1"], choices=sorted(workloads.BY_NAME))
    args = parser.parse_args(argv)
    for name in args.workload:
        print(breakdown(workloads.BY_NAME[name]), flush=True)


if __name__ == "__main__":
    main()
