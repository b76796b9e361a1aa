"""Sizes and durations as people read them."""

from __future__ import annotations


def format_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def format_seconds(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
