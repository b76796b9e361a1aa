"""What the host issues in a compiled step, against what the cost model counts: each zoo
model (and the small decoder stack at a few depths) compiled whole at fraction 0 (nothing
moves, the stock graph), its kernels per step on the device (a profiler trace), the calls
in the code Inductor generated for it by kind, those launching work in each pass beside
the launches the cost model counts there, the host's time to issue a step (the device
held busy, ``measure.host_seconds``, and drained before forward and before backward as
the host clock samples it, ``measure.drained_host_seconds``), each pass's time on the
device issued to an idle device and queued behind a head start
(``measure.pass_device_seconds``: their difference is the device waiting for the host),
and the plan's launches and predicted host time, passes and step.
With ``--out``, the generated code and the table as JSON are written there.

    python -m benchmarks.kernel_count [--models mixtral llama gpt2 vit_b16] [--stacks 4 8]

CUDA only. A library call can launch several kernels (cuBLAS's split-K reductions,
cuDNN's attention), so the device's count is an upper bound of the host's launches.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import tabulate
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

import offload_pass
from benchmarks import workloads, zoo
from benchmarks.measure import (
    HEAD_START_CYCLES,
    drained_host_seconds,
    host_seconds,
    pass_device_seconds,
)

WARMUP_STEPS = 4
TIMED_STEPS = 7

CALL_KINDS = {
    "triton": re.compile(r"^\s*\w+\.run\("),
    "extern": re.compile(r"extern_kernels\.\w+\("),
    "aten": re.compile(r"^\s*(\w+ = )?torch\.ops\.aten\.\w+"),
    "allocations": re.compile(r"empty_strided\w*\("),
    "reinterprets": re.compile(r"reinterpret_tensor\("),
    "asserts": re.compile(r"assert_(size_stride|alignment)\("),
}
"""Host-side calls in the code Inductor generates, by kind, as its wrapper spells them."""


LAUNCHING_KINDS = ("triton", "extern", "aten")
"""The kinds of call that launch work on the device."""


def _call_body(code: str) -> str:
    return code.partition("def call(")[2].partition("\ndef ")[0]


def calls_in_code(code: str) -> collections.Counter:
    """Calls of each kind in the generated module's ``call`` function."""
    return collections.Counter(
        kind
        for line in _call_body(code).splitlines()
        for kind, call in CALL_KINDS.items()
        if call.search(line)
    )


def launches_by_pass(codes: list[str]) -> dict[str, int]:
    """The calls launching device work (:data:`LAUNCHING_KINDS`) in the generated
    modules, summed by pass: a backward module's ``call`` takes the tangents (as
    AOTAutograd names the gradients flowing in), a forward's does not."""
    launches = {"forward": 0, "backward": 0}
    for code in codes:
        calls = calls_in_code(code)
        phase = "backward" if "tangents_" in _call_body(code) else "forward"
        launches[phase] += sum(calls[kind] for kind in LAUNCHING_KINDS)
    return launches


def stack_task(layers: int) -> Callable[[torch.device], tuple[nn.Module, torch.Tensor]]:
    """The small decoder stack at ``layers`` blocks, with its loss."""

    def build(device: torch.device) -> tuple[nn.Module, torch.Tensor]:
        stack, x = workloads.build(dataclasses.replace(workloads.TINY, layers=layers), device)
        return workloads.WithLoss(stack), x

    return build


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


def _median_ms(samples: list, field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples) * 1e3


def count(name: str, build, device: torch.device, code_dir: Path | None) -> dict[str, object]:
    torch.compiler.reset()
    task, batch = build(device)
    backend = offload_pass.backend(fraction=0.0)
    forward = torch.compile(task, backend=backend)

    def timed(measure) -> list:
        values = []
        for _ in range(TIMED_STEPS):
            values.append(measure(forward, batch))
            task.zero_grad(set_to_none=True)
        return [v for v in values if v is not None] or [float("nan")]

    _, codes = run_and_get_code(lambda: forward(batch).backward())
    task.zero_grad(set_to_none=True)
    for _ in range(WARMUP_STEPS):
        forward(batch).backward()
        task.zero_grad(set_to_none=True)
    hosts = timed(lambda f, b: host_seconds(f, b, device))
    drained = timed(drained_host_seconds)
    idle = timed(lambda f, b: pass_device_seconds(f, b, 0))
    queued = timed(lambda f, b: pass_device_seconds(f, b, HEAD_START_CYCLES))
    host, step = statistics.median(hosts), statistics.median(timed(step_seconds))
    kinds = device_work(forward, batch)
    task.zero_grad(set_to_none=True)
    if code_dir is not None:
        for i, code in enumerate(codes):
            (code_dir / f"{name}_{i}.py").write_text(code)
    calls = sum((calls_in_code(c) for c in codes), collections.Counter())
    code_launches = launches_by_pass(codes)
    plans = backend.plans
    launches = sum(p.costs.launches for p in plans)
    forward_launches = sum(sum(p.costs.forward_launches) for p in plans)
    predicted_forward = sum(p.prediction.forward_seconds for p in plans)
    predicted_step = sum(p.prediction.step_seconds for p in plans)
    graph_inputs = sum(
        n.op == "placeholder" for p in plans for g in (p.forward, p.backward) for n in g.graph.nodes
    )
    return {
        "model": name,
        "chunks": len(plans),
        "launches counted": launches,
        "fwd launches counted": forward_launches,
        "bwd launches counted": launches - forward_launches,
        "fwd launches in code": code_launches["forward"],
        "bwd launches in code": code_launches["backward"],
        **{f"code {kind}": calls[kind] for kind in CALL_KINDS},
        "graph inputs": graph_inputs,
        "device kernels": kinds["kernel"],
        "memsets": kinds["memset"],
        "host ms": host * 1e3,
        "host ms min": min(hosts) * 1e3,
        "host ms max": max(hosts) * 1e3,
        "drained host ms": statistics.median(drained) * 1e3,
        "drained host ms min": min(drained) * 1e3,
        "drained host ms max": max(drained) * 1e3,
        "pred host ms": sum(p.prediction.host_seconds for p in plans) * 1e3,
        "fwd ms idle": _median_ms(idle, "forward"),
        "fwd ms queued": _median_ms(queued, "forward"),
        "pred fwd ms": predicted_forward * 1e3,
        "bwd ms idle": _median_ms(idle, "backward"),
        "bwd ms queued": _median_ms(queued, "backward"),
        "pred bwd ms": (predicted_step - predicted_forward) * 1e3,
        "step ms": step * 1e3,
        "pred step ms": predicted_step * 1e3,
        "host us per launch counted": host / launches * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mixtral", "llama", "gpt2", "vit_b16"])
    parser.add_argument("--stacks", nargs="*", type=int, default=[], help="stack depths")
    parser.add_argument("--out", type=Path, help="where the code and the JSON table go")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    code_dir = args.out / "code" if args.out else None
    if code_dir is not None:
        code_dir.mkdir(parents=True, exist_ok=True)
    tasks = {name: zoo.MODELS[name].build for name in args.models}
    tasks |= {f"stack{layers}": stack_task(layers) for layers in args.stacks}
    rows = []
    for name, build in tasks.items():
        rows.append(count(name, build, torch.device("cuda"), code_dir))
        print(tabulate.tabulate(rows[-1:], headers="keys", floatfmt=".2f"), flush=True)
    print(tabulate.tabulate(rows, headers="keys", floatfmt=".2f"))
    if args.out:
        (args.out / "kernel_count.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
