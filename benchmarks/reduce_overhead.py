"""offload_pass under CUDA graphs: ``torch.compile(..., mode="reduce-overhead")``.

    python -m benchmarks.reduce_overhead [--replays 200] [--model gpt2]

Two checks, each printed as a table:

- **Gradients.** A float32 decoder stack trained one step at fraction 1, so that every
  candidate moves: under reduce-overhead against the same plan in the default mode
  (the same kernels, so bitwise equal unless a captured graph reads a buffer too early
  or too late), and against stock reduce-overhead without offloading (where the
  transfer ops leave Inductor's kernels as stock's, bitwise equal as well; the largest
  difference is printed).
- **Replays.** A zoo model (bf16, GPT-2 by default) under stock reduce-overhead, and
  under offload_pass ``auto`` and fraction 0.5 with reduce-overhead: the median step, the
  step ratio against stock, the step offload_pass predicted (its chunks' summed), the
  peak, the bytes moved a step, and whether host memory (the process's resident set) and
  pinned allocations stay flat from the tenth replay to the last. CUDA graph trees count
  what they did not capture (``cudagraph skips``).

Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
from collections.abc import Callable
from typing import Any

import tabulate
import torch
from torch._dynamo.utils import counters

import offload_pass
from benchmarks import workloads
from benchmarks.measure import pinned_allocations
from benchmarks.zoo import MODELS
from offload_pass.calibration import profile_for

MODE = "reduce-overhead"
FLAT_FROM = 10
"""The replay after which host memory and pinned allocations must not grow."""
STACK = dataclasses.replace(workloads.TINY, dim=256, layers=4, batch=2, seq=256)


@dataclasses.dataclass(frozen=True)
class Replays:
    """What the replayed steps of one compiled model did."""

    step_seconds: float
    peak_bytes: int
    bytes_moved_per_step: int
    resident_growth_bytes: int
    pinned_allocations_added: int
    cudagraph_skips: int


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cudagraph_skips() -> int:
    return counters["inductor"]["cudagraph_skips"]


def _step(forward: Callable[[Any], torch.Tensor], batch: Any) -> None:
    torch.compiler.cudagraph_mark_step_begin()
    forward(batch).backward()


def replay(
    forward: Callable[[Any], torch.Tensor], model: torch.nn.Module, batch: Any, replays: int
) -> Replays:
    """Run ``replays`` steps, the gradients dropped after each as zero_grad does."""
    skips = _cudagraph_skips()
    seconds, moved = [], []
    resident = pinned = 0
    torch.cuda.reset_peak_memory_stats()
    for i in range(replays):
        before = offload_pass.counts().bytes_offloaded
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(forward, batch)
        end.record()
        end.synchronize()
        model.zero_grad(set_to_none=True)
        seconds.append(start.elapsed_time(end) / 1e3)
        moved.append(offload_pass.counts().bytes_offloaded - before)
        if i == FLAT_FROM:
            resident, pinned = _resident_bytes(), pinned_allocations()
    return Replays(
        statistics.median(seconds[FLAT_FROM:]),
        torch.cuda.max_memory_allocated(),
        moved[-1],
        _resident_bytes() - resident,
        pinned_allocations() - pinned,
        _cudagraph_skips() - skips,
    )


def _gradients(
    compile_model: Callable[[torch.nn.Module], Callable[[Any], torch.Tensor]], steps: int = 3
) -> dict[str, torch.Tensor]:
    """The stack's gradients after its ``steps``-th step (the first ones record and
    capture), from the same weights and batch every time."""
    torch.manual_seed(0)
    model, x = workloads.build(STACK, "cuda")
    forward = compile_model(workloads.WithLoss(model))
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        _step(forward, x)
    torch.cuda.synchronize()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def gradient_rows() -> list[tuple[str, str, str]]:
    """Offloaded under reduce-overhead, against the same in the default mode and against
    stock reduce-overhead. Both offloaded runs plan with one profile, the device's rates as
    under CUDA graphs, so that they compile the same plan: a profile given as rates also
    leaves the kernels untimed, whose times differ from one compile to the next."""
    torch.compiler.reset()
    rates = profile_for(None, torch.device("cuda")).under_cuda_graphs()

    def ours(mode: str | None) -> Callable[[torch.nn.Module], Callable[[Any], torch.Tensor]]:
        backend = offload_pass.backend(fraction=1.0, min_bytes=0, profile=rates)
        return lambda model: torch.compile(model, backend=backend, mode=mode)

    captured = _gradients(ours(MODE))
    rows = []
    for name, other in (
        ("offload_pass fraction 1, default mode", ours(None)),
        ("stock, reduce-overhead", lambda model: torch.compile(model, mode=MODE)),
    ):
        torch.compiler.reset()
        expected = _gradients(other)
        same = all(torch.equal(captured[n], expected[n]) for n in captured)
        rows.append(
            (name, "yes" if same else "no", f"{_largest_difference(captured, expected):.2e}")
        )
    return rows


def replay_rows(model_name: str, replays: int) -> list[tuple[Any, ...]]:
    """Stock reduce-overhead, then offload_pass auto and fraction 0.5 under it."""
    torch.manual_seed(0)
    built, batch = MODELS[model_name].build(torch.device("cuda"))
    backends: dict[str, offload_pass.OffloadBackend | None] = {
        "stock": None,
        "offload_pass auto": offload_pass.backend(),
        "offload_pass fraction 0.5": offload_pass.backend(fraction=0.5),
    }
    rows, stock = [], None
    for name, backend in backends.items():
        torch.compiler.reset()
        model = copy.deepcopy(built)
        compiled = torch.compile(model, backend=backend or "inductor", mode=MODE)
        result = replay(compiled, model, batch, replays)
        stock = stock or result
        predicted = sum(p.prediction.step_seconds for p in backend.plans) if backend else None
        rows.append(
            (
                name,
                f"{result.step_seconds * 1e3:.2f}",
                f"{result.step_seconds / stock.step_seconds:.3f}",
                f"{predicted * 1e3:.2f}" if predicted is not None else "",
                f"{result.peak_bytes / 2**30:.2f}",
                f"{result.bytes_moved_per_step / 2**30:.2f}",
                f"{result.resident_growth_bytes / 2**20:.1f}",
                result.pinned_allocations_added,
                result.cudagraph_skips,
            )
        )
        del model
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--model", default="gpt2", choices=list(MODELS))
    args = parser.parse_args()
    if args.replays <= FLAT_FROM:
        parser.error(f"--replays must be above {FLAT_FROM}, got {args.replays}")
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a CUDA device, and none is available")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(
        tabulate.tabulate(
            gradient_rows(),
            headers=["stack at fraction 1 under reduce-overhead, against", "bitwise", "largest"],
        )
    )
    print()
    headers = [
        f"{args.model} under reduce-overhead",
        "step ms",
        "ratio",
        "pred ms",
        "peak GiB",
        "moved GiB",
        f"host MiB added after replay {FLAT_FROM}",
        "pinned allocations added",
        "cudagraph skips",
    ]
    print(tabulate.tabulate(replay_rows(args.model, args.replays), headers=headers))


if __name__ == "__main__":
    main()
