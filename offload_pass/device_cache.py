"""What was measured on a device, kept on disk for the next process on that machine.

Kernel times, the device's sustained slowdown and a calibrated profile are measured while
a graph compiles. Measured afresh in each process, they differ a little each time, and a
plan that turns on them (the joint search's choice between two splits, say) differs with
them. Kept on disk, every process on the machine plans with the same figures, and skips
measuring them again.

One JSON file per device model and torch build, in ``$OFFLOAD_PASS_CACHE_DIR`` (default
``$XDG_CACHE_HOME/offload_pass``, else ``~/.cache/offload_pass``). Setting the variable
to the empty string, or forcing Inductor's caches off
(``torch._inductor.config.force_disable_caches``), keeps every figure in memory only.
Delete the directory to measure again. The cache is advisory: a file that cannot be read
or written is warned about once and the figures are measured as without it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from offload_pass import _compat

CACHE_DIR_VARIABLE = "OFFLOAD_PASS_CACHE_DIR"
FORMAT_VERSION = 1
"""Part of every file name: raised whenever what is measured, or how, changes."""

_warned: set[Path] = set()


def directory() -> Path | None:
    """Where measurements are kept; None where they are kept in memory only."""
    if _compat.inductor_caches_forced_off():
        return None
    configured = os.environ.get(CACHE_DIR_VARIABLE)
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "offload_pass"


def path_for(device: torch.device) -> Path | None:
    """The file of ``device``'s model under this torch build; None where caching is off."""
    where = directory()
    if where is None:
        return None
    model = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = f"{model}-torch-{torch.__version__}-v{FORMAT_VERSION}"
    return where / (re.sub(r"[^A-Za-z0-9.+-]+", "_", name) + ".json")


def read(device: torch.device) -> dict[str, dict[str, Any]]:
    """Everything kept for ``device``: section name to its entries; empty where nothing
    is kept or the file cannot be read, and without any section that is not a mapping."""
    path = path_for(device)
    if path is None or not path.exists():
        return {}
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        _warn_once(path, f"cannot read {path} ({error}); measuring again")
        return {}
    if not isinstance(kept, dict):
        return {}
    return {name: entries for name, entries in kept.items() if isinstance(entries, dict)}


def numbers(device: torch.device, section: str) -> dict[str, float]:
    """The entries of ``section`` kept for ``device`` that are numbers."""
    entries = read(device).get(section, {})
    return {k: float(v) for k, v in entries.items() if isinstance(v, (int, float))}


def record(device: torch.device, section: str, key: str, value: Any) -> None:
    """Keep ``value`` as ``key`` of ``section`` for ``device``, beside what other
    processes kept: the file is read again, merged and replaced in one rename, so a
    reader never sees half a file. Of two processes writing at once, the entry one of
    them added can be lost; it is measured again by the next process that needs it."""
    path = path_for(device)
    if path is None:
        return
    kept = read(device)
    kept.setdefault(section, {})[key] = value
    try:
        _replace(path, json.dumps(kept, indent=0, sort_keys=True))
    except OSError as error:
        _warn_once(path, f"cannot write {path} ({error}); keeping measurements in memory")


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to a file beside ``path`` and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _warn_once(path: Path, message: str) -> None:
    if path not in _warned:
        _warned.add(path)
        warnings.warn(f"offload_pass: {message}", stacklevel=3)
