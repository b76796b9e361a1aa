"""Train a GPT split into pipeline stages, with and without offloading, and compare each
rank's step time and peak memory.

    torchrun --nproc-per-node 2 examples/pipeline_parallel.py                  # CUDA (NCCL)
    torchrun --nproc-per-node 2 examples/pipeline_parallel.py --device cpu --dim 128 --seq 64
    torchrun --nproc-per-node 2 examples/pipeline_parallel.py --schedule interleaved --fraction 0.5

Each rank compiles its stages with the offload backend; nothing else changes. For 1F1B the
stage's warm-up depth (how many microbatches it holds at once) is passed to the planner. On
CUDA every rank first measures the copy bandwidth it gets while all ranks copy at once
(``calibrate_shared``) and plans with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from inspect_plan import Block
from torch import nn
from torch.distributed import pipelining

import offload_pass
from offload_pass.pipeline_parallel import in_flight_microbatches

SCHEDULES = {
    "1f1b": (pipelining.Schedule1F1B, 1),
    "interleaved": (pipelining.ScheduleInterleaved1F1B, 2),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--fraction", type=float, help="share to move (default: auto)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--trace-dir", help="write a profiler trace of one more step per rank and backend here"
    )
    return parser.parse_args()


def stage_modules(args: argparse.Namespace, rank: int, world: int, virtual: int) -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [Block(args.dim, args.heads) for _ in range(args.layers)]
    per_stage = args.layers // (world * virtual)
    ids = [rank + world * v for v in range(virtual)]
    return [nn.Sequential(*blocks[s * per_stage : (s + 1) * per_stage]) for s in ids]


def train(
    args: argparse.Namespace, backend: object, label: str, rank: int, world: int
) -> tuple[float, int, int]:
    """(median step seconds after the first, peak device bytes, pinned host allocations
    after the first step) of this rank."""
    device = torch.device(args.device, rank if args.device == "cuda" else None)
    schedule_type, virtual = SCHEDULES[args.schedule]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modules = [m.to(device, dtype) for m in stage_modules(args, rank, world, virtual)]
    shape = (args.batch // args.microbatches, args.seq, args.dim)
    stages = []
    for v, module in enumerate(modules):
        index = rank + world * v
        # Shapes given up front: the schedule then needs no shape inference round.
        inputs = torch.empty(shape, device=device, dtype=dtype, requires_grad=index > 0)
        outputs = torch.empty(shape, device=device, dtype=dtype, requires_grad=True)
        compiled = torch.compile(module, backend=backend)
        stages.append(
            pipelining.PipelineStage(compiled, index, world * virtual, device, inputs, outputs)
        )
    schedule = schedule_type(
        stages[0] if virtual == 1 else stages,
        args.microbatches,
        loss_fn=lambda out, target: (out.float() - target).pow(2).mean(),
    )
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=1e-3)
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=dtype)
    target = torch.randn(args.batch, args.seq, args.dim, device=device)

    def step() -> None:
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    allocations = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        allocations.append(pinned_allocations())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    if args.trace_dir:
        write_trace(step, f"{args.trace_dir}/rank{rank}-{label}.json")
    return statistics.median(times[1:] or times), peak, allocations[-1] - allocations[0]


def pinned_allocations() -> int:
    """New pinned host blocks so far (each a cudaHostAlloc); 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.host_memory_stats().get("num_host_alloc", 0)


def write_trace(step: Callable[[], None], path: str) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    dist.barrier()
    with torch.profiler.profile(activities=activities) as profiler:
        step()
    profiler.export_chrome_trace(path)


def main() -> None:
    args = parse_args()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    on_cuda = args.device == "cuda"
    dist.init_process_group("nccl" if on_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if on_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    depth = 1
    if args.schedule == "1f1b":
        depth = in_flight_microbatches("Schedule1F1B", rank, world, args.microbatches)
    profile = None
    if on_cuda:
        profile = offload_pass.calibrate_shared()
        print(
            f"rank {rank} {profile.name}: device-to-host {profile.device_to_host / 1e9:.1f} GB/s, "
            f"host-to-device {profile.host_to_device / 1e9:.1f} GB/s, "
            f"both {profile.both_directions / 1e9:.1f} GB/s",
            flush=True,
        )
    options = {"fraction": args.fraction, "in_flight_microbatches": depth, "profile": profile}
    backends = {"no offload": "inductor", "offload": offload_pass.backend(**options)}
    for name, backend in backends.items():
        torch.compiler.reset()
        seconds, peak, allocations = train(args, backend, name.replace(" ", "-"), rank, world)
        moved = sum(p.bytes_moved for p in getattr(backend, "plans", []))
        memory = f"peak {peak / 2**30:6.2f} GiB" if on_cuda else "peak n/a (CPU)"
        print(
            f"rank {rank} {args.schedule} {name:10s}: step {seconds * 1e3:8.1f} ms, {memory}, "
            f"moved per microbatch {moved / 2**20:8.1f} MiB, "
            f"new pinned blocks after step 1: {allocations}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
