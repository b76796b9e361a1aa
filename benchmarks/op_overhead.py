"""Host time of the transfer ops, on tensors small enough that the copies themselves
cost nothing: what offloading adds to the host side of a step, per storage moved. Where
steps are short (small microbatches), this is what the step pays.

Measured twice: the ops called alone in a loop (as ``calibrate`` measures them), and in
the code Inductor generates, as the difference between a small decoder stack's
compiled step at fraction 1 and at fraction 0, divided by the storages moved. The second
also gives the host time of a step with nothing moved per kernel launch the cost model
counts. On CUDA the device is kept busy while the host issues each timed step, so that
the host never waits for it; on a CPU the step's compute is in these figures too.

    python -m benchmarks.op_overhead [--device cuda] [--calls 2000] [--steps 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import tabulate
import torch

import offload_pass
from benchmarks import workloads
from offload_pass import _compat
from offload_pass.calibration import HOST_BUCKET, bucketed_host_seconds

HEAD_START_CYCLES = 200_000_000
"""What the device spins before each timed step (about 0.1 s at 2 GHz), longer than the
host takes to issue the stack's step."""


def host_microseconds(call: Callable[[], object], calls: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def measure(device: torch.device, calls: int) -> list[tuple[str, float]]:
    """Host microseconds per storage moved, as ``calibrate`` measures them: ops moving
    one storage each, and what each further storage adds to an op (from ops moving
    ``HOST_BUCKET``)."""
    host = bucketed_host_seconds(device, calls)
    alone, added = host.alone, host.added
    first, further = alone.offload + alone.reload, added.offload + added.reload
    per_bucketed = (first + (HOST_BUCKET - 1) * further) / HOST_BUCKET
    a = torch.randn(256, device=device)
    return [
        ("offload and offload_wait", alone.offload * 1e6),
        ("reload and reload_wait", alone.reload * 1e6),
        ("all four, per storage moved", first * 1e6),
        ("a further storage in one offload", added.offload * 1e6),
        ("a further storage in one reload", added.reload * 1e6),
        (f"all four, per storage, {HOST_BUCKET} a bucket", per_bucketed * 1e6),
        ("a.clone(), for scale", host_microseconds(lambda: a.clone(), calls)),
    ]


def kernel_launch_microseconds(device: torch.device, calls: int, layers: int = 32) -> float:
    """Host microseconds per kernel of Inductor's code on tiny tensors: a chain of
    ``layers`` products each followed by a ReLU (two kernels a layer), where the step is
    all host time. What each kernel of a compiled step costs the host, for scale."""
    x = torch.randn(8, 8, device=device)
    w = torch.randn(8, 8, device=device)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(layers):
            x = torch.mm(x, w).relu()
        return x

    compiled = torch.compile(chain)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    compiled(x)
    synchronize()
    per_call = host_microseconds(lambda: compiled(x), calls)
    synchronize()
    return per_call / (2 * layers)


@dataclasses.dataclass(frozen=True)
class StepHost:
    """Host seconds to issue one compiled step, and what the pass's plans counted in it."""

    seconds: float
    storages_moved: int
    kernel_launches: int


def step_host(device: torch.device, fraction: float, layers: int, steps: int) -> StepHost:
    """Host time of the stack's compiled forward and backward at ``fraction``."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model, x = workloads.build(dataclasses.replace(workloads.TINY, layers=layers), device)
    backend = offload_pass.backend(fraction=fraction, min_bytes=0)
    compiled = torch.compile(model, backend=backend)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    seconds = []
    for _ in range(steps + 3):
        synchronize()
        if device.type == "cuda":
            _compat.spin_device(device, HEAD_START_CYCLES)
        start = time.perf_counter()
        workloads.loss_of(compiled(x)).backward()
        seconds.append(time.perf_counter() - start)
    synchronize()
    launches = sum(p.costs.launches for p in backend.plans)
    moved = sum(len(p.moved) for p in backend.plans)
    return StepHost(statistics.median(seconds[3:]), moved, launches)


def in_compiled_step(device: torch.device, layers: int, steps: int) -> list[tuple[str, float]]:
    """Host microseconds per storage moved (fraction 1 against 0), and per kernel launch
    the cost model counts (a stack twice as deep against this one, nothing moved, which
    leaves out the step's fixed host cost: guards, wrappers, the autograd engine)."""
    nothing = step_host(device, 0.0, layers, steps)
    deeper = step_host(device, 0.0, 2 * layers, steps)
    everything = step_host(device, 1.0, layers, steps)
    per_storage = (everything.seconds - nothing.seconds) / everything.storages_moved
    added_launches = deeper.kernel_launches - nothing.kernel_launches
    per_launch = (deeper.seconds - nothing.seconds) / added_launches
    fixed = nothing.seconds - per_launch * nothing.kernel_launches
    return [
        (f"all four in a compiled step ({everything.storages_moved} moved)", per_storage * 1e6),
        (
            f"a launch in a compiled step ({added_launches} more at twice the depth)",
            per_launch * 1e6,
        ),
        ("a compiled step's fixed host time", fixed * 1e6),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=50, help="compiled steps timed")
    parser.add_argument("--layers", type=int, default=4, help="of the compiled stack")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = measure(device, args.calls)
    rows.append(("one Inductor kernel, for scale", kernel_launch_microseconds(device, args.calls)))
    rows += in_compiled_step(device, args.layers, args.steps)
    print(tabulate.tabulate(rows, headers=["op", "host us per call"], floatfmt=".1f"))


if __name__ == "__main__":
    main()
