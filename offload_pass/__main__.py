"""Command line: ``python -m offload_pass explain FACTORY [options]``.

FACTORY names a function returning ``(model, example_inputs)``: ``package.module:function``
or ``path/to/file.py:function``. The report of what offload_pass would move is printed;
nothing of the model runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from offload_pass.explain import explain
from offload_pass.options import SEARCH, OffloadOptions
from offload_pass.report import format_graphs


def load_factory(spec: str) -> Callable[[], Any]:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise SystemExit(
            f"factory must look like module:function or file.py:function, got {spec!r}"
        )
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if module_spec is None or module_spec.loader is None or not Path(where).exists():
            raise SystemExit(f"no such file: {where}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise SystemExit(f"{where} has no attribute {name!r}")
    return getattr(module, name)


def _recompute_budget(text: str) -> float | str:
    """``--recompute-budget``'s value: a share (its range checked with the options), or
    ``search``."""
    if text == SEARCH:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number in (0, 1] or {SEARCH!r}, got {text!r}"
        ) from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m offload_pass", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("explain", help="plan a model and print the report")
    plan.add_argument("factory", help="module:function or file.py:function")
    mode = plan.add_mutually_exclusive_group()
    mode.add_argument("--fraction", type=float)
    mode.add_argument("--memory-budget", type=float, help="share of the peak without offloading")
    plan.add_argument("--stall-tolerance", type=float, default=0.02)
    plan.add_argument(
        "--recompute-budget",
        type=_recompute_budget,
        help="torch's activation_memory_budget, in (0, 1], or 'search' to let the pass choose",
    )
    plan.add_argument("--profile", help="h200, h100, a100, cpu, calibrate (default: by device)")
    plan.add_argument("--min-bytes", type=int, default=256 * 1024)
    plan.add_argument("--graphs", action="store_true", help="print the rewritten graphs too")
    plan.add_argument("--dump", help="folder for each chunk's report, graphs and trace")
    return parser.parse_args(argv)


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options the arguments give, checked before any model code runs."""
    options = {
        "fraction": args.fraction,
        "memory_budget": args.memory_budget,
        "stall_tolerance": args.stall_tolerance,
        "recompute_budget": args.recompute_budget,
        "profile": args.profile,
        "min_bytes": args.min_bytes,
        "dump_dir": args.dump,
    }
    try:
        OffloadOptions(**options)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"python -m offload_pass {args.command}: {error}") from error
    return options


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    options = backend_options(args)
    made = load_factory(args.factory)()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise SystemExit(
            f"{args.factory} must return (model, example_inputs), got {type(made).__name__}"
        )
    model, inputs = made
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    report = explain(model, *inputs, **options)
    print(report)
    if args.graphs:
        for plan in report.plans:
            print(format_graphs(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
