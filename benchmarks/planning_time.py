"""How long planning takes as graphs grow: ordering backward, then analysis, cost model
and planner, on the partitioned graphs of decoder stacks of increasing depth (traced on
the CPU, planned with the H200 profile).

    python -m benchmarks.planning_time [--layers 8 32 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence

import tabulate
import torch

from benchmarks import workloads
from offload_pass import _compat
from offload_pass.analysis import find_saved_groups
from offload_pass.costs import estimate_costs
from offload_pass.driver import request_for
from offload_pass.graphs import ChunkGraphs
from offload_pass.options import OffloadOptions
from offload_pass.order import free_memory_early, resident_inputs
from offload_pass.planner import plan_offloads
from offload_pass.profiles import BUILT_IN


def partitioned_chunk(layers: int) -> ChunkGraphs:
    """The forward and backward graphs torch.compile makes of a ``layers``-deep stack."""
    chunks: list[ChunkGraphs] = []

    def partition(joint, joint_inputs, **kwargs):
        forward, backward = _compat.stock_partition(joint, joint_inputs, **kwargs)
        chunks.append(ChunkGraphs(forward, backward, kwargs["num_fwd_outputs"]))
        return forward, backward

    def backend(gm, example_inputs):
        return _compat.compile_with_eager(gm, example_inputs, partition)

    model, x = workloads.build(dataclasses.replace(workloads.TINY, layers=layers), "cpu")
    torch.compile(model, backend=backend)(x)
    torch.compiler.reset()
    (chunk,) = chunks
    return chunk


def order_seconds(chunk: ChunkGraphs) -> float:
    start = time.perf_counter()
    free_memory_early(chunk.backward, resident_inputs(chunk))
    return time.perf_counter() - start


def plan_seconds(chunk: ChunkGraphs, options: OffloadOptions) -> float:
    start = time.perf_counter()
    groups = find_saved_groups(chunk)
    costs = estimate_costs(chunk, BUILT_IN["h200"])
    plan_offloads(groups, costs, request_for(groups, options, options.fraction_rule()))
    return time.perf_counter() - start


MODES = {
    "auto": OffloadOptions(min_bytes=0),
    "fraction 0.5": OffloadOptions(fraction=0.5, min_bytes=0),
    "budget 0.7": OffloadOptions(memory_budget=0.7, min_bytes=0),
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    for layers in args.layers:
        chunk = partitioned_chunk(layers)
        nodes = len(chunk.forward.graph.nodes) + len(chunk.backward.graph.nodes)
        row = [layers, nodes, len(find_saved_groups(chunk)), f"{order_seconds(chunk):.3f}"]
        for options in MODES.values():
            times = [plan_seconds(chunk, options) for _ in range(args.repeats)]
            row.append(f"{statistics.median(times):.3f}")
        rows.append(row)
        print(
            tabulate.tabulate(rows, headers=["layers", "nodes", "saved", "order", *MODES]),
            flush=True,
        )
        print()


if __name__ == "__main__":
    main()
