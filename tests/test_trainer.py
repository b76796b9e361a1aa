"""The routes into ``transformers.Trainer`` and ``accelerate`` that docs/guide.md documents,
each trained against the same loop with stock ``torch.compile``.

A small Llama trains on variable-length batches, padded or packed, with gradient
accumulation. The offloading run's loss and gradient norm at every optimizer step, and its
first step's gradients, land no further from the stock Inductor run's than stock
``aot_eager``'s do (``tests/zoo.py``'s tolerance); its plans move bytes, and its
checkpoint saves and reloads under the model's own parameter names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn

import offload_pass
from tests import zoo

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import safetensors.torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import TorchDynamoPlugin  # noqa: E402
from transformers import (  # noqa: E402
    DataCollatorWithFlattening,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

VOCAB = zoo.VOCAB
BATCH = 2
ACCUMULATION = 2
STEPS = 3
"""Optimizer steps; each takes ``ACCUMULATION`` batches of ``BATCH`` sequences."""

Batch = dict[str, torch.Tensor]


def llama() -> LlamaForCausalLM:
    """The zoo's Llama, seeded, without a KV cache (training uses none)."""
    torch.manual_seed(0)
    model = zoo.llama()
    model.config.use_cache = False
    return model


class Sequences(torch.utils.data.Dataset):
    """Token sequences of 8 to 23 tokens, fixed by a seed."""

    def __init__(self, count: int = BATCH * ACCUMULATION * STEPS) -> None:
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, 24, (count,), generator=gen).tolist()
        self.items = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


def pad(features: list[dict[str, torch.Tensor]]) -> Batch:
    """Right padding to the longest sequence, masked out of attention and the loss."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


COLLATORS: dict[str, Callable[[list[dict[str, torch.Tensor]]], Batch]] = {
    "padded": pad,
    "packed": DataCollatorWithFlattening(),
}


def trained_steps(
    log: list[dict[str, float]], first_grads: dict[str, torch.Tensor]
) -> list[zoo.Step]:
    """A run's loss and gradient norm per optimizer step, and the first step's gradients.

    Later steps' gradients are left out: AdamW turns gradients a rounding apart into
    parameters many roundings apart, which every later gradient inherits.
    """
    steps = [
        {"loss": torch.tensor(e["loss"]), "grad_norm": torch.tensor(e["grad_norm"])}
        for e in log
        if "loss" in e
    ]
    assert len(steps) == STEPS
    assert first_grads
    steps[0].update(first_grads)
    return steps


def fresh_accelerate_state() -> None:
    """accelerate keeps one configuration per process, its compile settings included, in
    state that every later ``Accelerator`` (and ``Trainer``) reuses; each run here starts
    from none, as a new process would."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class FirstGradients(transformers.TrainerCallback):
    """Keeps the gradients of the first optimizer step, by the names in ``model``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if not self.grads:
            self.grads = gradients(self.model)


def train_with_trainer(
    model: nn.Module, collator: str, out: str, **args: object
) -> tuple[Trainer, list[zoo.Step]]:
    arguments = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **args,
    )
    first = FirstGradients(model)
    fresh_accelerate_state()
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=Sequences(),
        data_collator=COLLATORS[collator],
        callbacks=[first],
    )
    trainer.train()
    return trainer, trained_steps(trainer.state.log_history, first.grads)


def train_with_accelerate(
    model: nn.Module, collator: str, dynamo_plugin: TorchDynamoPlugin | None = None
) -> tuple[Accelerator, nn.Module, list[zoo.Step]]:
    """accelerate's own loop: ``accumulate``, ``backward``, clipping, an AdamW step."""
    fresh_accelerate_state()
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=ACCUMULATION, dynamo_plugin=dynamo_plugin
    )
    original = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        Sequences(), batch_size=BATCH, collate_fn=COLLATORS[collator]
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    log: list[dict[str, float]] = []
    first: dict[str, torch.Tensor] = {}
    total = 0.0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            total += loss.item() / ACCUMULATION
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                log.append({"loss": total, "grad_norm": norm.item()})
                first = first or gradients(original)
                total = 0.0
            optimizer.step()
            optimizer.zero_grad()
    return accelerator, model, trained_steps(log, first)


@dataclasses.dataclass(frozen=True)
class Reference:
    stock: list[zoo.Step]
    spread: list[zoo.Step]


def reference(run: Callable[[str], list[zoo.Step]]) -> Reference:
    """``run(backend)`` with stock Inductor, and how far stock aot_eager lands from it."""
    stock = run("inductor")
    torch.compiler.reset()
    eager = run("aot_eager")
    torch.compiler.reset()
    return Reference(stock, zoo.largest_error(eager, stock))


def bytes_moved(backend: offload_pass.OffloadBackend) -> int:
    return sum(plan.bytes_moved for plan in backend.plans)


def assert_clean_keys(state_dict: dict[str, torch.Tensor]) -> None:
    assert state_dict
    assert not [k for k in state_dict if "_orig_mod" in k]


def assert_reloads(reloaded: dict[str, torch.Tensor], model: nn.Module) -> None:
    """A saved checkpoint has the model's own parameter names and values."""
    assert_clean_keys(model.state_dict())
    assert reloaded.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded[name], value), name


@pytest.mark.parametrize(("collator", "mode"), [("padded", None), ("packed", "reduce-overhead")])
def test_trainer_trains_a_model_compiled_in_place_like_stock_compile(collator, mode, tmp_path):
    expected = reference(
        lambda name: train_with_trainer(
            llama(),
            collator,
            str(tmp_path / name),
            torch_compile_backend=name,
            torch_compile_mode=mode if name == "inductor" else None,
        )[1]
    )
    model = llama()
    backend = offload_pass.backend(fraction=0.5, min_bytes=0)
    model.compile(backend=backend, mode=mode)
    if mode is None:
        trainer, steps = train_with_trainer(model, collator, str(tmp_path / "offload"))
    else:  # a CUDA-graph mode: the backend warns what CUDA graphs do to graphs with transfers
        with pytest.warns(UserWarning, match="CUDA graphs"):
            trainer, steps = train_with_trainer(model, collator, str(tmp_path / "offload"))
    zoo.assert_within(steps, expected.stock, expected.spread)
    assert bytes_moved(backend) > 0
    assert any(zoo.compiled_symbolically(p) for p in backend.plans if p.bytes_moved)

    trainer.save_model(str(tmp_path / "saved"))
    assert_reloads(LlamaForCausalLM.from_pretrained(str(tmp_path / "saved")).state_dict(), model)


@pytest.mark.parametrize("regional", [False, True], ids=["whole", "regional"])
def test_accelerate_trains_a_model_compiled_in_place_like_its_dynamo_plugin(regional, tmp_path):
    """Whole: fraction 1 by registered name, on padded batches. Regional: fraction 1
    after recomputing down to half the saved bytes, on packed ones, against stock compiles
    with the same recompute budget. Both compile for symbolic sizes from the first batch
    (``dynamic=True``; the Trainer tests compile static sizes first)."""
    collator = "packed" if regional else "padded"
    recompute = 0.5 if regional else None
    with torch._functorch.config.patch(activation_memory_budget=recompute or 1.0):
        expected = reference(
            lambda name: train_with_accelerate(
                llama(),
                collator,
                TorchDynamoPlugin(backend=name, use_regional_compilation=regional, dynamic=True),
            )[2]
        )
    model = llama()
    if regional:
        backend = offload_pass.backend(fraction=1.0, recompute_budget=recompute, min_bytes=0)
        compiled = offload_pass.compile_regions(model, backend, dynamic=True)
        assert {"model.layers.0", "model.layers.1", "lm_head"} <= set(compiled)
    else:
        backend = offload_pass.register_backend(
            "offload_test_accelerate", fraction=1.0, min_bytes=0
        )
        model.compile(backend="offload_test_accelerate", dynamic=True)
    accelerator, prepared, steps = train_with_accelerate(model, collator)
    zoo.assert_within(steps, expected.stock, expected.spread)
    assert bytes_moved(backend) > 0

    assert_clean_keys(accelerator.get_state_dict(prepared))
    accelerator.save_model(prepared, str(tmp_path / "saved"))
    reloaded = llama()
    reloaded.load_state_dict(safetensors.torch.load_file(tmp_path / "saved" / "model.safetensors"))
    assert_reloads(reloaded.state_dict(), model)


def test_trainer_and_accelerate_reject_a_backend_name_outside_accelerates_enum(tmp_path):
    """Why the routes above compile in place: both loops pass the name through
    accelerate's ``DynamoBackend`` enum, registered names included."""
    offload_pass.register_backend("offload_test_enum", fraction=0.5)
    for name in ("offload", "offload_test_enum"):
        arguments = TrainingArguments(
            output_dir=str(tmp_path), torch_compile_backend=name, use_cpu=True, report_to=[]
        )
        fresh_accelerate_state()
        with pytest.raises(ValueError, match="is not a valid DynamoBackend"):
            Trainer(model=llama(), args=arguments, train_dataset=Sequences())
        fresh_accelerate_state()
        with pytest.raises(ValueError, match="is not a valid DynamoBackend"):
            Accelerator(cpu=True, dynamo_backend=name)
    fresh_accelerate_state()


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_registered_name_compiles_with_its_options():
    backend = offload_pass.register_backend(
        "offload_test_all", fraction=1.0, min_bytes=0, compiler="eager"
    )
    assert torch._dynamo.lookup_backend("offload_test_all") is backend
    again = offload_pass.register_backend(
        "offload_test_all", fraction=1.0, min_bytes=0, compiler="eager"
    )
    assert again is backend
    torch.manual_seed(0)
    model = Tiny()
    torch.compile(model, backend="offload_test_all")(torch.randn(8, 16)).sum().backward()
    (plan,) = backend.plans
    assert plan.moved and all(d.moved for d in plan.decisions if d.group.fixed_reason is None)


@pytest.mark.parametrize(
    ("options", "error", "named"),
    [
        ({"fraction": 1.5}, ValueError, "fraction"),
        ({"memory_budget": 0}, ValueError, "memory_budget"),
        ({"memory_budget": "half"}, TypeError, "memory_budget"),
        ({"recompute_budget": 1.5}, ValueError, "recompute_budget"),
        ({"fraction": 0.5, "memory_budget": 0.5}, ValueError, "fraction or memory_budget"),
        ({"fractoin": 0.5}, TypeError, "fractoin"),
    ],
)
def test_registering_bad_options_fails_naming_the_option(options, error, named):
    with pytest.raises(error, match=named):
        offload_pass.register_backend("offload_test_bad", **options)
    assert "offload_test_bad" not in torch._dynamo.list_backends(exclude_tags=())


def test_a_taken_name_or_other_options_under_a_registered_name_are_refused():
    offload_pass.register_backend("offload_test_taken", fraction=0.25)
    with pytest.raises(ValueError, match="registered with other options"):
        offload_pass.register_backend("offload_test_taken", fraction=0.5)
    for name in ("inductor", "offload"):
        with pytest.raises(ValueError, match="already a torch.compile backend name"):
            offload_pass.register_backend(name, fraction=0.5)
    for name in ("", " offload_test_space"):
        with pytest.raises(ValueError, match="a backend name is"):
            offload_pass.register_backend(name, fraction=0.5)
    with pytest.raises(TypeError, match="a backend name is a string"):
        offload_pass.register_backend(7, fraction=0.5)


def test_compile_regions_compiles_blocks_in_place_and_keeps_the_names():
    model = Tiny()
    keys = list(model.state_dict())
    assert offload_pass.compile_regions(model, "inductor") == ["blocks.0", "blocks.1", "head"]
    assert list(model.state_dict()) == keys
    assert all(model.blocks[i]._compiled_call_impl is not None for i in range(2))
    # accelerate's own regional compilation wraps copies, which rename the parameters
    copied = accelerate.utils.compile_regions(Tiny(), backend="inductor")
    assert [k for k in copied.state_dict() if "_orig_mod." in k]
    with pytest.raises(TypeError, match="result of torch.compile"):
        offload_pass.compile_regions(torch.compile(Tiny()))
