"""What users read: the report, the annotated graphs, the trace, the dump and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

import offload_pass
from offload_pass import __main__ as cli
from offload_pass import report
from offload_pass.graphs import is_view
from offload_pass.trace import TRACKS, predicted_trace
from tests import models


@pytest.fixture(scope="module")
def explained() -> offload_pass.ModelReport:
    torch.manual_seed(0)
    model = models.BlockStack(dim=64, heads=4, depth=3)
    return offload_pass.explain(
        model, torch.randn(2, 64, 64), fraction=0.5, profile="h200", min_bytes=0
    )


def test_report_rows_and_totals_match_the_plan(explained):
    (plan,) = explained.plans
    rows = report.plan_rows(plan)
    assert explained.rows() == rows
    assert [r.name for r in rows] == [d.group.root for d in plan.decisions]
    assert sum(r.nbytes for r in rows if r.moved) == plan.bytes_moved > 0
    assert {r.name for r in rows if r.moved} == {c.root for c in plan.prediction.copies}
    moved_rows = [r for r in rows if r.moved]
    assert all(r.copy_seconds > 0 and 0 <= r.hidden_share <= 1 for r in moved_rows)
    text = str(explained)
    assert report.format_bytes(plan.bytes_moved) in text
    assert "predicted peak" in text and "model: 1 chunks" in text
    assert 0 < plan.offload_ops <= len(moved_rows) and 0 < plan.reload_ops <= len(moved_rows)
    assert f"by {plan.offload_ops} offload and {plan.reload_ops} reload ops" in text


def test_every_reason_is_a_documented_one(explained):
    reasons = {d.reason for plan in explained.plans for d in plan.decisions}
    assert reasons <= set(report.REASONS)
    assert {"moved", "fraction reached", "input or parameter"} <= reasons


def test_rewritten_graphs_mark_each_transfer_with_its_stream(explained):
    graphs = report.format_graphs(explained.plans[0])
    present = {op for op in report.STREAM_NOTES if op in graphs}
    assert present == report.STREAM_NOTES.keys() - {"offload_pass.offload_release.default"}
    for op in present:
        marked = [line for line in graphs.splitlines() if op in line]
        assert all(line.endswith(report.STREAM_NOTES[op]) for line in marked)


def test_trace_is_valid_json_with_the_three_tracks(explained):
    plan = explained.plans[0]
    trace = json.loads(json.dumps(predicted_trace(plan)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == set(TRACKS.values())
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    copies = [e for e in spans if e["tid"] != TRACKS["compute"]]
    assert len(copies) == 2 * len(plan.moved)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == set(TRACKS)


def test_dump_folder_gets_table_graphs_and_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_PASS_DUMP", str(tmp_path))
    model = torch.compile(models.MLP(), backend=offload_pass.backend(fraction=1.0, min_bytes=0))
    model(torch.randn(8, 64, requires_grad=True)).sum().backward()
    suffixes = sorted(p.name.split(".", 1)[1] for p in tmp_path.iterdir())
    assert suffixes == ["backward.py", "forward.py", "trace.json", "txt"]
    (forward,) = tmp_path.glob("*.forward.py")
    assert "offload_pass.offload.default" in forward.read_text()


def test_explain_plans_a_cpu_model_for_the_profile_it_is_given():
    torch.manual_seed(0)
    model = models.BlockStack(dim=256, heads=4, depth=4)
    x = torch.randn(2, 512, 256)
    on_h200 = offload_pass.explain(model, x, profile=models.H200_INSTANT_HOST).plans[0]
    on_cpu = offload_pass.explain(model, x).plans[0]
    assert (on_h200.profile.name, on_cpu.profile.name) == ("h200, instant host", "cpu")
    assert on_h200.moved, "auto moves what hides under an H200's compute"
    assert not on_cpu.moved, "on the CPU copies do not overlap compute"
    assert on_h200.prediction.peak_bytes < on_h200.prediction.baseline_peak_bytes


def test_explain_plans_a_model_with_dropout():
    """Inductor's joint-graph passes seed random ops under the trace's fake mode."""
    torch.manual_seed(0)
    model = models.DropoutMLP(width=64).train()
    (plan,) = offload_pass.explain(model, torch.randn(8, 64), fraction=1.0, min_bytes=0).plans
    assert plan.moved


def test_explain_says_when_the_host_leaves_auto_nothing_to_move():
    # the same small model on an H200 with its host: kernels of microseconds, each issued
    # in 13 us, so the step is the host's and every transfer op would lengthen it
    torch.manual_seed(0)
    model = models.BlockStack(dim=256, heads=4, depth=4)
    report = offload_pass.explain(model, torch.randn(2, 512, 256), profile="h200")
    (plan,) = report.plans
    assert not plan.moved
    assert plan.prediction.host_wait_seconds > 0.25 * plan.prediction.baseline_seconds
    assert "slows the step" in {d.reason for d in plan.decisions}
    assert "the device waits for the host here" in str(report)


def test_cli_prints_the_report_for_an_example_model(capsys):
    assert cli.main(["explain", "examples/inspect_plan.py:gpt", "--profile", "h200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("offload plan for chunk")
    assert "decision" in out and "model: 1 chunks" in out


def test_cli_passes_the_recompute_budget_on(capsys):
    factory = ["explain", "examples/inspect_plan.py:gpt", "--profile", "h200", "--fraction", "0"]
    cli.main(factory)
    stock = capsys.readouterr().out
    cli.main([*factory, "--recompute-budget", "0.5"])
    assert capsys.readouterr().out != stock
    with pytest.raises(SystemExit, match="explain: recompute_budget must be in"):
        cli.main([*factory, "--recompute-budget", "1.5"])


def test_cli_takes_search_as_the_recompute_budget(capsys):
    factory = ["explain", "examples/inspect_plan.py:gpt", "--profile", "h200"]
    cli.main([*factory, "--recompute-budget", "search"])
    assert capsys.readouterr().out.startswith("offload plan for chunk")
    with pytest.raises(SystemExit):
        cli.main([*factory, "--recompute-budget", "half"])
    assert "must be a number in (0, 1] or 'search', got 'half'" in capsys.readouterr().err


def test_cli_rejects_a_bad_option_before_building_the_model():
    with pytest.raises(SystemExit, match="explain: .*fraction"):
        cli.main(["explain", "no_such_module:factory", "--fraction", "1.5"])


def test_cli_rejects_a_malformed_factory():
    with pytest.raises(SystemExit, match="module:function"):
        cli.main(["explain", "examples/inspect_plan.py"])


def bare_model() -> torch.nn.Module:
    return models.MLP()


def test_cli_rejects_a_factory_that_returns_a_bare_model():
    with pytest.raises(SystemExit, match=r"must return \(model, example_inputs\), got MLP"):
        cli.main(["explain", "tests/test_inspection.py:bare_model"])


def test_timeline_plot_draws_a_dumped_trace(tmp_path, explained):
    pytest.importorskip("matplotlib")
    from benchmarks.plot_timeline import plot_timeline

    trace = tmp_path / "chunk.trace.json"
    trace.write_text(json.dumps(predicted_trace(explained.plans[0])))
    plot_timeline(trace, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prediction_prints_as_one_short_line(explained):
    text = str(explained.plans[0].prediction)
    assert "\n" not in text and len(text) < 160
    assert "step" in text and "peak" in text and "stall" in text
    assert len(repr(explained.plans[0].prediction)) < 400


def test_plan_table_sums_up_the_inputs_and_fits_160_columns(explained):
    text = str(explained.plans[0])
    assert max(len(line) for line in text.splitlines()) <= 160
    assert "placeholder" not in text
    assert "graph inputs (parameters, buffers, the batch)" in text


def test_auto_on_the_cpu_says_why_nothing_moves():
    model = models.BlockStack(dim=64, heads=4, depth=2)
    explained = offload_pass.explain(model, torch.randn(2, 64, 64), profile="cpu", min_bytes=0)
    (plan,) = explained.plans
    assert not plan.moved
    reason = report.why_nothing_moved(plan)
    assert reason is not None and "'cpu' profile" in reason
    assert reason in str(plan)


def test_a_profiler_trace_names_each_transfer_op():
    model = models.BlockStack(dim=64, heads=4, depth=2)
    backend = offload_pass.backend(fraction=1.0, min_bytes=0, compiler="eager")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 64, 64)
    compiled(x).sum().backward()
    with torch.profiler.profile() as profile:
        compiled(x).sum().backward()
    names = {event.name for event in profile.events()}
    torch.compiler.reset()
    expected = {f"offload_pass::{op}" for op in ("offload", "offload_wait", "reload")}
    assert expected | {"offload_pass::reload_wait"} <= names


class _TinyLanguageModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.relu(self.embed(tokens)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _ops(graph: torch.fx.GraphModule) -> list[str]:
    """The ops that compute (the compile writes some views as reshapes)."""
    nodes = graph.graph.nodes
    return sorted(str(n.target) for n in nodes if n.op == "call_function" and not is_view(n))


def test_explain_plans_the_graphs_inductor_compiles():
    """explain runs Inductor's joint-graph passes before planning, as the compile does
    (the cross-entropy's scatter into zeros becomes a pointwise where)."""
    torch.manual_seed(0)
    model = _TinyLanguageModel()
    tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    (explained,) = offload_pass.explain(model, tokens, targets, fraction=0.0).plans
    backend = offload_pass.backend(fraction=0.0)
    torch.compile(model, backend=backend)(tokens, targets).backward()
    (compiled,) = backend.plans
    assert _ops(explained.forward) == _ops(compiled.forward)
    assert _ops(explained.backward) == _ops(compiled.backward)
    assert "aten.scatter.value" not in _ops(explained.backward)
    assert explained.prediction.peak_bytes == compiled.prediction.peak_bytes


def test_compare_with_profile_names_missing_plans_before_running_the_step():
    from offload_pass.validate import compare_with_profile

    ran = []
    with pytest.raises(ValueError, match="no plans to compare"):
        compare_with_profile(lambda: ran.append(1), [])
    assert not ran


def test_compute_gaps_are_the_compute_streams_idle_stretches_longest_first():
    from offload_pass.validate import Gap, KernelSpan, compute_gaps

    kernels = [
        KernelSpan(0.0, 1.0, "a", stream=7),
        KernelSpan(0.5, 3.0, "copy layout", stream=9),  # another stream: not compute
        KernelSpan(1.5, 2.0, "b", stream=7),
        KernelSpan(1.8, 4.0, "c", stream=7),  # overlaps b: no gap
        KernelSpan(7.0, 8.0, "d", stream=7),
    ]
    assert compute_gaps(kernels) == [Gap(3.0, "d"), Gap(0.5, "b")]
    assert compute_gaps([]) == []


def test_a_profiles_kernels_are_read_without_its_copies():
    import types

    import torch

    from offload_pass.validate import KernelSpan, _kernels

    def event(name, start_us, end_us, device_type=torch.autograd.DeviceType.CUDA, stream=7):
        span = types.SimpleNamespace(start=start_us, end=end_us)
        return types.SimpleNamespace(
            name=name, time_range=span, device_type=device_type, device_resource_id=stream
        )

    profile = types.SimpleNamespace(
        events=lambda: [
            event("triton_poi_fused_0", 10, 30),
            event("Memcpy DtoH (Device -> Pinned)", 30, 90, stream=9),
            event("Memset (Device)", 90, 91),
            event("aten::mm", 0, 40, device_type=torch.autograd.DeviceType.CPU),
        ]
    )
    assert _kernels(profile) == [KernelSpan(10e-6, 30e-6, "triton_poi_fused_0", 7)]


def test_a_comparison_says_how_long_compute_sat_idle_and_before_what():
    from offload_pass.validate import Comparison, Gap

    gaps = tuple(Gap(1e-3 / (i + 1), f"kernel_{i}") for i in range(7))
    text = str(Comparison((), 0.03, 0.031, 2e-4, 2**30, 2**30, 0, 5e-4, gaps))
    assert "compute idle: measured 2.59 ms in 7 gaps" in text
    assert "predicted waits for copies 200.0 us, for the host 500.0 us" in text
    assert "1.00 ms before kernel_0" in text
    assert "before kernel_4" in text and "before kernel_5" not in text
