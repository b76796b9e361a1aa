"""The predicted schedule of a chunk as a Chrome trace (chrome://tracing, Perfetto): a
compute track and the two copy queues, in microseconds from the start of forward, to
open beside a ``torch.profiler`` trace of the same step."""

from __future__ import annotations

from typing import Any

from offload_pass.plan import Plan

TRACKS = {"compute": 1, "device-to-host": 2, "host-to-device": 3}


def _event(name: str, track: str, start: float, seconds: float, **args: Any) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": 1,
        "tid": TRACKS[track],
        "ts": start * 1e6,
        "dur": seconds * 1e6,
        "args": args,
    }


def _compute_events(plan: Plan) -> list[dict[str, Any]]:
    p = plan.prediction
    costs = plan.costs
    events = []
    phases = (
        ("forward", costs.forward_names, p.forward_starts, costs.forward_seconds),
        ("backward", costs.backward_names, p.backward_starts, costs.backward_seconds),
    )
    for phase, names, starts, durations in phases:
        for name, start, seconds in zip(names, starts, durations, strict=True):
            if seconds > 0:
                events.append(_event(name, "compute", start, seconds, phase=phase))
    return events


def predicted_trace(plan: Plan) -> dict[str, Any]:
    events = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}}
        for track, tid in TRACKS.items()
    ]
    events.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": plan.chunk}})
    events += _compute_events(plan)
    for c in plan.prediction.copies:
        events.append(
            _event(
                f"offload {c.root}",
                "device-to-host",
                c.offload_start,
                c.offload_end - c.offload_start,
                bytes=c.nbytes,
            )
        )
        events.append(
            _event(
                f"reload {c.root}",
                "host-to-device",
                c.reload_start,
                c.reload_end - c.reload_start,
                bytes=c.nbytes,
            )
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
