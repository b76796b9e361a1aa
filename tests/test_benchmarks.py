"""The benchmark harness runs end to end on a tiny model, so it cannot rot."""

from __future__ import annotations

import json

import pytest

from benchmarks import compare

CONFIGS = ["compiled", "offload_pass fraction 0.5", "checkpoint blocks", "save_on_cpu"]


def test_harness_runs_on_a_tiny_model_and_writes_its_results(tmp_path):
    results = compare.main(
        [
            "--workloads",
            "tiny",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--configs",
            *CONFIGS,
        ]
    )
    rows = {r["config"]: r for r in results["workloads"]["tiny"]["rows"]}
    assert set(rows) == set(CONFIGS)
    assert rows["compiled"]["status"] == "ok" and rows["compiled"]["step_ratio"] == 1.0
    assert rows["offload_pass fraction 0.5"]["status"] == "ok"
    assert rows["offload_pass fraction 0.5"]["predicted_step_ms"] > 0
    assert rows["offload_pass fraction 0.5"]["bytes_moved"] is not None  # counted for ours
    moved_any = rows["offload_pass fraction 0.5"]["bytes_moved"] > 0
    assert (rows["offload_pass fraction 0.5"]["transfer_ops"] > 0) == moved_any
    assert rows["checkpoint blocks"]["bytes_moved"] is None  # not measured for peers
    assert rows["offload_pass fraction 0.5"]["split"] == "stock"
    assert rows["checkpoint blocks"]["split"] is None
    assert rows["save_on_cpu"]["status"] == "needs a CUDA device"
    (written,) = tmp_path.glob("*.json")
    assert json.loads(written.read_text())["workloads"]["tiny"]["rows"]
    (table,) = tmp_path.glob("*.md")
    assert "offload_pass fraction 0.5" in table.read_text()

    checked = json.loads(written.read_text())
    checked["workloads"]["tiny"]["targets"] = ["stale"]
    written.write_text(json.dumps(checked))
    rechecked = compare.main(["--recheck", str(written)])
    assert rechecked["workloads"]["tiny"]["targets"] == results["workloads"]["tiny"]["targets"]
    assert table.read_text() == compare.report(results)


NO_COPY_RATES = compare.Hardware("cpu", None, None, None, None)


def _point(config: str, family: str, step_ms: float, peak_gib: float) -> dict:
    return {
        "config": config,
        "family": family,
        "status": "ok",
        "step_ms": step_ms,
        "peak_bytes": int(peak_gib * compare.GiB),
    }


POINTS = [
    _point("compiled", "no offload", 100.0, 10.0),
    _point("offload_pass auto", "offload_pass", 102.0, 8.0),
    _point("offload_pass fraction 1", "offload_pass", 200.0, 6.0),
]


def test_targets_say_by_how_much_each_peer_is_not_dominated():
    peers = [
        _point("megatron-core", "megatron-core", 110.0, 9.0),
        _point("memory_budget 0.7", "memory_budget", 101.0, 8.5),
        _point("save_on_cpu", "save_on_cpu", 400.0, 5.5),
    ]
    assert compare.check_targets(POINTS + peers, NO_COPY_RATES) == [
        "pareto: megatron-core (110.0 ms, 9.00 GiB): dominated by offload_pass auto",
        "pareto: memory_budget 0.7 (101.0 ms, 8.50 GiB): NOT dominated: the fastest of ours "
        "at or under its peak, offload_pass auto, is 1.0 ms (1.0%) slower",
        "pareto: save_on_cpu (400.0 ms, 5.50 GiB): NOT dominated: our lowest peak, "
        "offload_pass fraction 1 at 6.00 GiB, is 0.50 GiB above it",
    ]


def test_checkpointing_target_names_the_nearest_of_ours():
    above_ours = _point("checkpoint blocks", "checkpointing", 150.0, 7.0)
    under_ours = _point("checkpoint blocks", "checkpointing", 150.0, 5.0)
    assert compare.check_targets(POINTS + [above_ours], NO_COPY_RATES)[-1] == (
        "checkpointing: offload_pass fraction 1 is 33.3% slower at no more peak "
        "(target >= 10% faster): MISSED"
    )
    assert compare.check_targets(POINTS + [under_ours], NO_COPY_RATES)[-1] == (
        "checkpointing: no offload_pass point at or under its peak, 136.4 ms wanted; our "
        "lowest peak, offload_pass fraction 1 at 6.00 GiB, is 1.00 GiB above it: MISSED"
    )


def test_the_pass_on_top_of_checkpointing_does_not_count_against_checkpointing():
    """Checkpointing with the pass moving nothing is checkpointing: within noise of it,
    it must neither dominate it nor be the point that beats it."""
    checkpoint = _point("checkpoint blocks", "checkpointing", 150.0, 7.0)
    on_top = _point("checkpoint blocks, offload_pass auto", "offload_pass", 149.0, 7.0)
    lines = compare.check_targets(POINTS + [checkpoint, on_top], NO_COPY_RATES)
    assert lines[0] == (
        "pareto: checkpoint blocks (150.0 ms, 7.00 GiB): NOT dominated: the fastest of ours "
        "at or under its peak, offload_pass fraction 1, is 50.0 ms (33.3%) slower"
    )
    assert lines[-1] == (
        "checkpointing: offload_pass fraction 1 is 33.3% slower at no more peak "
        "(target >= 10% faster): MISSED"
    )


def test_op_overhead_times_each_transfer_op():
    import torch

    from benchmarks import op_overhead
    from offload_pass import runtime

    before = runtime.counts()
    rows = dict(op_overhead.measure(torch.device("cpu"), calls=3))
    assert list(rows)[:2] == ["offload and offload_wait", "reload and reload_wait"]
    assert rows["all four, per storage moved"] == sum(list(rows.values())[:2])
    assert {"a further storage in one offload", "a further storage in one reload"} <= set(rows)
    assert "all four, per storage, 8 a bucket" in rows
    # one to reload and 2 x 3 timed, alone, then as many in buckets of 8
    assert runtime.counts().offloads == before.offloads + 7 + 7 * 8
    assert runtime.counts().pending_offloads == before.pending_offloads


def test_megatron_decoder_has_the_workload_shape_and_trains():
    import dataclasses

    import pytest
    import torch

    pytest.importorskip("megatron.core")
    from benchmarks import workloads
    from benchmarks.megatron import megatron_forward

    w = dataclasses.replace(workloads.TINY, dtype=torch.bfloat16)
    model, x = workloads.build(w, "cpu")
    count = sum(p.numel() for p in model.parameters())
    loss_of_batch = megatron_forward(model, offload=())
    loss = loss_of_batch(x)
    loss.backward()
    parameters = list(loss_of_batch.block.parameters())
    qkv_biases = w.layers * 3 * w.dim
    assert sum(p.numel() for p in parameters) == count + qkv_biases
    assert torch.isfinite(loss) and all(p.grad is not None for p in parameters)
    assert {p.dtype for p in parameters} == {torch.bfloat16}  # CUDA's layer_norm wants one
    assert all(p.device.type == "meta" for p in model.parameters())


def test_code_peak_follows_allocations_reuses_and_last_aliases():
    import torch

    from benchmarks.inductor_memory import code_peak

    base = torch.empty(64, dtype=torch.uint8)
    saved = {"view_a": base[:32], "view_b": base[32:]}  # one 64-byte storage
    code = "\n".join(
        [
            "        buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)",  # +64
            "        del view_a",  # view_b still holds the storage
            "        buf1 = reinterpret_tensor(buf0, (16, ), (1, ), 0); del buf0  # reuse",
            "        buf2 = empty_strided_cpu((8, ), (1, ), torch.bfloat16)",  # +16
            "        del view_b",  # -64
            "        del buf1",  # -64
        ]
    )
    peak, at = code_peak(code, resident=100, saved=saved, host={})
    assert peak == 100 + 64 + 64 + 16
    assert at.startswith("buf2 = empty_strided_cpu")


def test_code_peak_counts_reloads_on_the_device_and_host_buffers_nowhere():
    from benchmarks.inductor_memory import code_peak

    code = "\n".join(
        [
            "        buf0 = torch.ops.offload_pass.reload.default([h0, h1], device(type='cpu'), [buf9])",  # noqa: E501
            "        buf7 = buf0",  # the ticket, renamed
            "        buf1 = torch.ops.offload_pass.reload_wait.default(buf7, [h0, h1], device(type='cpu'))",  # noqa: E501
            "        buf8 = buf9[0]",  # another op's tuple: nothing reloaded
            "        buf5 = buf1[0]",
            "        buf6 = buf1[1]",
            "        del buf7",  # the ticket: the reloaded tensors are buf5's and buf6's now
            "        del h0",  # a host buffer: nothing on the device
            "        del buf1",  # the list: its tensors live on
            "        buf2 = buf5",
            "        del buf5",  # buf2 still holds the first reloaded tensor
            "        del buf6",  # -32
            "        buf3 = empty_strided_cpu((16, ), (1, ), torch.float32)",  # +64
            "        del buf2",  # -128
        ]
    )
    peak, at = code_peak(code, resident=10, saved={}, host={"h0": 128, "h1": 32})
    assert peak == 10 + 128 + 64
    assert at.startswith("buf3 = empty_strided_cpu")


def test_code_input_names_follow_the_codes_unpacking_in_placeholder_order():
    import torch.fx

    from benchmarks.inductor_memory import code_input_names

    graph = torch.fx.Graph()
    graph.output((graph.placeholder("primals_1"), graph.placeholder("getitem_104")))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    code = "    def call(self, args):\n        primals_1, getitem_75 = args\n"
    assert code_input_names(code, gm) == {"primals_1": "primals_1", "getitem_104": "getitem_75"}


def _zoo_row(config: str, **figures: float) -> dict:
    return {"config": config, "status": "ok", "bytes_moved": 0, **figures}


def test_zoo_targets_say_which_are_missed_and_by_how_much():
    from benchmarks import zoo

    gib = 2**30
    rows = [
        _zoo_row("compiled", peak_bytes=6 * gib),
        _zoo_row(
            "offload_pass auto",
            peak_bytes=5 * gib,
            step_ratio=1.05,
            peak_saved_bytes=gib,
            predicted_peak_saved_bytes=2 * gib,
            step_prediction_error=0.02,
            peak_prediction_error=0.2,
        ),
    ]
    lines = zoo.check_targets(rows)
    assert "auto step ratio 1.050 (target <= 1.03): MISSED" in lines
    assert "auto peak 5.00 GiB against stock 6.00 (target never above stock): met" in lines
    assert "auto saves 1.00 GiB of the 2.00 predicted (50%) (target >= 80%): MISSED" in lines
    assert "offload_pass auto: step prediction error 2.0% (target <= 10%): met" in lines
    assert "offload_pass auto: peak prediction error 20.0% (target <= 10%): MISSED" in lines


def test_zoo_auto_moving_bytes_for_no_predicted_saving_is_a_miss():
    from benchmarks import zoo

    rows = [
        _zoo_row("compiled", peak_bytes=100),
        _zoo_row(
            "offload_pass auto",
            peak_bytes=90,
            step_ratio=1.0,
            bytes_moved=2**30,
            predicted_peak_saved_bytes=0,
        ),
    ]
    assert "auto moves 1.00 GiB for no predicted saving: MISSED" in zoo.check_targets(rows)
    per_block = [rows[0], {**rows[1], "predicted_peak_saved_bytes": None}]
    assert not any("no predicted saving" in line for line in zoo.check_targets(per_block))


def test_zoo_checks_autos_ratio_on_the_steps_taken_in_turns_where_measured():
    from benchmarks import zoo

    gib = 2**30
    auto = _zoo_row("offload_pass auto", peak_bytes=5 * gib, step_ratio=1.2, peak_saved_bytes=gib)
    rows = [_zoo_row("compiled", peak_bytes=6 * gib), {**auto, "paired_step_ratio": 1.01}]
    assert "auto step ratio in turns 1.010 (target <= 1.03): met" in zoo.check_targets(rows)
    assert "auto step ratio 1.200 (target <= 1.03): MISSED" in zoo.check_targets(rows[:1] + [auto])
    controlled = [{**rows[0], "paired_step_ratio": 1.04}, rows[1]]
    assert (
        "auto step ratio in turns 1.010 (the stock compile against a second one, in turns: "
        "1.040) (target <= 1.03): met"
    ) in zoo.check_targets(controlled)


def test_steps_in_turns_read_the_slower_configuration_as_slower():
    import time

    import torch

    from benchmarks.configs import Config
    from benchmarks.measure import steps_in_turns

    def slowed(model, shared):
        def forward(x):
            time.sleep(0.02)
            return model(x).sum()

        return forward

    built = []

    def build():
        built.append(torch.nn.Linear(8, 1))
        return built[-1], torch.randn(4, 8)

    plain = Config("plain", "no offload", lambda model, shared: lambda x: model(x).sum())
    slow = Config("slow", "no offload", slowed)
    turns = steps_in_turns(plain, slow, build, torch.device("cpu"), rounds=3)
    assert len(built) == 2
    assert turns.ratio > 2
    assert turns.other_ms >= 20 > turns.baseline_ms
    assert steps_in_turns(slow, plain, build, torch.device("cpu"), rounds=3).ratio < 0.5
    assert all(m.weight.grad is None for m in built)


def _stock_and_auto_in_turns():
    """A stock compile's step and an ``auto`` step measured alone and in turns, with
    ``auto``'s predictions."""
    from benchmarks.measure import Measurement

    stock = Measurement("compiled", "stock", "ok", step_ms=9.4, forward_ms=3.1, peak_bytes=10)
    auto = Measurement(
        "offload_pass auto",
        "offload_pass",
        "ok",
        step_ms=11.9,
        forward_ms=3.0,
        peak_bytes=10,
        predicted_step_ms=10.3,
        predicted_forward_ms=2.4,
        paired_step_ratio=1.004,
        paired_step_ms=10.0,
    )
    return stock, auto


def test_zoo_checks_the_step_predicted_against_the_step_measured_in_turns_too():
    from benchmarks import zoo

    hardware = compare.Hardware("cpu", None, None, None, None)
    stock, auto = _stock_and_auto_in_turns()
    rows = compare.derive([stock, auto], hardware)
    assert rows[1]["step_prediction_error"] == pytest.approx(1.6 / 11.9)
    assert rows[1]["step_prediction_error_in_turns"] == pytest.approx(0.03)
    assert "step_prediction_error_in_turns" not in compare.derive([stock], hardware)[0]
    lines = zoo.check_targets(rows)
    assert "offload_pass auto: step prediction error 13.4% (target <= 10%): MISSED" in lines
    assert "offload_pass auto: step prediction error in turns 3.0% (target <= 10%): met" in lines


def test_report_shows_each_steps_forward_measured_and_predicted():
    hardware = compare.Hardware("cpu", None, None, None, None)
    results = {"date": "", "torch": "", "hardware": hardware.__dict__, "workloads": {}}
    rows = compare.derive(list(_stock_and_auto_in_turns()), hardware)
    results["workloads"]["m"] = {"rows": rows, "targets": [], "auto_profiled": None}
    table = compare.report(results)
    assert "ms in turns" in table
    header, stock_row, auto_row = (
        [cell.strip() for cell in line.split("|")]
        for line in table.splitlines()
        if line.startswith("| ")
    )
    stock_cells = dict(zip(header, stock_row, strict=True))
    cells = dict(zip(header, auto_row, strict=True))
    assert (stock_cells["fwd ms"], stock_cells["pred fwd ms"]) == ("3.1", "")
    assert (cells["fwd ms"], cells["pred fwd ms"]) == ("3.0", "2.4")


def test_zoo_refuses_negative_paired_rounds(capsys):
    from benchmarks import zoo

    with pytest.raises(SystemExit):
        zoo.main(["--models", "llama", "--paired-rounds", "-1", "--device", "cpu"])
    assert "--paired-rounds must be 0 or more, got -1" in capsys.readouterr().err


def test_zoo_harness_runs_a_tiny_model_on_the_cpu(tmp_path):
    import json

    import pytest

    pytest.importorskip("transformers")
    from benchmarks import zoo

    configs = ["compiled", "offload_pass fraction 0.5"]
    fitted = "offload_pass budget at checkpointing's peak, fitted"
    aiming = ["checkpoint blocks", fitted]  # compiled whole only
    argv = ["--models", "llama", "--configs", *configs, *aiming, "--steps", "2"]
    results = zoo.main([*argv, "--device", "cpu", "--out", str(tmp_path)])
    assert list(results["workloads"]) == ["llama", "llama per block"]
    whole, per_block = (w["rows"] for w in results["workloads"].values())
    assert [r["config"] for r in per_block] == configs
    assert all(r["status"] == "ok" for r in per_block)
    statuses = {r["config"]: r["status"] for r in whole}
    assert list(statuses) == [*configs, *aiming]
    assert statuses == {
        **dict.fromkeys([*configs, "checkpoint blocks"], "ok"),
        fitted: "needs a CUDA device",
    }
    (written,) = tmp_path.glob("*-zoo-llama.json")
    assert json.loads(written.read_text())["workloads"].keys() == results["workloads"].keys()


def test_peak_breakdown_names_the_zoo_configurations_it_does_not_know(capsys):
    from benchmarks import peak_breakdown

    with pytest.raises(SystemExit):
        peak_breakdown.main(["--zoo", "qwen2_gqa", "--configs", "compiled", "auto"])
    err = capsys.readouterr().err
    assert "unknown configurations ['auto']" in err
    assert "'offload_pass auto'" in err


def test_reduce_overhead_refuses_to_run_without_cuda(monkeypatch, capsys):
    import pytest
    import torch

    from benchmarks import reduce_overhead

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["reduce_overhead", "--replays", "20"])
    with pytest.raises(SystemExit):
        reduce_overhead.main()
    assert "CUDA graphs need a CUDA device" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["reduce_overhead", "--replays", "5"])
    with pytest.raises(SystemExit):
        reduce_overhead.main()
    assert "--replays must be above 10, got 5" in capsys.readouterr().err


def test_a_failed_compile_is_reported_by_the_exception_it_wraps():
    from benchmarks.measure import _root_cause

    class Wrapper(Exception):  # as Dynamo's BackendCompilerFailed: raised from None
        def __init__(self, inner: Exception) -> None:
            super().__init__("backend='OffloadBackend(...)' raised:")
            self.inner_exception = inner

    try:
        try:
            raise ValueError("shapes are incompatible\nsecond line")
        except ValueError as inner:
            raise Wrapper(inner) from None
    except Wrapper as error:
        assert _root_cause(error) == "ValueError: shapes are incompatible"


def test_recompute_levels_plans_each_split_and_names_the_one_kept():
    from benchmarks import recompute_levels
    from offload_pass.joint import RECOMPUTE_LEVELS

    # under the small stack's peak with nothing moved (1.09 MiB), above a recomputing
    # split's (0.98 MiB at 0.4)
    rows = recompute_levels.main(["--workload", "tiny", "--budget-gib", "0.001"])
    assert [r["split"] for r in rows[:-1]] == [f"{level:g}" for level in (1.0, *RECOMPUTE_LEVELS)]
    assert rows[0]["over budget MiB"] > 0
    kept = rows[-1]
    assert str(kept["split"]).startswith("kept: ")
    assert kept["over budget MiB"] == 0
    same = {k: v for k, v in kept.items() if k != "split"}
    assert any(same == {k: v for k, v in r.items() if k != "split"} for r in rows[:-1])


def test_kernel_count_reads_the_calls_of_inductors_wrapper_by_kind():
    from benchmarks.kernel_count import calls_in_code

    code = """
def triton_kernel_source():
    extern_kernels.mm(a, b, out=c)

def call(args):
    primals_1, = args
    assert_size_stride(primals_1, (8, 8), (8, 1), 'torch.ops.aten.mm.default')
    buf0 = empty_strided_cuda((8, 8), (8, 1), torch.float32)
    extern_kernels.mm(primals_1, reinterpret_tensor(primals_1, (8, 8), (1, 8), 0), out=buf0)
    triton_poi_fused_relu_0.run(buf0, 64, stream=stream0)
    buf1 = torch.ops.aten._scaled_dot_product_flash_attention.default(buf0, buf0, buf0)
    return (buf0, )

def benchmark_compiled_module():
    triton_poi_fused_relu_0.run(x, 64)
"""
    calls = calls_in_code(code)
    assert calls == {
        "asserts": 1,
        "allocations": 1,
        "extern": 1,
        "reinterprets": 1,
        "triton": 1,
        "aten": 1,
    }


def test_kernel_count_sums_the_launching_calls_of_each_pass():
    from benchmarks.kernel_count import launches_by_pass

    forward = """
def call(args):
    primals_1, primals_2 = args
    buf0 = empty_strided_cuda((8, 8), (8, 1), torch.float32)
    extern_kernels.mm(primals_1, primals_2, out=buf0)
    triton_poi_fused_gelu_0.run(buf0, 64, stream=stream0)
    return (buf0, primals_1)
"""
    backward = """
def call(args):
    primals_1, buf0, tangents_1 = args
    buf1 = empty_strided_cuda((8, 8), (8, 1), torch.float32)
    triton_poi_fused_gelu_backward_0.run(tangents_1, buf0, buf1, 64, stream=stream0)
    extern_kernels.mm(buf1, primals_1, out=buf1)
    buf2 = torch.ops.aten._scaled_dot_product_flash_attention_backward.default(buf1)
    triton_red_fused_sum_1.run(buf1, 8, 8, stream=stream0)
    return (buf1, buf2)
"""
    assert launches_by_pass([forward, backward, forward]) == {"forward": 4, "backward": 4}


def test_step_breakdown_sorts_kernels_and_prices_every_node_once():
    import offload_pass
    from benchmarks import step_breakdown, workloads

    assert step_breakdown.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "products"
    assert step_breakdown.kernel_kind("cudnn_generated_fort_native_sdpa_sm90") == "attention"
    assert step_breakdown.kernel_kind("triton_poi_fused_gelu_view_2") == "other"
    assert step_breakdown.kernel_kind("Memcpy DtoH (Device -> Pinned)") == "copies"
    model, x = workloads.build(workloads.BY_NAME["tiny"], "cpu")
    (plan,) = offload_pass.explain(workloads.WithLoss(model), x, fraction=0.0).plans
    by_kind = step_breakdown.predicted_by_kind([plan])
    assert by_kind["products"] > 0 and by_kind["attention"] > 0
    every_node = sum(plan.costs.forward_seconds) + sum(plan.costs.backward_seconds)
    assert sum(by_kind.values()) == pytest.approx(every_node)


def test_planning_time_times_every_stage_and_the_search_with_its_partitions(capsys):
    from benchmarks import planning_time

    planning_time.main(["--layers", "2", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[-3:] == ["with", "partitions", "s"] and "search" in header
    searched = next(line for line in lines if planning_time.SEARCHED in line).split()
    total, _, wall = map(float, searched[-3:])
    assert wall >= total > 0  # the partitions come on top


def test_planning_time_counts_a_full_collection_in_a_stage(monkeypatch):
    import gc

    from benchmarks import planning_time, workloads
    from offload_pass import driver

    def collecting(*args, **kwargs):
        gc.collect()
        return bucket_transfers(*args, **kwargs)

    bucket_transfers = driver.bucket_transfers
    monkeypatch.setattr(driver, "bucket_transfers", collecting)
    options = planning_time.MODES["fraction 1"]
    timed = planning_time.timed_pass(workloads.TINY, 2, options)
    assert 0 < timed.collections <= sum(timed.stage_seconds.values())


def test_planning_time_counts_the_full_collections_while_open_and_only_then():
    import gc

    from benchmarks import planning_time

    with planning_time.full_collections() as pauses:
        gc.collect(1)  # a younger generation's: not counted
        gc.collect()
    gc.collect()
    assert len(pauses) == 1 and pauses[0] > 0


def test_planning_time_times_the_modes_asked_for_on_graphs_of_both_sizes(capsys):
    from benchmarks import planning_time

    planning_time.main(["--layers", "2", "--repeats", "1", "--modes", "auto"])
    header, _, *rows = capsys.readouterr().out.splitlines()[:-1]
    assert header.split()[:6] == ["layers", "joint", "nodes", "split", "nodes", "mode"]
    (row,) = rows
    layers, joint_nodes, split_nodes, mode = row.split()[:4]
    assert (layers, mode) == ("2", "auto")
    assert 0 < int(joint_nodes) < int(split_nodes)


def test_a_fitted_step_reports_only_the_kept_budgets_plan(monkeypatch):
    """Where a later trial ran after the one the fit keeps, the kept budget is compiled
    afresh: its first backend would plan the recompile beside its first plan, and the
    harness sums a backend's plans into the predicted step."""
    import offload_pass
    from benchmarks import configs, workloads

    model, x = workloads.build(workloads.TINY, "cpu")
    target = 1 << 20
    peaks = iter([target * 1.1, target * 0.9, target * 1.05])  # over, under, over

    def scripted_peak(run) -> int:
        run()
        return int(next(peaks))

    monkeypatch.setattr(offload_pass, "cuda_peak", scripted_peak)
    shared: dict = {}
    step = configs.fitted_step(workloads.WithLoss(model), target, shared)
    step(x).backward()
    step(x).backward()
    (plan,) = shared["backend"].plans
    assert shared["backend"].options.memory_budget < target  # the second trial's budget
    assert plan.prediction.step_seconds > 0


def test_configs_name_a_budget_of_any_size_and_reject_unknown_names(capsys):
    from torch import nn

    from benchmarks import configs

    chosen = configs.named(["offload_pass budget 12.40 GiB", "compiled"])
    assert [c.name for c in chosen] == ["offload_pass budget 12.40 GiB", "compiled"]
    shared: dict = {}
    chosen[0].prepare(nn.Linear(2, 2), shared)
    assert shared["backend"].options.memory_budget == round(12.4 * 2**30)
    fitted = configs.named(["offload_pass budget 12.35 GiB, fitted"])
    assert [(c.name, c.cuda_only) for c in fitted] == [
        ("offload_pass budget 12.35 GiB, fitted", True)
    ]
    assert [c.name for c in configs.named([])] == [c.name for c in configs.all_configs()]
    with pytest.raises(ValueError, match="a budget in GiB must be positive, got '0.0'"):
        configs.named(["offload_pass budget 0.0 GiB"])
    with pytest.raises(ValueError, match=r"unknown configurations \['no such config'\]"):
        configs.named(["compiled", "no such config"])
    with pytest.raises(SystemExit):
        compare.main(["--configs", "compiled", "no such config"])
    assert "unknown configurations ['no such config']" in capsys.readouterr().err


def test_compile_time_reports_medians_their_ratio_and_every_run(capsys):
    from benchmarks import compile_time

    stock_row, ours_row = compile_time.rows([10.0, 14.0, 11.0], [12.0, 11.5, 13.0], [0.3] * 3, 1.0)
    assert stock_row == ["stock Inductor", "11.0", "1.00", "", "10.0 14.0 11.0"]
    assert ours_row == ["offload_pass fraction 1", "12.0", "1.09", "0.3", "12.0 11.5 13.0"]
    with pytest.raises(SystemExit):
        compile_time.main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


def test_plan_repeat_says_which_process_planned_as_the_first_of_its_cache_setting(capsys):
    from benchmarks import plan_repeat

    first = {
        "bytes_moved": 2**30,
        "recompute_budgets": [0.5],
        "step_seconds": 0.6,
        "peak_bytes": 2**31,
    }
    slower = first | {"step_seconds": 0.6000001}
    table = plan_repeat.rows([("on", first), ("on", first), ("off", slower), ("off", first)])
    assert [row[:2] + row[-1:] for row in table] == [
        ["on", "1", "yes"],
        ["on", "2", "yes"],
        ["off", "1", "yes"],
        ["off", "2", "no"],
    ]
    assert table[0][2:6] == ["1.00", "0.5", "600.000000", "2.0000"]
    with pytest.raises(SystemExit):
        plan_repeat.main(["--processes", "1"])
    assert "--processes must be at least 2, got 1" in capsys.readouterr().err


def test_drained_host_time_counts_forward_and_backward_issued_but_not_the_drains(
    monkeypatch,
):
    import torch

    from benchmarks import measure

    clock = [0.0]
    events = []

    def drain():  # a device that takes 50 s to finish what was issued
        events.append("drain")
        clock[0] += 50.0

    class Issued(torch.autograd.Function):  # the host takes 1 s to issue each pass
        @staticmethod
        def forward(ctx, x):
            events.append("forward")
            clock[0] += 1.0
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            events.append("backward")
            clock[0] += 1.0
            return grad

    monkeypatch.setattr(torch.cuda, "synchronize", drain)
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    x = torch.ones(2, requires_grad=True)
    seconds = measure.drained_host_seconds(lambda batch: Issued.apply(batch).sum(), x)
    assert events == ["drain", "forward", "drain", "backward", "drain"]
    assert seconds == 2.0


def test_pass_device_time_counts_the_host_only_without_a_head_start(monkeypatch):
    import torch

    from benchmarks import measure

    host_issues, device_runs = {"forward": 3.0, "backward": 1.0}, {"forward": 2.0, "backward": 5.0}
    clock = {"host": 0.0, "device": 0.0}  # how far each has come, in seconds

    def issue(name):  # the device runs a pass's kernels as the host issues them
        clock["host"] += host_issues[name]
        clock["device"] = max(clock["device"] + device_runs[name], clock["host"])

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):  # the device reaches the event once all before it has run
            self.at = max(clock["host"], clock["device"])

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    class Pass(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            issue("forward")
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            issue("backward")
            return grad

    def synchronize():
        clock["host"] = clock["device"] = max(clock.values())

    def spin(device, cycles):  # a head start of one second per cycle
        clock["device"] = max(clock.values()) + cycles

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(measure._compat, "spin_device", spin)
    x = torch.ones(2, requires_grad=True)

    def step(batch):
        return Pass.apply(batch).sum()

    idle = measure.pass_device_seconds(step, x, head_start_cycles=0)
    assert (idle.forward, idle.backward) == (3.0, 5.0)  # forward waits for the host
    queued = measure.pass_device_seconds(step, x, head_start_cycles=10)
    assert (queued.forward, queued.backward) == (2.0, 5.0)  # the device's own time
