"""Host time of the transfer ops, on tensors small enough that the copies themselves
cost nothing: what offloading adds to the host side of a step, per storage moved. Where
steps are short (small microbatches), this is what the step pays.

    python -m benchmarks.op_overhead [--device cuda] [--calls 2000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import tabulate
import torch

from offload_pass.calibration import transfer_host_seconds


def host_microseconds(call: Callable[[], object], calls: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def measure(device: torch.device, calls: int) -> list[tuple[str, float]]:
    """Host microseconds per storage moved, as ``calibrate`` measures them."""
    ops = transfer_host_seconds(device, calls)
    a = torch.randn(256, device=device)
    return [
        ("offload and offload_wait", ops.offload * 1e6),
        ("reload and reload_wait", ops.reload * 1e6),
        ("all four, per storage moved", (ops.offload + ops.reload) * 1e6),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = measure(device, args.calls)
    rows.append(("one Inductor kernel, for scale", kernel_launch_microseconds(device, args.calls)))
    print(tabulate.tabulate(rows, headers=["op", "host us per call"], floatfmt=".1f"))


if __name__ == "__main__":
    main()
