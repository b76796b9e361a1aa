"""Draw a predicted schedule (a ``.trace.json`` from offload_pass's dump) as three
tracks: compute, device-to-host and host-to-device. Needs matplotlib.

    python -m benchmarks.plot_timeline plans/chunk_0_0.trace.json timeline.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from offload_pass.trace import TRACKS

COLOURS = {"compute": "tab:blue", "device-to-host": "tab:orange", "host-to-device": "tab:green"}


def plot_timeline(trace_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    figure, ax = plt.subplots(figsize=(12, 2.6))
    for track, tid in TRACKS.items():
        bars = [(e["ts"] / 1e3, e["dur"] / 1e3) for e in spans if e["tid"] == tid]
        ax.broken_barh(
            bars, (tid - 0.4, 0.8), facecolors=COLOURS[track], edgecolor="white", linewidth=0.2
        )
    ax.set_yticks(list(TRACKS.values()), list(TRACKS))
    ax.invert_yaxis()
    ax.set_xlabel("predicted time from the start of forward (ms)")
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    plot_timeline(args.trace, args.png)


if __name__ == "__main__":
    main()
