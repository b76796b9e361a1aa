"""The first (compiling) step of a deep stack of small decoder blocks, with and without
the pass, in one process with Inductor's caches off, after a one-block warm-up that pays
the process's one-time costs: what offloading adds to compile time.

    python -m benchmarks.compile_time [--layers 48] [--fraction 1.0] [--repeats 3]
        [--device cpu]

With ``--repeats``, stock and the pass compile in turn that many times; the table gives
each one's median and every run. On a CUDA device (``--device cuda``) the plan is the one
that device gets: its kernels timed, its copies overlapping compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

import tabulate
import torch

import offload_pass
from benchmarks import workloads


def first_step_seconds(layers: int, backend: Any, device: str = "cpu") -> float:
    """Seconds of the first forward and backward of a ``layers``-deep tiny stack."""
    torch.compiler.reset()
    torch.manual_seed(0)
    workload = dataclasses.replace(workloads.TINY, layers=layers)
    model, x = workloads.build(workload, device)
    compiled = torch.compile(workloads.WithLoss(model), backend=backend)
    start = time.perf_counter()
    compiled(x).backward()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--repeats", type=int, default=1, help="stock and offload_pass in turn, this many times"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    caches_off = {"fx_graph_cache": False, "autotune_local_cache": False}
    stock, ours, passes = [], [], []
    with (
        torch._inductor.config.patch(caches_off),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        first_step_seconds(1, "inductor", args.device)  # one-time costs paid here
        for _ in range(args.repeats):
            stock.append(first_step_seconds(args.layers, "inductor", args.device))
            backend = offload_pass.backend(fraction=args.fraction, min_bytes=0)
            ours.append(first_step_seconds(args.layers, backend, args.device))
            passes.append(sum(sum(p.stage_seconds.values()) for p in backend.plans))
    print(tabulate.tabulate(rows(stock, ours, passes, args.fraction), headers=HEADERS))


HEADERS = ["first step", "seconds", "ratio", "pass stages s", "each run s (in turn)"]


def rows(
    stock: Sequence[float], ours: Sequence[float], passes: Sequence[float], fraction: float
) -> list[list[str]]:
    """Medians, the ratio of the medians, and every run: on a busy machine one run of
    either can be off by a tenth, so the ratio of one pair says little."""
    median = statistics.median
    each = " ".join
    return [
        ["stock Inductor", f"{median(stock):.1f}", "1.00", "", each(f"{s:.1f}" for s in stock)],
        [
            f"offload_pass fraction {fraction:g}",
            f"{median(ours):.1f}",
            f"{median(ours) / median(stock):.2f}",
            f"{median(passes):.1f}",
            each(f"{s:.1f}" for s in ours),
        ],
    ]


if __name__ == "__main__":
    main()
