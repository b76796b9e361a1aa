"""What pipeline parallelism changes for the planner: a stage holds several microbatches'
activations at once.

Offloading saves memory in every microbatch a stage holds, so the memory it saves grows
with the schedule's warm-up depth; a microbatch's copies may end under the next one's
forward (``offload_release``), its reloads run inside its own backward. Pass the depth
as ``backend(in_flight_microbatches=...)``.

Several GPUs of one host share its PCIe switches and host memory bandwidth: when every
rank copies at once, each may see a share of what one GPU alone measures. Plan with that
share: ``backend(profile=offload_pass.calibrate_shared())``, measured while all ranks copy
together.
"""

from __future__ import annotations

SINGLE_STAGE_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def in_flight_microbatches(
    schedule: str | type, stage_index: int, num_stages: int, n_microbatches: int
) -> int:
    """Microbatches whose forward a stage has run and whose backward it has not, at most.

    GPipe runs every forward first; 1F1B runs ``num_stages - stage_index`` forwards before
    its first backward. Other schedules: pass the depth yourself.
    """
    name = schedule if isinstance(schedule, str) else schedule.__name__
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if name == "ScheduleGPipe":
        return n_microbatches
    if name == "Schedule1F1B":
        return min(num_stages - stage_index, n_microbatches)
    raise ValueError(
        f"the warm-up depth of {name} is not known here (known: "
        f"{', '.join(SINGLE_STAGE_SCHEDULES)}); pass in_flight_microbatches yourself"
    )
