"""Write what the pass did to a chunk into a folder: the report, both rewritten graphs,
and the predicted schedule as a Chrome trace."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from offload_pass import _compat
from offload_pass.plan import Plan
from offload_pass.report import annotated_code, format_plan, summary
from offload_pass.trace import predicted_trace

DUMP_ENV = "OFFLOAD_PASS_DUMP"

log = logging.getLogger("offload_pass")
_compat.register_log_name("offload_pass")


def dump_dir(option: str | os.PathLike[str] | None) -> Path | None:
    """The folder to dump into: the option, else ``$OFFLOAD_PASS_DUMP``, else none."""
    chosen = option if option is not None else os.environ.get(DUMP_ENV)
    return Path(chosen) if chosen else None


def dump_plan(plan: Plan, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9]+", "_", plan.chunk).strip("_")
    files = {
        f"{stem}.txt": format_plan(plan),
        f"{stem}.forward.py": annotated_code(plan.forward),
        f"{stem}.backward.py": annotated_code(plan.backward),
        f"{stem}.trace.json": json.dumps(predicted_trace(plan)),
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    return [folder / name for name in files]


def record(plan: Plan, folder: Path | None) -> None:
    """Log the plan's summary; dump it too when a folder is set."""
    log.info("%s", summary(plan))
    if folder is not None:
        paths = dump_plan(plan, folder)
        log.info("offload_pass: %s written to %s", plan.chunk, paths[0].parent)
