"""What the host issues in a compiled step, against what the cost model counts: each zoo
model compiled whole at fraction 0 (nothing moves, the stock graph), its kernels per step
on the device (a profiler trace), the host's time to issue a step (the device held busy,
``measure.host_seconds``), and the plan's launches and predicted host time and step.

    python -m benchmarks.kernel_count [--models mixtral llama gpt2 vit_b16]

CUDA only. A library call can launch several kernels (cuBLAS's split-K reductions,
cuDNN's attention), so the device's count is an upper bound of the host's launches.
"""

from __future__ import annotations

import argparse
import collections
import statistics

import tabulate
import torch
from torch.profiler import ProfilerActivity, profile

import offload_pass
from benchmarks import zoo
from benchmarks.measure import host_seconds

WARMUP_STEPS = 4
TIMED_STEPS = 5


def device_work(forward, batch) -> collections.Counter:
    """Kernels, copies and memsets one step runs on the device."""
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        forward(batch).backward()
        torch.cuda.synchronize()
    kinds: collections.Counter = collections.Counter()
    for event in trace.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name
            kinds["memcpy" if "Memcpy" in name else "memset" if "Memset" in name else "kernel"] += 1
    return kinds


def step_seconds(forward, batch) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    forward(batch).backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def count(name: str, device: torch.device) -> dict[str, object]:
    torch.compiler.reset()
    task, batch = zoo.MODELS[name].build(device)
    backend = offload_pass.backend(fraction=0.0)
    forward = torch.compile(task, backend=backend)

    def timed(measure):
        values = []
        for _ in range(TIMED_STEPS):
            values.append(measure(forward, batch))
            task.zero_grad(set_to_none=True)
        measured = [v for v in values if v is not None]
        return statistics.median(measured) if measured else float("nan")

    for _ in range(WARMUP_STEPS):
        forward(batch).backward()
        task.zero_grad(set_to_none=True)
    host, step = timed(lambda f, b: host_seconds(f, b, device)), timed(step_seconds)
    kinds = device_work(forward, batch)
    task.zero_grad(set_to_none=True)
    plans = backend.plans
    launches = sum(p.costs.launches for p in plans)
    return {
        "model": name,
        "chunks": len(plans),
        "launches counted": launches,
        "device kernels": kinds["kernel"],
        "memsets": kinds["memset"],
        "host ms": host * 1e3,
        "pred host ms": sum(p.prediction.host_seconds for p in plans) * 1e3,
        "step ms": step * 1e3,
        "pred step ms": sum(p.prediction.step_seconds for p in plans) * 1e3,
        "host us per launch counted": host / launches * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mixtral", "llama", "gpt2", "vit_b16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows = [count(name, torch.device("cuda")) for name in args.models]
    print(tabulate.tabulate(rows, headers="keys", floatfmt=".2f"))


if __name__ == "__main__":
    main()
