"""Options: per-module fractions, set_fraction between steps, and clear errors."""

from __future__ import annotations

import pytest
import torch

import offload_pass
from offload_pass.calibration import profile_for
from tests import models
from tests.conftest import train_step


def _moved_modules(plan: offload_pass.Plan) -> set[str]:
    return {d.group.module_path.split(".")[1] for d in plan.moved}


def test_pattern_fractions_apply_per_module():
    model = models.BlockStack(depth=2)
    backend = offload_pass.backend(fraction={"blocks.1*": 1.0}, min_bytes=0, compiler="eager")
    train_step(torch.compile(model, backend=backend), torch.randn(2, 16, 32))
    (plan,) = backend.plans
    assert _moved_modules(plan) == {"1"}
    kept_in_0 = [d for d in plan.decisions if d.group.module_path.startswith("blocks.0")]
    assert kept_in_0 and all(not d.moved for d in kept_in_0)


def test_innermost_pattern_wins():
    model = models.BlockStack(depth=1)
    fraction = {"*": 1.0, "blocks.0.mlp": 0.0}
    backend = offload_pass.backend(fraction=fraction, min_bytes=0, compiler="eager")
    train_step(torch.compile(model, backend=backend), torch.randn(2, 16, 32))
    for decision in backend.plans[0].decisions:
        if decision.group.fixed_reason is None:
            in_mlp = decision.group.module_path.startswith("blocks.0.mlp")
            assert decision.moved != in_mlp, decision.group.module_path


def test_set_fraction_changes_the_next_plan():
    torch.manual_seed(0)
    model = models.BlockStack(depth=2)
    backend = offload_pass.backend(fraction=1.0, min_bytes=0, compiler="eager")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 16, 32)
    first = train_step(compiled, x)
    assert _moved_modules(backend.plans[-1]) == {"0", "1"}

    offload_pass.set_fraction(model.blocks[0], 0.0)
    assert backend.plans == [], "the discarded graph's plan leaves with it"
    second = train_step(compiled, x)
    assert len(backend.plans) == 1
    assert _moved_modules(backend.plans[-1]) == {"1"}
    for name in first[1]:
        assert torch.equal(first[1][name], second[1][name])

    offload_pass.set_fraction(model.blocks[0], 1.0)
    train_step(compiled, x)
    assert _moved_modules(backend.plans[-1]) == {"0", "1"}


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_fraction_out_of_range_is_rejected(fraction):
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        offload_pass.backend(fraction=fraction)
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        offload_pass.set_fraction(torch.nn.Linear(1, 1), fraction)


def test_fraction_in_a_mapping_is_checked_by_pattern():
    with pytest.raises(ValueError, match=r"fraction\['blocks\.\*'\] must be in \[0, 1\]"):
        offload_pass.backend(fraction={"blocks.*": 2})


def test_non_numeric_fraction_is_rejected():
    with pytest.raises(TypeError, match="fraction must be a number"):
        offload_pass.backend(fraction="half")


def test_unknown_compiler_is_rejected():
    with pytest.raises(ValueError, match="compiler must be one of .*'aot'"):
        offload_pass.backend(compiler="aot")


def test_negative_min_bytes_is_rejected():
    with pytest.raises(ValueError, match="min_bytes"):
        offload_pass.backend(min_bytes=-1)


def test_set_fraction_needs_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        offload_pass.set_fraction("blocks.0", 0.5)


def test_pattern_matching_no_module_names_the_pattern():
    backend = offload_pass.backend(fraction={"blocks.*.atn": 0.5}, compiler="eager")
    compiled = torch.compile(models.BlockStack(), backend=backend)
    with pytest.raises(Exception, match=r"pattern 'blocks\.\*\.atn' matches no module"):
        compiled(torch.randn(2, 16, 32))


def test_backend_is_registered_by_name():
    model = models.MLP()
    x = torch.randn(8, 64)
    out = torch.compile(model, backend="offload")(x)
    torch.compiler.reset()
    assert torch.equal(out, torch.compile(model)(x))
    assert offload_pass.default_backend.plans


def test_fraction_and_memory_budget_are_exclusive():
    with pytest.raises(ValueError, match="either fraction or memory_budget"):
        offload_pass.backend(fraction=0.5, memory_budget=0.5)


@pytest.mark.parametrize("budget", [0, -5, 1.5, 0.0, True, "1GB"])
def test_bad_memory_budget_is_rejected(budget):
    with pytest.raises((ValueError, TypeError), match="memory_budget"):
        offload_pass.backend(memory_budget=budget)


def test_bad_stall_tolerance_is_rejected():
    with pytest.raises(ValueError, match="stall_tolerance"):
        offload_pass.backend(stall_tolerance=1.5)


def test_unknown_profile_names_the_choices():
    with pytest.raises(ValueError, match="'h200'.*'calibrate'"):
        offload_pass.backend(profile="h300")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device can be calibrated")
def test_calibration_without_cuda_is_refused_by_backend():
    with pytest.raises(ValueError, match="calibrate.*CUDA"):
        offload_pass.backend(profile="calibrate")


def test_calibration_of_a_cpu_graph_says_it_needs_cuda():
    with pytest.raises(ValueError, match="calibrate.*CUDA.*graph is on cpu"):
        profile_for("calibrate", torch.device("cpu"))


def test_dump_dir_must_be_a_path():
    with pytest.raises(TypeError, match="dump_dir"):
        offload_pass.backend(dump_dir=3)


def test_dump_dir_must_not_be_a_file(tmp_path):
    file = tmp_path / "report.txt"
    file.write_text("")
    with pytest.raises(ValueError, match="dump_dir must be a folder"):
        offload_pass.backend(dump_dir=file)


def test_mode_follows_the_options():
    assert offload_pass.backend().options.mode == "auto"
    assert offload_pass.backend(fraction=0.3).options.mode == "fraction"
    assert offload_pass.backend(memory_budget=2**30).options.mode == "memory_budget"


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_bad_in_flight_microbatches_is_rejected(count):
    with pytest.raises(ValueError, match="in_flight_microbatches"):
        offload_pass.backend(in_flight_microbatches=count)


def test_in_flight_microbatches_of_known_schedules():
    from offload_pass.pipeline_parallel import in_flight_microbatches

    assert in_flight_microbatches("Schedule1F1B", 0, 4, 8) == 4
    assert in_flight_microbatches("Schedule1F1B", 3, 4, 8) == 1
    assert in_flight_microbatches("Schedule1F1B", 0, 4, 2) == 2
    assert in_flight_microbatches("ScheduleGPipe", 1, 2, 6) == 6
    with pytest.raises(ValueError, match="pass in_flight_microbatches yourself"):
        in_flight_microbatches("ScheduleInterleaved1F1B", 0, 2, 4)
    with pytest.raises(ValueError, match="stage_index"):
        in_flight_microbatches("Schedule1F1B", 4, 4, 8)


@pytest.mark.parametrize("budget", [0, 0.0, 1.5, -0.2, True, "0.5", "Search"])
def test_bad_recompute_budget_is_rejected(budget):
    with pytest.raises((ValueError, TypeError), match="recompute_budget"):
        offload_pass.backend(recompute_budget=budget)


def test_recompute_budget_is_kept_as_a_share():
    assert offload_pass.backend(recompute_budget=1).options.recompute_budget == 1.0
    assert offload_pass.backend().options.recompute_budget is None


def test_recompute_budget_search_lets_auto_and_budgets_choose_the_split():
    for options in ({}, {"memory_budget": 0.5}):
        chosen = offload_pass.backend(recompute_budget="search", **options).options
        assert chosen.recompute_budget == "search"
        assert chosen.fixed_recompute_budget is None  # the search starts at torch's setting
    with pytest.raises(ValueError, match="recompute_budget='search'.*with fraction"):
        offload_pass.backend(fraction=0.5, recompute_budget="search")


def test_options_are_checked_when_made_and_when_replaced():
    import dataclasses

    with pytest.raises(ValueError, match="fraction must be in"):
        offload_pass.OffloadOptions(fraction=2.0)
    options = offload_pass.OffloadOptions(fraction={"blocks.*": 0.5})
    assert options.patterns == (("blocks.*", 0.5),) and options.default_fraction == 0.0
    with pytest.raises(ValueError, match="either fraction or memory_budget"):
        dataclasses.replace(options, memory_budget=0.5)


def test_set_fraction_keeps_other_models_compiled():
    torch.manual_seed(0)
    stack, mlp = models.BlockStack(depth=2), models.MLP(32)
    planned_stack = offload_pass.backend(fraction=1.0, min_bytes=0, compiler="eager")
    planned_mlp = offload_pass.backend(fraction=1.0, min_bytes=0, compiler="eager")
    compiled_stack = torch.compile(stack, backend=planned_stack)
    compiled_mlp = torch.compile(mlp, backend=planned_mlp)
    x = torch.randn(2, 16, 32)
    train_step(compiled_stack, x)
    train_step(compiled_mlp, x)
    first_stack, first_mlp = planned_stack.plans, planned_mlp.plans
    offload_pass.set_fraction(stack.blocks[0], 0.0)
    train_step(compiled_stack, x)
    train_step(compiled_mlp, x)
    assert len(planned_stack.plans) == 1 and planned_stack.plans != first_stack, "planned again"
    assert planned_mlp.plans == first_mlp, "the other model keeps its compiled code"


def test_plans_do_not_pile_up_across_resets():
    backend = offload_pass.backend(fraction=1.0, min_bytes=0, compiler="eager")
    compiled = torch.compile(models.MLP(32), backend=backend)
    for _ in range(3):
        train_step(compiled, torch.randn(2, 16, 32))
        assert len(backend.plans) == 1
        torch.compiler.reset()
