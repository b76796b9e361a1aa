"""Side by side, in one process: no offload, the peers and offload_pass on the workloads of
benchmarks/README.md; a markdown table, a JSON file and a Pareto plot under --out.

    python -m benchmarks.compare                        # W1 and W2, every configuration
    python -m benchmarks.compare --workloads W1 --configs compiled "offload_pass auto"
    python -m benchmarks.compare --recheck benchmarks/results/<run>.json  # targets only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tabulate
import torch

import offload_pass
from benchmarks import configs, workloads
from benchmarks.measure import Measurement, measure
from offload_pass.report import format_model

GiB = 2**30
BASELINE = "compiled"
FIRST = ("compiled", "offload_pass auto")  # the builtin peer marks what auto moved
RATIO_LIMIT = 1.03


@dataclasses.dataclass(frozen=True)
class Hardware:
    device: str
    device_to_host: float | None
    host_to_device: float | None
    both_directions: float | None
    matmul_flops: float | None

    @classmethod
    def measured(cls, device: torch.device) -> Hardware:
        if device.type != "cuda":
            return cls("cpu", None, None, None, None)
        from offload_pass.calibration import calibrate

        p = calibrate(device.index or 0)
        name = torch.cuda.get_device_name(device)
        return cls(name, p.device_to_host, p.host_to_device, p.both_directions, p.matmul_flops)


def _error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def derive(rows: Sequence[Measurement], hardware: Hardware) -> list[dict[str, Any]]:
    """Each measurement with its ratios against the baseline of the same run."""
    base = next((r for r in rows if r.config == BASELINE and r.ok), None)
    derived = []
    for r in rows:
        d = dataclasses.asdict(r)
        d.pop("moved_names")
        if r.ok and base is not None:
            d["step_ratio"] = r.step_ms / base.step_ms
            if r.peak_bytes is not None and hardware.device_to_host:
                limit = hardware.device_to_host * base.forward_ms / 1e3
                d["peak_saved_bytes"] = base.peak_bytes - r.peak_bytes
                d["offload_efficiency"] = d["peak_saved_bytes"] / limit
            if r.family == "offload_pass" and hardware.device_to_host and r.bytes_moved:
                d["pcie_bound_ms"] = _pcie_bound_ms(
                    base.forward_ms, base.step_ms, r.bytes_moved, hardware
                )
                d["bound_ratio"] = r.step_ms / d["pcie_bound_ms"]
            if r.predicted_step_ms is not None:
                d["step_prediction_error"] = _error(r.predicted_step_ms, r.step_ms)
            if r.predicted_step_ms is not None and r.paired_step_ms is not None:
                d["step_prediction_error_in_turns"] = _error(r.predicted_step_ms, r.paired_step_ms)
            if r.predicted_peak_bytes is not None and r.peak_bytes is not None:
                d["peak_prediction_error"] = _error(r.predicted_peak_bytes, r.peak_bytes)
        derived.append(d)
    return derived


def _pcie_bound_ms(forward_ms: float, step_ms: float, moved: int, hw: Hardware) -> float:
    """The fastest step that moves ``moved`` bytes each way: max(T_fwd, X/B_d2h) +
    max(T_bwd, X/B_h2d), with the baseline's forward and step times."""
    forward = forward_ms / 1e3
    backward = (step_ms - forward_ms) / 1e3
    bound = max(forward, moved / hw.device_to_host) + max(backward, moved / hw.host_to_device)
    return bound * 1e3


def _floor_to_reach(peak: int, base: dict[str, Any] | None, hw: Hardware) -> str:
    """Offloading lowers the peak by at most the bytes it moves: the least it must move to
    reach ``peak``, and the PCIe bound of moving that."""
    if base is None or not hw.device_to_host or base["peak_bytes"] <= peak:
        return ""
    needed = base["peak_bytes"] - peak
    bound = _pcie_bound_ms(base["forward_ms"], base["step_ms"], needed, hw)
    return f" (reaching it moves >= {needed / GiB:.2f} GiB: PCIe bound {bound:.1f} ms)"


def _nearest_miss(peer: dict[str, Any], ours: list[dict[str, Any]]) -> str:
    """By how much the nearest of ours misses dominating ``peer``: the time the fastest of
    ours at or under its peak takes beyond it, or how far our lowest peak is above it."""
    under = [o for o in ours if o["peak_bytes"] <= peer["peak_bytes"]]
    if under:
        fastest = min(under, key=lambda o: o["step_ms"])
        late = fastest["step_ms"] - peer["step_ms"]
        return (
            f"the fastest of ours at or under its peak, {fastest['config']}, is "
            f"{late:.1f} ms ({late / peer['step_ms']:.1%}) slower"
        )
    lowest = min(ours, key=lambda o: o["peak_bytes"])
    above = (lowest["peak_bytes"] - peer["peak_bytes"]) / GiB
    return (
        f"our lowest peak, {lowest['config']} at {lowest['peak_bytes'] / GiB:.2f} GiB, "
        f"is {above:.2f} GiB above it"
    )


def _builds_on(ours: dict[str, Any], peer: dict[str, Any]) -> bool:
    """Whether row ``ours`` is the pass added to ``peer``'s own method: such a row is
    named "<peer's config>, <our options>" (``checkpoint blocks, offload_pass auto``),
    and does not count for or against that peer (moving nothing, it is the peer)."""
    return ours["config"].startswith(f"{peer['config']}, ")


def check_targets(rows: list[dict[str, Any]], hw: Hardware) -> list[str]:
    """The targets of the benchmarks issue, each met or missed by how much."""
    ok = _measured(rows)
    ours = [r for r in ok if r["family"] == "offload_pass"]
    if not ours:
        return ["no offload_pass point with memory figures: targets not checked"]
    base = _baseline(ok)
    lines = []
    peers = [r for r in ok if r["family"] not in ("offload_pass",) and r["config"] != BASELINE]
    for peer in peers:
        rivals = [o for o in ours if not _builds_on(o, peer)]
        best = [
            o
            for o in rivals
            if o["peak_bytes"] <= peer["peak_bytes"] and o["step_ms"] <= peer["step_ms"]
        ]
        verdict = (
            f"dominated by {best[0]['config']}"
            if best
            else f"NOT dominated: {_nearest_miss(peer, rivals)}"
            + _floor_to_reach(peer["peak_bytes"], base, hw)
        )
        lines.append(
            f"pareto: {peer['config']} ({peer['step_ms']:.1f} ms, "
            f"{peer['peak_bytes'] / GiB:.2f} GiB): {verdict}"
        )
    auto = next((r for r in ours if r["config"] == "offload_pass auto"), None)
    if auto is not None and "step_ratio" in auto:
        met = auto["offload_efficiency"] >= 0.9 and auto["step_ratio"] <= RATIO_LIMIT
        lines.append(
            f"auto: efficiency {auto['offload_efficiency']:.3f} (target >= 0.9) at step ratio "
            f"{auto['step_ratio']:.3f} (target <= {RATIO_LIMIT}): {'met' if met else 'MISSED'}"
        )
        for key in ("step_prediction_error", "peak_prediction_error"):
            if key in auto:
                verdict = "met" if auto[key] <= 0.15 else "MISSED"
                lines.append(
                    f"auto: {key.replace('_', ' ')} {auto[key]:.1%} (target <= 15%): {verdict}"
                )
    for r in ours:
        if "bound_ratio" in r:
            verdict = "met" if r["bound_ratio"] <= 1.10 else "MISSED"
            lines.append(
                f"bound: {r['config']} at {r['bound_ratio']:.3f}x the PCIe bound "
                f"(target <= 1.10): {verdict}"
            )
    return lines + against_checkpointing(rows, hw)


def against_checkpointing(rows: list[dict[str, Any]], hw: Hardware) -> list[str]:
    """Whether some offload_pass point at or under "checkpoint blocks"' peak is at least
    10% faster than it (none where checkpointing did not run)."""
    ok = _measured(rows)
    checkpoint = next((r for r in ok if r["config"] == "checkpoint blocks"), None)
    if checkpoint is None:
        return []
    ours = [r for r in ok if r["family"] == "offload_pass" and not _builds_on(r, checkpoint)]
    if not ours:
        return []
    return [_against_checkpointing(checkpoint, ours, _baseline(ok), hw)]


def _measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that ran and have memory figures."""
    return [r for r in rows if r["status"] == "ok" and r.get("peak_bytes") is not None]


def _baseline(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if r["config"] == BASELINE), None)


def _against_checkpointing(
    checkpoint: dict[str, Any],
    ours: list[dict[str, Any]],
    base: dict[str, Any] | None,
    hw: Hardware,
) -> str:
    target = checkpoint["step_ms"] / 1.10
    under = [o for o in ours if o["peak_bytes"] <= checkpoint["peak_bytes"]]
    if not under:
        return (
            f"checkpointing: no offload_pass point at or under its peak, {target:.1f} ms "
            f"wanted; {_nearest_miss(checkpoint, ours)}: "
            f"MISSED{_floor_to_reach(checkpoint['peak_bytes'], base, hw)}"
        )
    fastest = min(under, key=lambda o: o["step_ms"])
    gain = checkpoint["step_ms"] / fastest["step_ms"] - 1
    speed = (
        f"{gain:.1%} faster"
        if gain >= 0
        else f"{fastest['step_ms'] / checkpoint['step_ms'] - 1:.1%} slower"
    )
    verdict = (
        "met" if gain >= 0.10 else "MISSED" + _floor_to_reach(checkpoint["peak_bytes"], base, hw)
    )
    return (
        f"checkpointing: {fastest['config']} is {speed} at no more peak "
        f"(target >= 10% faster): {verdict}"
    )


COLUMNS = (
    ("config", "config", "{}"),
    ("status", "status", "{}"),
    ("split", "split", "{}"),
    ("step_ms", "step ms", "{:.1f}"),
    ("forward_ms", "fwd ms", "{:.1f}"),
    ("step_ratio", "ratio", "{:.3f}"),
    ("paired_step_ratio", "ratio in turns", "{:.3f}"),
    ("paired_step_ms", "ms in turns", "{:.1f}"),
    ("peak_bytes", "peak GiB", "gib"),
    ("active_peak_bytes", "active GiB", "gib"),
    ("held_bytes", "held GiB", "gib"),
    ("bytes_moved", "moved GiB", "gib"),
    ("peak_saved_bytes", "saved GiB", "gib"),
    ("predicted_peak_saved_bytes", "pred saved GiB", "gib"),
    ("offload_efficiency", "efficiency", "{:.3f}"),
    ("bound_ratio", "bound ratio", "{:.3f}"),
    ("predicted_step_ms", "pred ms", "{:.1f}"),
    ("predicted_forward_ms", "pred fwd ms", "{:.1f}"),
    ("host_ms", "host ms", "{:.1f}"),
    ("predicted_host_ms", "pred host ms", "{:.1f}"),
    ("predicted_peak_bytes", "pred peak GiB", "gib"),
    ("pinned_allocations_after_warmup", "pinned allocs", "{}"),
    ("first_step_s", "first step s", "{:.1f}"),
    ("settling_s", "settling s", "{:.1f}"),
)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    return f"{value / GiB:.2f}" if fmt == "gib" else fmt.format(value)


def markdown(workload: str, rows: list[dict[str, Any]], targets: list[str]) -> str:
    """One workload's table (the columns some row fills) and its targets' verdicts."""
    columns = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    table = tabulate.tabulate(
        [[_cell(r.get(key), fmt) for key, _, fmt in columns] for r in rows],
        headers=[header for _, header, _ in columns],
        tablefmt="github",
        disable_numparse=True,
    )
    return f"## {workload}\n\n{table}\n\n" + "\n".join(f"- {line}" for line in targets) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    """Peak memory against step time, one colour per method; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results["workloads"])
    figure, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        rows = [r for r in results["workloads"][name]["rows"] if r.get("peak_bytes")]
        for family in dict.fromkeys(r["family"] for r in rows):
            points = sorted(
                (r["step_ms"], r["peak_bytes"] / GiB) for r in rows if r["family"] == family
            )
            front = _pareto_front(points)
            ax.scatter(*zip(*points, strict=True), label=family)
            ax.plot(*zip(*front, strict=True), linewidth=1)
        ax.set(title=name, xlabel="step time (ms)", ylabel="peak memory (GiB)")
        if rows:
            ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def _pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    front, lowest = [], float("inf")
    for step, peak in sorted(points):
        if peak < lowest:
            front.append((step, peak))
            lowest = peak
    return front


def profile_auto(build: Callable[[], tuple[torch.nn.Module, Any]], device: torch.device) -> str:
    """offload_pass auto's predicted copies, step and peak against a profiled step of the
    task ``build`` makes: a module that returns the loss, and its input."""
    if device.type != "cuda":
        return "(measured-versus-predicted comparison needs a CUDA device)"
    from offload_pass.validate import compare_with_profile

    torch.compiler.reset()
    torch.manual_seed(0)
    task, x = build()
    backend = offload_pass.backend()
    compiled = torch.compile(task, backend=backend)

    def step() -> None:
        compiled(x).backward()
        task.zero_grad(set_to_none=True)

    step()  # compiles: the backend's plans exist from here on
    return str(compare_with_profile(step, backend.plans))


def _workload_task(name: str, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    model, x = workloads.build(workloads.BY_NAME[name], device)
    return workloads.WithLoss(model), x


def run_workload(
    name: str,
    chosen: Sequence[configs.Config],
    steps: int,
    device: torch.device,
    show_plans: bool = False,
) -> list[Measurement]:
    workload = workloads.BY_NAME[name]
    chosen = sorted(chosen, key=lambda c: FIRST.index(c.name) if c.name in FIRST else len(FIRST))
    shared: dict[str, Any] = {}
    results = []
    for config in chosen:
        result = measure(config, lambda: workloads.build(workload, device), device, steps, shared)
        if config.name == "offload_pass auto" and result.ok:
            shared["moved_names"] = set(result.moved_names)
        print(f"{name} {config.name}: {result.status}, step {result.step_ms} ms", flush=True)
        if show_plans and shared.get("backend") is not None:
            print(format_model(shared["backend"].plans), flush=True)
        results.append(result)
    return results


def workload_report(name: str, results: dict[str, Any]) -> str:
    workload = results["workloads"][name]
    section = markdown(name, workload["rows"], workload["targets"])
    if workload["auto_profiled"]:
        section += (
            "\n### offload_pass auto, predicted against profiled\n\n"
            f"```\n{workload['auto_profiled']}\n```\n"
        )
    return section


def report(results: dict[str, Any]) -> str:
    hardware = Hardware(**results["hardware"])
    header = f"# {hardware.device}, torch {results['torch']}, {results['date']}\n"
    sections = [workload_report(name, results) for name in results["workloads"]]
    return "\n".join([header, _hardware_line(hardware), *sections])


def write(results: dict[str, Any], stem: Path) -> None:
    """The results so far: written after each workload, so a run cut short keeps them."""
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    stem.with_suffix(".md").write_text(report(results))
    plot(results, stem.with_suffix(".png"))


def recheck(path: Path) -> dict[str, Any]:
    """Checks the targets again on the rows of an earlier run's JSON, measuring nothing,
    and rewrites its files: for when the checks change after a run."""
    results = json.loads(path.read_text())
    hardware = Hardware(**results["hardware"])
    for workload in results["workloads"].values():
        workload["targets"] = check_targets(workload["rows"], hardware)
    write(results, path.with_suffix(""))
    return results


def new_results(hardware: Hardware) -> dict[str, Any]:
    """An empty run: today's date, the torch version and the hardware, no workloads yet."""
    return {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "hardware": dataclasses.asdict(hardware),
        "workloads": {},
    }


def results_stem(out: Path, results: dict[str, Any], what: str) -> Path:
    """``out/<device>-<date>-<what>``, the path of a run's files less their suffix."""
    out.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^A-Za-z0-9]+", "-", results["hardware"]["device"]).strip("-").lower()
    return out / f"{device}-{results['date']}-{what}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2"])
    parser.add_argument("--configs", nargs="*", default=[], help="names to run (default: all)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--show-plans", action="store_true", help="print offload_pass's reports")
    parser.add_argument(
        "--recheck", type=Path, metavar="JSON", help="check an earlier run's rows again; no run"
    )
    args = parser.parse_args(argv)
    if args.recheck is not None:
        return recheck(args.recheck)
    try:
        chosen = configs.named(args.configs)
    except ValueError as error:
        parser.error(str(error))

    device = torch.device(args.device)
    hardware = Hardware.measured(device)
    results = new_results(hardware)
    stem = results_stem(args.out, results, "-".join(args.workloads).lower())
    for name in args.workloads:
        rows = derive(run_workload(name, chosen, args.steps, device, args.show_plans), hardware)
        comparison = (
            profile_auto(functools.partial(_workload_task, name, device), device)
            if "offload_pass auto" in args.configs or not args.configs
            else ""
        )
        results["workloads"][name] = {
            "rows": rows,
            "targets": check_targets(rows, hardware),
            "auto_profiled": comparison,
        }
        print(workload_report(name, results), flush=True)
        write(results, stem)
    return results


def _hardware_line(hw: Hardware) -> str:
    if hw.device_to_host is None:
        return "Copy bandwidths not measured (no CUDA device).\n"
    return (
        f"Measured in this run: pinned device-to-host {hw.device_to_host / 1e9:.1f} GB/s, "
        f"host-to-device {hw.host_to_device / 1e9:.1f} GB/s, both at once "
        f"{hw.both_directions / 1e9:.1f} GB/s, "
        f"bf16 matrix product {hw.matmul_flops / 1e12:.0f} TFLOP/s.\n"
    )


if __name__ == "__main__":
    main()
