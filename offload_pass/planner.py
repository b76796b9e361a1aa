"""Plan: decide which saved groups move, and where each transfer op goes.

Selection here is by fraction of each module's candidate bytes, earliest-produced first
(those have the longest forward to hide their copy in and are needed last in backward).

Placement pipelines the copies one ahead on each queue:
- offload ``i`` right after its storage is produced;
- offload_wait ``i`` after the later of its last forward use and the point where
  offload ``i+1`` is issued, so the compute between two offloads hides a copy and at
  most two copies are outstanding; the last one waits just before forward returns;
- reloads in order of first backward use; reload ``k+1`` is issued where reload ``k``
  is first needed, so one reload is in flight while backward computes;
- reload_wait ``k`` right before the first backward use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.fx

from offload_pass.analysis import SavedGroup
from offload_pass.options import FractionRule

MOVED = "moved"
TOO_SMALL = "too small"
FRACTION_REACHED = "fraction reached"


@dataclasses.dataclass(frozen=True)
class Decision:
    group: SavedGroup
    moved: bool
    reason: str
    fraction_owner: str
    fraction: float


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the four ops of one moved group go, by node name.

    Forward: offload after ``offload_after``, offload_wait after ``wait_after``.
    Backward: reload before ``reload_before`` (``None``: right after the inputs),
    reload_wait before ``first_use``.
    """

    root: str
    offload_after: str
    wait_after: str
    reload_before: str | None
    first_use: str


def choose_groups(
    groups: Sequence[SavedGroup], rule: FractionRule, min_bytes: int
) -> tuple[Decision, ...]:
    owners = {g.root: rule.resolve(g.module_stack) for g in groups}
    movable = [g for g in groups if g.fixed_reason is None and g.nbytes >= min_bytes]
    totals: dict[str, int] = {}
    for g in movable:
        totals[owners[g.root][0]] = totals.get(owners[g.root][0], 0) + g.nbytes
    taken: dict[str, int] = dict.fromkeys(totals, 0)

    decisions = []
    for g in groups:
        owner, share = owners[g.root]
        if g.fixed_reason is not None:
            moved, reason = False, g.fixed_reason
        elif g.nbytes < min_bytes:
            moved, reason = False, TOO_SMALL
        else:
            moved = taken[owner] + g.nbytes <= share * totals[owner]
            taken[owner] += g.nbytes if moved else 0
            reason = MOVED if moved else FRACTION_REACHED
        decisions.append(Decision(g, moved, reason, owner, share))
    return tuple(decisions)


def place_transfers(
    moved: Sequence[SavedGroup],
    forward: torch.fx.Graph,
    backward: torch.fx.Graph,
) -> tuple[Placement, ...]:
    fw_nodes = list(forward.nodes)
    bw_nodes = list(backward.nodes)
    last_compute = len(fw_nodes) - 2  # the node before the output
    by_production = sorted(moved, key=lambda g: g.produced_at)
    wait_index = {
        g.root: max(g.last_forward_use, nxt.produced_at)
        for g, nxt in zip(by_production, by_production[1:], strict=False)
    }
    by_first_use = sorted(moved, key=lambda g: (g.first_backward_use, g.produced_at))
    reload_before = {
        g.root: (None if prev is None else bw_nodes[prev.first_backward_use].name)
        for prev, g in zip([None, *by_first_use], by_first_use, strict=False)
    }
    return tuple(
        Placement(
            root=g.root,
            offload_after=g.root,
            wait_after=fw_nodes[wait_index.get(g.root, last_compute)].name,
            reload_before=reload_before[g.root],
            first_use=bw_nodes[g.first_backward_use].name,
        )
        for g in by_production
    )
