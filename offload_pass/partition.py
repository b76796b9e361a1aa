"""The partition step: the stock min-cut partitioner, then the pass on its graphs
(driver.py; for a memory budget, on several splits, joint.py), in the place Inductor and
AOTAutograd call a partitioner."""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.fx

from offload_pass import _compat, dump
from offload_pass.blocks import Split, recomputed_regions
from offload_pass.driver import recompute_pricing, rewrite_chunk
from offload_pass.graphs import ChunkGraphs
from offload_pass.joint import Partition, plan_jointly, search_space
from offload_pass.options import FractionRule, OffloadOptions
from offload_pass.plan import Plan
from offload_pass.profiles import UNMEASURED, HostScale
from offload_pass.realized import held_recomputations


def stock_splits(
    joint: torch.fx.GraphModule,
    joint_inputs: Sequence[object],
    recompute_seconds: Callable[[torch.fx.Node], float] | None = None,
    **kwargs: Any,
) -> Partition:
    """The stock min-cut partitioner's split of ``joint``: under a recompute budget,
    choosing what to recompute by ``recompute_seconds`` where given
    (``_compat.stock_partition``), with the blocks the split names checkpointed
    (:mod:`offload_pass.blocks`) and the values it names recomputed, those in a region
    after the blocks'.

    Where the split recomputes values that Inductor would write out and hold through
    backward (:mod:`offload_pass.realized`), the partitioner splits again, told to save
    them (of the values the split names, too: held, they would free nothing)."""

    def stock(split: Split, held: frozenset[str] = frozenset()) -> ChunkGraphs:
        recomputed = recomputed_regions(joint, kwargs["num_fwd_outputs"], split.checkpointed)
        after_blocks = len(split.checkpointed)
        recomputed.update((name, after_blocks) for name in split.recomputed if name not in held)
        with _compat.partitioner_policies(joint, held.union(split.saved), recomputed):
            graphs = _compat.stock_partition(
                joint,
                joint_inputs,
                split.recompute_budget,
                recompute_seconds=recompute_seconds,
                **kwargs,
            )
        forward, backward = map(_compat.lazy_graph_module, graphs)
        return ChunkGraphs(forward, backward, kwargs["num_fwd_outputs"])

    splits_made = itertools.count()

    def partition_under(split: Split) -> ChunkGraphs:
        if next(splits_made):
            gc.collect()  # what the splits before left behind (compile_frozen)
        graphs = stock(split)
        held = held_recomputations(graphs, _compat.realize_reads_threshold())
        return stock(split, held) if held else graphs

    return partition_under


@contextlib.contextmanager
def compile_frozen() -> Iterator[None]:
    """The objects alive when opened left out of garbage collections while open
    (``gc.freeze``). A deep model's compile holds over a million objects, and a full
    collection walks them all; a budget's search collects before each split after the
    first, when the splits it dropped (cyclic FX graphs) are garbage, and so walks only
    what the pass made. Where objects were frozen before, they stay so and nothing more
    is frozen (``gc.unfreeze`` would free them too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class OffloadPartitioner(_compat.PartitionerBase):
    """Usable as Inductor's ``custom_partitioner_fn`` and as AOTAutograd's partition_fn."""

    def __init__(
        self,
        options: OffloadOptions,
        rule: FractionRule,
        name: str,
        on_plan: Callable[[Plan], None],
        host_scale: HostScale = UNMEASURED,
    ) -> None:
        self.options = options
        self.rule = rule
        self.name = name
        self.on_plan = on_plan
        self.host_scale = host_scale

    def __call__(
        self, joint: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        # full collections deferred while the pass runs; the search's own walk only what
        # the pass made (compile_frozen)
        with _compat.full_collections_deferred(), compile_frozen():
            search = search_space(self.options, joint, kwargs["num_fwd_outputs"])
            pricing = recompute_pricing(self.options, joint)
            partition = stock_splits(joint, joint_inputs, pricing, **kwargs)
            plan = rewrite_chunk(
                plan_jointly(partition, self.options, self.rule, search, self.host_scale),
                self.name,
            )
        dump.record(plan, dump.dump_dir(self.options.dump_dir))
        self.on_plan(plan)
        return plan.forward, plan.backward

    def uuid(self) -> None:
        return None
