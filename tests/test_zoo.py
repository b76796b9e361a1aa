"""Three training steps of each zoo model under offloading land as close to the stock
compile's as other stock runs do.

The sizes that change are compiled symbolically from the first step, so every model is
planned and rewritten with symbolic sizes; the static path is the rest of the suite's.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import offload_pass
from tests import models, zoo
from tests.conftest import reference_backend

SETTINGS = {
    "all": {"fraction": 1.0},
    "auto_h200": {"profile": models.H200_INSTANT_HOST},
}
INDUCTOR = frozenset({"llama", "gpt2", "resnet"})
"""Models whose stock runs and fraction-1 run compile with Inductor: a decoder, one with
graph breaks and a convolutional net. The others, and every ``auto`` run, run aot_eager's
kernels: the same graphs and the same rewrite, where each Inductor compile costs CI
about 25 s (T5's, the longest, more)."""


def compiler(name: str, setting: str) -> str:
    return "inductor" if name in INDUCTOR and setting == "all" else "eager"


@dataclasses.dataclass(frozen=True)
class Reference:
    model: nn.Module
    """The untrained model; every run trains a deep copy of it."""
    stock: list[zoo.Step]
    spread: list[zoo.Step]
    """Per tensor, how far stock runs land from ``stock``: a second compile (Inductor's
    parallel atomic adds sum in a different order from run to run) and aot_eager (the
    same graph in other kernels: offloading splits some of Inductor's fusions too)."""


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    return {}


def reference(references: dict[str, Reference], name: str) -> Reference:
    if name not in references:
        entry = zoo.ZOO[name]
        model = entry.model()
        stock_compiler = reference_backend(compiler(name, "all"))
        stock, again, eager = (
            zoo.train(copy.deepcopy(model), entry, other)
            for other in (stock_compiler, stock_compiler, "aot_eager")
        )
        spread = [
            {k: torch.maximum(a[k], b[k]) for k in a}
            for a, b in zip(
                zoo.largest_error(again, stock), zoo.largest_error(eager, stock), strict=True
            )
        ]
        references[name] = Reference(model, stock, spread)
    return references[name]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(
    "name",
    # one worker trains a model's references and every setting of it (pytest-xdist)
    [pytest.param(name, marks=pytest.mark.xdist_group(name)) for name in zoo.ZOO],
)
def test_training_matches_the_stock_compile(name, setting, references):
    if zoo.ZOO[name].requires:
        pytest.importorskip(zoo.ZOO[name].requires)
    ref = reference(references, name)
    backend = offload_pass.backend(
        min_bytes=0, compiler=compiler(name, setting), **SETTINGS[setting]
    )
    steps = zoo.train(copy.deepcopy(ref.model), zoo.ZOO[name], backend)
    zoo.assert_within(steps, ref.stock, ref.spread)
    assert sum(plan.bytes_moved for plan in backend.plans) > 0
    assert all(zoo.compiled_symbolically(plan) for plan in backend.plans)


def test_the_rounding_bound_holds_stock_runs_and_catches_swapped_steps():
    """``zoo.rounding_bound``, the CUDA zoo tests' tolerance, admits a stock run and
    rejects steps given another step's gradients, as a backward handed another
    microbatch's saved tensors would be."""
    entry = zoo.ZOO["vit"]
    model = entry.model()
    stock, eager = (zoo.train(copy.deepcopy(model), entry, name) for name in ("aot_eager", "eager"))
    exact = zoo.train_in_float64(copy.deepcopy(model), entry)
    allowed = zoo.rounding_bound(stock, [eager], exact)

    zoo.assert_within(eager, stock, allowed)
    with pytest.raises(AssertionError):
        zoo.assert_within([stock[1], stock[0], *stock[2:]], stock, allowed)
