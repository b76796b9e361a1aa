"""How long the pass takes as graphs grow, stage by stage (order, analyse, costs, plan,
bucket, under a memory budget the search over recompute splits, rewrite: everything it
adds before the compiler's own work), on the partitioned graphs
of decoder stacks of increasing depth (traced on the CPU, planned with the H200 profile),
timed inside the partitioner of a real compile, as the backend runs them: on the joint
graph Inductor splits, after its decompositions and joint-graph passes (the backend's
default compiler), or with ``--compiler eager`` the eager compiler's, undecomposed, which
every table in benchmarks/README.md before 2026-12-06 planned.

    python -m benchmarks.planning_time [--layers 8 32 128]
    python -m benchmarks.planning_time --workload W1 --layers 8 --repeats 1
    python -m benchmarks.planning_time --layers 177 --modes auto "fraction 1"

Each repeat is a compile of its own, through the backend's own partitioner
(``OffloadPartitioner``): a copy of the graphs would leave the process more objects to
track, and so bring Python's full garbage collections sooner. Each row gives the joint
graph's nodes (what the partitioner splits) and the kept split's (forward and backward
together, what the stages read): the split has more, its saved values being outputs of
one graph and inputs of the other. ``full GC s``: the pauses of full (oldest-generation)
garbage collections that landed in the partitioner: in its stages, so in the total, and
in its partitions (the ``search`` column counts only the splits not kept). Each column
is its own median: a collection that lands in one stage of one run is left out of that
stage's, but not of the total's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence

import tabulate
import torch

from benchmarks import workloads
from offload_pass.explain import partition_as_compiled
from offload_pass.options import COMPILERS, OffloadOptions
from offload_pass.partition import OffloadPartitioner
from offload_pass.plan import Plan


@dataclasses.dataclass(frozen=True)
class GraphSize:
    joint_nodes: int
    split_nodes: int
    """The forward's and the backward's nodes together, in the split the plan kept."""


@dataclasses.dataclass(frozen=True)
class TimedPass:
    """One run of the pass in a compile. ``stage_seconds``: the plan's; ``collections``:
    seconds of the full garbage collections in the partitioner; ``wall``: the
    partitioner's, every partition included (the stock one too, which a stock compile
    also makes)."""

    size: GraphSize
    moved: int
    stage_seconds: Mapping[str, float]
    collections: float
    wall: float


@contextlib.contextmanager
def full_collections() -> Iterator[list[float]]:
    """While open, the seconds of each full garbage collection, appended as it ends."""
    pauses: list[float] = []
    started = [0.0]

    def record(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    gc.callbacks.append(record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)


def timed_pass(workload: workloads.Workload, layers: int, options: OffloadOptions) -> TimedPass:
    """The pass in a compile of a ``layers``-deep ``workload`` stack: the backend's own
    partitioner (``OffloadPartitioner``), under the compile's fake mode and dispatch."""
    found: list[TimedPass] = []
    plans: list[Plan] = []
    partitioner = OffloadPartitioner(options, options.fraction_rule(), "timed", plans.append)

    def partition(joint, joint_inputs, **kwargs):
        joint_nodes = len(joint.graph.nodes)  # before the partitioner's own passes
        start = time.perf_counter()
        with full_collections() as pauses:
            graphs = partitioner(joint, joint_inputs, **kwargs)
        wall = time.perf_counter() - start
        (plan,) = plans
        split_nodes = len(plan.costs.forward_names) + len(plan.costs.backward_names)
        size = GraphSize(joint_nodes, split_nodes)
        found.append(TimedPass(size, len(plan.moved), plan.stage_seconds, sum(pauses), wall))
        return graphs

    def backend(gm, example_inputs):
        return partition_as_compiled(gm, example_inputs, partition, options.compiler)

    model, x = workloads.build(dataclasses.replace(workload, layers=layers), "cpu")
    gc.collect()  # the compiles before this one leave nothing to collect in it
    torch.compile(model, backend=backend)(x)
    torch.compiler.reset()
    (timed,) = found
    return timed


SEARCHED = "budget 0.7, as the backend plans it"
AT_CHECKPOINTING = "budget 7.35 GiB, as the backend plans it"
AT_CHECKPOINTING_DEFAULTS = "budget 7.35 GiB, the backend's defaults"
AUTO_SEARCHED = "auto, choosing its split"
MODES = {
    "auto": OffloadOptions(min_bytes=0, profile="h200"),
    "fraction 1": OffloadOptions(fraction=1.0, min_bytes=0, profile="h200"),
    "budget 0.7": OffloadOptions(
        memory_budget=0.7, recompute_budget=1.0, min_bytes=0, profile="h200"
    ),
    SEARCHED: OffloadOptions(memory_budget=0.7, min_bytes=0, profile="h200"),
    AT_CHECKPOINTING: OffloadOptions(
        memory_budget=round(7.35 * 2**30), min_bytes=0, profile="h200"
    ),
    AT_CHECKPOINTING_DEFAULTS: OffloadOptions(memory_budget=round(7.35 * 2**30), profile="h200"),
    AUTO_SEARCHED: OffloadOptions(recompute_budget="search", min_bytes=0, profile="h200"),
}
"""The plain budget row fixes the stock split (``recompute_budget=1.0``, torch's own
setting); the searched ones let the joint search (offload_pass.joint) split the graph
again under lower recompute budgets, for the budget or for ``auto``: their ``search``
column, and the wall time with every partition. 7.35 GiB is W1's peak with every block
checkpointed (docs/gpu-validation.md). Every mode but one moves storages of any size
(``min_bytes=0``): the stages' worst case; the backend's defaults leave the smallest
where they are."""
SEARCHING = (SEARCHED, AT_CHECKPOINTING, AT_CHECKPOINTING_DEFAULTS, AUTO_SEARCHED)
STAGES = ("order", "analyse", "costs", "plan", "bucket", "search", "rewrite")
COLLECTIONS = "full GC s"
WALL = "with partitions s"


def timed_modes(
    workload: workloads.Workload,
    layers: int,
    repeats: int,
    modes: Sequence[str],
    compiler: str = "inductor",
) -> dict[str, list[TimedPass]]:
    """``repeats`` compiles for each of ``modes`` (every mode where empty), splitting the
    joint graph ``compiler`` would."""
    asked = [mode for mode in MODES if mode in modes or not modes]
    options = {mode: dataclasses.replace(MODES[mode], compiler=compiler) for mode in asked}
    return {
        mode: [timed_pass(workload, layers, options[mode]) for _ in range(repeats)]
        for mode in asked
    }


def row(layers: int, mode: str, runs: Sequence[TimedPass]) -> list[object]:
    """Medians over ``runs``, each column's own (the total's is of each run's total);
    the wall time only where the search partitions again."""
    median = {k: statistics.median(r.stage_seconds.get(k, 0.0) for r in runs) for k in STAGES}
    total = statistics.median(sum(r.stage_seconds.get(k, 0.0) for k in STAGES) for r in runs)
    collections = statistics.median(r.collections for r in runs)
    wall = f"{statistics.median(r.wall for r in runs):.3f}" if mode in SEARCHING else ""
    size = runs[0].size
    return [
        layers,
        size.joint_nodes,
        size.split_nodes,
        mode,
        runs[0].moved,
        *(f"{median[k]:.3f}" for k in STAGES),
        f"{total:.3f}",
        f"{collections:.3f}",
        wall,
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="tiny", choices=sorted(workloads.BY_NAME))
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=[], choices=list(MODES), help="default: all")
    parser.add_argument(
        "--compiler",
        default="inductor",
        choices=COMPILERS,
        help="whose joint graph is split: Inductor's, decomposed (the backend's default), "
        "or the eager compiler's",
    )
    args = parser.parse_args(argv)
    headers = ["layers", "joint nodes", "split nodes", "mode", "moved", *STAGES]
    headers += ["total s", COLLECTIONS, WALL]
    workload = workloads.BY_NAME[args.workload]
    rows = []
    for layers in args.layers:
        timed = timed_modes(workload, layers, args.repeats, args.modes, args.compiler)
        rows += [row(layers, mode, runs) for mode, runs in timed.items()]
        print(tabulate.tabulate(rows, headers=headers), flush=True)
        print()


if __name__ == "__main__":
    main()
