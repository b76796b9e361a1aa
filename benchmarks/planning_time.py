"""How long the pass takes as graphs grow, stage by stage (order, analyse, costs, plan,
bucket, under a memory budget the search over recompute splits, rewrite: everything it
adds before the compiler's own work), on the partitioned graphs
of decoder stacks of increasing depth (traced on the CPU, planned with the H200 profile),
timed inside the partitioner of a real compile, as the backend runs them.

    python -m benchmarks.planning_time [--layers 8 32 128]
    python -m benchmarks.planning_time --workload W1 --layers 8 --repeats 1
    python -m benchmarks.planning_time --layers 177 --modes auto "fraction 1"

Each row gives the joint graph's nodes (what the partitioner splits) and the split's
(forward and backward together, what the stages read): the split has more, its saved
values being outputs of one graph and inputs of the other.
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
from offload_pass.driver import offload_chunk, rewrite_chunk
from offload_pass.graphs import ChunkGraphs
from offload_pass.joint import plan_jointly, search_levels
from offload_pass.options import OffloadOptions
from offload_pass.partition import stock_splits


@dataclasses.dataclass(frozen=True)
class GraphSize:
    joint_nodes: int
    split_nodes: int
    """The forward's and the backward's nodes together."""


def timed_in_compile(
    workload: workloads.Workload, layers: int, repeats: int, modes: Sequence[str] = ()
) -> tuple[GraphSize, dict[str, list[dict[str, float]]]]:
    """Each of ``modes``' stage times (every mode where empty), ``repeats`` runs each, on
    the partitioned graphs of a ``layers``-deep ``workload`` stack, and the graphs' size.
    The stages run where the backend runs them: inside the partitioner, under the
    compile's fake mode and dispatch."""
    found: dict[str, list[dict[str, float]]] = {}
    sizes = []

    def partition(joint, joint_inputs, **kwargs):
        joint_nodes = len(joint.graph.nodes)  # before the partitioner's own passes
        forward, backward = _compat.stock_partition(joint, joint_inputs, **kwargs)
        chunk = ChunkGraphs(forward, backward, kwargs["num_fwd_outputs"])
        sizes.append(GraphSize(joint_nodes, len(forward.graph.nodes) + len(backward.graph.nodes)))
        for mode, options in MODES.items():
            if mode in modes or not modes:
                found[mode] = [stage_seconds(chunk, options) for _ in range(repeats)]
        if SEARCHED in modes or not modes:
            found[SEARCHED] = [
                searched_seconds(joint, joint_inputs, kwargs, MODES["budget 0.7"])
                for _ in range(repeats)
            ]
        return forward, backward

    def backend(gm, example_inputs):
        return _compat.compile_with_eager(gm, example_inputs, partition)

    model, x = workloads.build(dataclasses.replace(workload, layers=layers), "cpu")
    torch.compile(model, backend=backend)(x)
    torch.compiler.reset()
    (size,) = sizes
    return size, found


def stage_seconds(chunk: ChunkGraphs, options: OffloadOptions) -> dict[str, float]:
    """The pass's stages on a copy of ``chunk`` (the order and rewrite stages edit it)."""
    copy = ChunkGraphs(
        copy_module(chunk.forward), copy_module(chunk.backward), chunk.num_forward_outputs
    )
    plan = offload_chunk(copy, options, options.fraction_rule(), "timed")
    return {**plan.stage_seconds, "moved": len(plan.moved)}


def searched_seconds(
    joint: torch.fx.GraphModule,
    joint_inputs: Sequence[object],
    kwargs: dict[str, object],
    options: OffloadOptions,
) -> dict[str, float]:
    """The pass's stages as the backend runs them under a memory budget: the joint
    search, partitioning the joint graph again for each split it tries; ``WALL``: all of
    it, every partition included (the stock one too, which a stock compile also makes)."""
    start = time.perf_counter()
    split = stock_splits(joint, joint_inputs, **kwargs)
    levels = search_levels(options, joint)
    plan = rewrite_chunk(plan_jointly(split, options, options.fraction_rule(), levels), "timed")
    return {**plan.stage_seconds, "moved": len(plan.moved), WALL: time.perf_counter() - start}


def copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` as the partitioner hands it to the stages: writing its code when
    first run, not at each recompile."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return _compat.lazy_graph_module(torch.fx.GraphModule(gm, graph))


MODES = {
    "auto": OffloadOptions(min_bytes=0, profile="h200"),
    "fraction 1": OffloadOptions(fraction=1.0, min_bytes=0, profile="h200"),
    "budget 0.7": OffloadOptions(memory_budget=0.7, min_bytes=0, profile="h200"),
}
SEARCHED = "budget 0.7, as the backend plans it"
"""The budget mode through the joint search (offload_pass.joint), which may split the
graph again under lower recompute budgets: its ``search`` column."""
STAGES = ("order", "analyse", "costs", "plan", "bucket", "search", "rewrite")
WALL = "with partitions s"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tiny", choices=sorted(workloads.BY_NAME))
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes", nargs="+", default=[], choices=[*MODES, SEARCHED], help="default: all"
    )
    args = parser.parse_args(argv)
    rows = []
    headers = ["layers", "joint nodes", "split nodes", "mode", "moved", *STAGES, "total s", WALL]
    workload = workloads.BY_NAME[args.workload]
    for layers in args.layers:
        size, timed = timed_in_compile(workload, layers, args.repeats, args.modes)
        for mode, runs in timed.items():
            median = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in STAGES}
            times = [f"{median[k]:.3f}" for k in STAGES]
            total = f"{sum(median.values()):.3f}"
            wall = f"{statistics.median(r[WALL] for r in runs):.3f}" if WALL in runs[0] else ""
            row = [layers, size.joint_nodes, size.split_nodes, mode, runs[0]["moved"]]
            rows.append([*row, *times, total, wall])
        print(tabulate.tabulate(rows, headers=headers), flush=True)
        print()


if __name__ == "__main__":
    main()
