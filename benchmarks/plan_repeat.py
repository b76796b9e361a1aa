"""The plan one workload gets in fresh processes, with the device cache and without it:
whether a later process plans as the first did.

    python -m benchmarks.plan_repeat [--workload W2] [--budget-gib 12.26] [--processes 2]

Each process plans the workload on the CUDA device with ``offload_pass.explain`` (none of
the model's kernels run; the kernels the cost model times do) under the memory budget,
and reports what it moved, the partitioner's recompute budget it chose, and its
predicted step and peak. With the cache, the processes share one new cache directory;
without it, the cache variable is empty and each process times the kernels afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import tabulate
import torch

import offload_pass
from benchmarks import workloads

GIB = 2**30
HEADERS = [
    "cache",
    "process",
    "moved GiB",
    "recompute budget",
    "pred step ms",
    "pred peak GiB",
    "as the first",
]
FIELDS = ("bytes_moved", "recompute_budgets", "step_seconds", "peak_bytes")


def planned(workload_name: str, budget_gib: float) -> dict[str, Any]:
    """What this process plans for the workload on CUDA under the budget, summed over
    chunks."""
    torch.manual_seed(0)
    workload = getattr(workloads, workload_name)
    model, x = workloads.build(workload, "cuda")
    report = offload_pass.explain(
        workloads.WithLoss(model), x, memory_budget=round(budget_gib * GIB)
    )
    plans = report.plans
    return {
        "bytes_moved": sum(p.bytes_moved for p in plans),
        "recompute_budgets": [p.recompute_budget for p in plans],
        "step_seconds": sum(p.prediction.step_seconds for p in plans),
        "peak_bytes": max(p.prediction.peak_bytes for p in plans),
    }


def rows(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[list[str]]:
    """One row per process, in order; "as the first" compares every field exactly with
    the first process of the same cache setting."""
    first: dict[str, dict[str, Any]] = {}
    table = []
    for cache, result in runs:
        first.setdefault(cache, result)
        number = sum(1 for row in table if row[0] == cache) + 1
        same = all(result[f] == first[cache][f] for f in FIELDS)
        table.append(
            [
                cache,
                str(number),
                f"{result['bytes_moved'] / GIB:.2f}",
                " ".join(f"{b:g}" if b is not None else "-" for b in result["recompute_budgets"]),
                f"{result['step_seconds'] * 1e3:.6f}",
                f"{result['peak_bytes'] / GIB:.4f}",
                "yes" if same else "no",
            ]
        )
    return table


def _in_new_process(args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    environment = os.environ | {"OFFLOAD_PASS_CACHE_DIR": cache_dir}
    command = [sys.executable, "-m", "benchmarks.plan_repeat", "--child"]
    command += ["--workload", args.workload, "--budget-gib", str(args.budget_gib)]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"a planning process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W2")
    parser.add_argument("--budget-gib", type=float, default=12.26)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(planned(args.workload, args.budget_gib)))
        return
    if args.processes < 2:
        parser.error(f"--processes must be at least 2, got {args.processes}")
    runs = []
    with tempfile.TemporaryDirectory() as shared:
        for cache, directory in (("on", shared), ("off", "")):
            for _ in range(args.processes):
                runs.append((cache, _in_new_process(args, directory)))
    print(f"{args.workload}, memory_budget {args.budget_gib} GiB")
    print(tabulate.tabulate(rows(runs), headers=HEADERS))


if __name__ == "__main__":
    main()
