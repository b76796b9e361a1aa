"""What is alive at the measured peak of a training step, per configuration, beside
offload_pass's predicted peak (CUDA only).

    python -m benchmarks.peak_breakdown --workload W1 --configs "offload_pass fraction 1"
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from benchmarks import configs, workloads
from offload_pass.peak import peak_breakdown
from offload_pass.units import format_bytes

WARM_UP_STEPS = 2


def breakdown(config: configs.Config, workload: workloads.Workload, top: int) -> str:
    torch.compiler.reset()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model, x = workloads.build(workload, "cuda")
    shared: dict = {}
    forward = config.prepare(model, shared)

    def step() -> None:
        forward(x).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(WARM_UP_STEPS):
        step()
    measured = peak_breakdown(step)
    backend = shared.get("backend")
    predicted = (
        f", predicted {format_bytes(max(p.prediction.peak_bytes for p in backend.plans))}"
        if backend is not None and backend.plans
        else ""
    )
    return f"## {workload.name} {config.name}{predicted}\n{measured.format(top)}\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1", choices=sorted(workloads.BY_NAME))
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--top", type=int, default=20, help="sites to list per configuration")
    args = parser.parse_args(argv)
    try:
        chosen = configs.named(args.configs)
    except ValueError as error:
        parser.error(str(error))
    for config in chosen:
        print(breakdown(config, workloads.BY_NAME[args.workload], args.top), flush=True)


if __name__ == "__main__":
    main()
