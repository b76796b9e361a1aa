"""What a memory budget's plan predicts on each split the joint search may try: the
stock partition, then the partitioner recomputing more (``offload_pass.joint``), each
planned for the same budget in bytes, and the split the search keeps (a level, blocks
checkpointed, or values recomputed one by one). Nothing runs (``offload_pass.explain``):
on the CPU the plans use the H200 profile; with ``--device cuda`` they use the device's
own trace (its attention kernels) and measured rates. With ``--zoo`` the model is that
model-zoo architecture at its GPU size, in bf16, on the device given.

    python -m benchmarks.recompute_levels --workload W1 --budget-gib 7.35
    python -m benchmarks.recompute_levels --zoo llama --budget-gib 2.77
"""

from __future__ import annotations

import argparse

import tabulate
import torch

import offload_pass
from benchmarks import workloads, zoo
from offload_pass.joint import RECOMPUTE_LEVELS

GiB = 2**30
MiB = 2**20


def planned(
    task: torch.nn.Module, x: object, device: torch.device, **options: object
) -> dict[str, object]:
    torch.compiler.reset()
    profile = "h200" if device.type == "cpu" else None
    (plan,) = offload_pass.explain(task, x, profile=profile, **options).plans
    p = plan.prediction
    return {
        "split": plan.split_name,
        "peak MiB, nothing moved": p.baseline_peak_bytes / MiB,
        "peak MiB": p.peak_bytes / MiB,
        "over budget MiB": plan.planned.budget_shortfall / MiB,
        "step ms, nothing moved": p.baseline_seconds * 1e3,
        "step ms": p.step_seconds * 1e3,
        "saved MiB": plan.bytes_saved_for_backward / MiB,
        "moved MiB": plan.bytes_moved / MiB,
    }


def _task(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, object]:
    if args.zoo is None:
        model, x = workloads.build(workloads.BY_NAME[args.workload], args.device)
        return workloads.WithLoss(model), x
    built = zoo.MODELS[args.zoo]
    model = built.make(built.gpu).to(device=device, dtype=torch.bfloat16)
    return built.task(model, built.gpu, device, torch.bfloat16)


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1", choices=list(workloads.BY_NAME))
    parser.add_argument("--budget-gib", type=float, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--zoo", choices=sorted(zoo.MODELS), help="a model-zoo architecture instead of --workload"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    task, x = _task(args, device)
    budget = int(args.budget_gib * GiB)
    rows = [
        planned(task, x, device, memory_budget=budget, recompute_budget=level)
        for level in (1.0, *RECOMPUTE_LEVELS)
    ]
    kept = planned(task, x, device, memory_budget=budget)
    rows.append({**kept, "split": f"kept: {kept['split']}"})
    print(tabulate.tabulate(rows, headers="keys", floatfmt=".3f"))
    return rows


if __name__ == "__main__":
    main()
