"""The first (compiling) step of a deep stack of small decoder blocks, with and without
the pass, in one process with Inductor's caches off, after a one-block warm-up that pays
the process's one-time costs: what offloading adds to compile time.

    python -m benchmarks.compile_time [--layers 48] [--fraction 1.0]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import tabulate
import torch

import offload_pass
from benchmarks import workloads


def first_step_seconds(layers: int, backend: Any) -> float:
    """Seconds of the first forward and backward of a ``layers``-deep tiny stack."""
    torch.compiler.reset()
    torch.manual_seed(0)
    workload = dataclasses.replace(workloads.TINY, layers=layers)
    model, x = workloads.build(workload, "cpu")
    compiled = torch.compile(workloads.WithLoss(model), backend=backend)
    start = time.perf_counter()
    compiled(x).backward()
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--fraction", type=float, default=1.0)
    args = parser.parse_args(argv)
    caches_off = {"fx_graph_cache": False, "autotune_local_cache": False}
    with (
        torch._inductor.config.patch(caches_off),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        first_step_seconds(1, "inductor")  # one-time costs (imports, workers) paid here
        stock = first_step_seconds(args.layers, "inductor")
        backend = offload_pass.backend(fraction=args.fraction, min_bytes=0)
        ours = first_step_seconds(args.layers, backend)
    passes = sum(sum(p.stage_seconds.values()) for p in backend.plans)
    rows = [
        ["stock Inductor", f"{stock:.1f}", "1.00", ""],
        [
            f"offload_pass fraction {args.fraction:g}",
            f"{ours:.1f}",
            f"{ours / stock:.2f}",
            f"{passes:.1f}",
        ],
    ]
    print(tabulate.tabulate(rows, headers=["first step", "seconds", "ratio", "pass stages s"]))


if __name__ == "__main__":
    main()
