"""What is alive at the measured peak of a training step, per configuration, beside
offload_pass's predicted peak (CUDA only).

    python -m benchmarks.peak_breakdown --workload W1 --configs "offload_pass fraction 1"
    python -m benchmarks.peak_breakdown --zoo llama_16k --configs compiled "offload_pass auto"

With ``--zoo`` the model is that model-zoo architecture at its GPU size, compiled whole,
and the configurations are the zoo's (``benchmarks.zoo``).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks import configs, workloads, zoo
from offload_pass.peak import peak_breakdown
from offload_pass.units import format_bytes

WARM_UP_STEPS = 2


def breakdown(
    config: configs.Config, name: str, build: Callable[[], tuple[torch.nn.Module, Any]], top: int
) -> str:
    """The measured peak of one step of the task ``build`` makes (a module and its
    input), compiled as ``config`` prepares it, beside the plans' predicted peak."""
    torch.compiler.reset()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model, x = build()
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
    return f"## {name} {config.name}{predicted}\n{measured.format(top)}\n"


def _zoo_configs(names: Sequence[str]) -> list[configs.Config]:
    """The zoo's whole-model configurations called ``names``, in that order; raises
    ``ValueError`` naming what is unknown."""
    known = {c.name: c for c in zoo.whole_configs()}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; the zoo's: {sorted(known)}")
    return [known[name] for name in dict.fromkeys(names)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1", choices=sorted(workloads.BY_NAME))
    parser.add_argument(
        "--zoo", choices=sorted(zoo.MODELS), help="a model-zoo architecture instead of --workload"
    )
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--top", type=int, default=20, help="sites to list per configuration")
    args = parser.parse_args(argv)
    try:
        chosen = _zoo_configs(args.configs) if args.zoo else configs.named(args.configs)
    except ValueError as error:
        parser.error(str(error))
    if args.zoo:
        name = args.zoo
        build = functools.partial(zoo.MODELS[args.zoo].build, torch.device("cuda"))
    else:
        name = args.workload
        build = functools.partial(workloads.build, workloads.BY_NAME[args.workload], "cuda")
    for config in chosen:
        print(breakdown(config, name, build, args.top), flush=True)


if __name__ == "__main__":
    main()
