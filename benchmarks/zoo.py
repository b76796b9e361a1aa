"""The model zoo on a GPU: real architectures, each beside its stock compile in one process;
a markdown table and a JSON file under --out, in the format of ``benchmarks.compare``.

    python -m benchmarks.zoo                                    # every model and config
    python -m benchmarks.zoo --models llama gpt2 --configs compiled "offload_pass auto"

Each model is built from a config with random weights (bf16, SDPA, the loss computed
inside the model) and runs compiled whole: stock, offload_pass ``auto``, fraction 0.5,
memory budget 0.7, and torch's ``activation_memory_budget`` 0.7. The language models also
run compiled per block (each decoder layer compiled in place on its own, as torchtitan
and accelerate's regional compilation do); their rows form a workload of their own, whose
baseline is the stock per-block compile. On a CPU every model is tiny: that checks the
harness, not the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import offload_pass
from benchmarks import compare
from benchmarks.configs import Config, Forward, Unavailable, fitted_step
from benchmarks.measure import Measurement, measure, steps_in_turns

GiB = 2**30
BASELINE = "compiled"
AUTO = "offload_pass auto"
RATIO_LIMIT = 1.03
SAVING_SHARE = 0.8
PREDICTION_LIMIT = 0.10
PREDICTION_ERRORS = (
    "step_prediction_error",
    "step_prediction_error_in_turns",
    "peak_prediction_error",
)
"""The step predicted against the step measured alone, and against the one measured in
turns with the stock compile: a host-bound model's step drifts between stretches of one
process, and the same code measured alone in two of them may differ by a fifth
(docs/gpu-validation.md, run 192)."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A language model's dimensions and batch; a vision model reads ``batch`` alone."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int


class LanguageModelLoss(nn.Module):
    """An HF causal LM whose forward takes the batch and returns the model's own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch, use_cache=False).loss  # no KV cache when training


class ClassifierLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.model(batch["pixels"]).float(), batch["labels"])


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise Unavailable(f"transformers does not import here: {error}") from error
    return transformers


def _decoder(config_name: str, model_name: str, **extra: Any) -> Callable[[Sizes], nn.Module]:
    """A factory of the HF causal LM ``model_name`` at given sizes (Llama's argument names,
    which Qwen2 and Mixtral share)."""

    def make(s: Sizes) -> nn.Module:
        t = _transformers()
        config = getattr(t, config_name)(
            vocab_size=s.vocab,
            hidden_size=s.hidden,
            intermediate_size=s.intermediate,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads,
            max_position_embeddings=s.seq,
            **extra,
        )
        return getattr(t, model_name)(config)

    return make


_llama = _decoder("LlamaConfig", "LlamaForCausalLM")
_qwen2 = _decoder("Qwen2Config", "Qwen2ForCausalLM")
_mixtral = _decoder(
    "MixtralConfig", "MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2
)


def _gpt2(s: Sizes) -> nn.Module:
    t = _transformers()
    config = t.GPT2Config(
        vocab_size=s.vocab, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads, n_positions=s.seq
    )
    return t.GPT2LMHeadModel(config)


def _image_size(s: Sizes) -> int:
    """ViT-B/16's 224 pixels at full width; 32 for the CPU's tiny model."""
    return 224 if s.hidden >= 256 else 32


def _vit(s: Sizes) -> nn.Module:
    try:
        from torchvision.models import VisionTransformer
    except ImportError as error:
        raise Unavailable(f"torchvision does not import here: {error}") from error
    image = _image_size(s)
    patch = 16 if image == 224 else 8
    return VisionTransformer(
        image, patch, s.layers, s.heads, s.hidden, s.intermediate, num_classes=1000
    )


def _tokens(s: Sizes, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.vocab, (s.batch, s.seq), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def _images(s: Sizes, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    image = _image_size(s)
    pixels = torch.randn(s.batch, 3, image, image, generator=gen).to(device, dtype)
    return {
        "pixels": pixels,
        "labels": torch.randint(0, 1000, (s.batch,), generator=gen).to(device),
    }


Task = tuple[nn.Module, dict[str, torch.Tensor]]
"""A model wrapped to return its loss, and the batch each step feeds it."""


def _language_model_task(
    model: nn.Module, sizes: Sizes, device: torch.device, dtype: torch.dtype
) -> Task:
    model.config._attn_implementation = "sdpa"
    return LanguageModelLoss(model), _tokens(sizes, device)


def _classifier_task(
    model: nn.Module, sizes: Sizes, device: torch.device, dtype: torch.dtype
) -> Task:
    return ClassifierLoss(model), _images(sizes, device, dtype)


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One architecture at GPU and CPU sizes; ``blocks``: where its decoder layers are
    (for per-block compilation), None for a model that is only compiled whole; ``task``:
    the model with its loss, and a batch."""

    name: str
    make: Callable[[Sizes], nn.Module]
    gpu: Sizes
    cpu: Sizes
    blocks: Callable[[nn.Module], nn.ModuleList] | None
    task: Callable[[nn.Module, Sizes, torch.device, torch.dtype], Task] = _language_model_task

    def build(self, device: torch.device) -> Task:
        """The model (random weights, bf16 on CUDA) with its loss, and one batch."""
        sizes = self.gpu if device.type == "cuda" else self.cpu
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = self.make(sizes).to(device=device, dtype=dtype)
        return self.task(model, sizes, device, dtype)


def _decoder_layers(task: nn.Module) -> nn.ModuleList:
    return task.model.model.layers


def _gpt2_blocks(task: nn.Module) -> nn.ModuleList:
    return task.model.transformer.h


TINY = Sizes(64, 2, 4, 2, 128, 256, 2, 32)
MODELS = {
    m.name: m
    for m in (
        ZooModel(
            "llama", _llama, Sizes(2048, 8, 16, 16, 5632, 32000, 2, 4096), TINY, _decoder_layers
        ),
        ZooModel(
            "qwen2_gqa", _qwen2, Sizes(2048, 8, 16, 2, 5632, 32000, 2, 4096), TINY, _decoder_layers
        ),
        ZooModel("gpt2", _gpt2, Sizes(1024, 12, 16, 16, 4096, 50257, 8, 1024), TINY, _gpt2_blocks),
        ZooModel(
            "llama_16k",
            _llama,
            Sizes(2048, 4, 16, 16, 5632, 32000, 1, 16384),
            TINY,
            _decoder_layers,
        ),
        ZooModel(
            "mixtral", _mixtral, Sizes(1024, 4, 16, 8, 1792, 32000, 2, 2048), TINY, _decoder_layers
        ),
        ZooModel(
            "vit_b16", _vit, Sizes(768, 12, 12, 12, 3072, 1000, 64, 0), TINY, None, _classifier_task
        ),
    )
}


def _stock(task: nn.Module, shared: dict[str, Any]) -> Forward:
    return torch.compile(task)


def _ours(**options: Any) -> Callable[[nn.Module, dict[str, Any]], Forward]:
    def prepare(task: nn.Module, shared: dict[str, Any]) -> Forward:
        shared["backend"] = offload_pass.backend(**options)
        return torch.compile(task, backend=shared["backend"])

    return prepare


def _partitioner_budget(task: nn.Module, shared: dict[str, Any]) -> Forward:
    compiled = torch.compile(task)

    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch._functorch.config.patch(activation_memory_budget=0.7):
            return compiled(batch)

    return run


BlockBackend = Callable[[dict[str, Any], int], Any]
"""The backend every block of one run compiles with (one object, so its plans add up),
given the number of blocks."""


def _stock_blocks(shared: dict[str, Any], blocks: int) -> Any:
    return "inductor"


def _our_blocks(**options: Any) -> BlockBackend:
    """offload_pass for blocks compiled each on their own: one chunk, whose forward runs
    once per block before any backward (``with_forwards_in_flight``)."""

    def make(shared: dict[str, Any], blocks: int) -> Any:
        shared["backend"] = offload_pass.backend(**options).with_forwards_in_flight(blocks)
        shared["whole_step"] = False
        return shared["backend"]

    return make


def _per_block(
    blocks: Callable[[nn.Module], nn.ModuleList], backend: BlockBackend
) -> Callable[[nn.Module, dict[str, Any]], Forward]:
    """Each block compiled in place; the rest of the model runs eagerly."""

    def prepare(task: nn.Module, shared: dict[str, Any]) -> Forward:
        compiled = blocks(task)
        chosen = backend(shared, len(compiled))
        for block in compiled:
            block.compile(backend=chosen)
        return task

    return prepare


CHECKPOINT_PEAK = "checkpoint_peak_bytes"
"""Where a model's run keeps checkpointing's measured peak, for the configurations after
it that aim at that peak."""


def _checkpointed(task: nn.Module, shared: dict[str, Any]) -> Forward:
    """Every layer checkpointed, as transformers does it (non-reentrant), compiled whole."""
    enable = getattr(task.model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise Unavailable(f"{type(task.model).__name__} has no gradient_checkpointing_enable")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return torch.compile(task)


def _fitted_to_checkpointing(task: nn.Module, shared: dict[str, Any]) -> Forward:
    if CHECKPOINT_PEAK not in shared:
        raise Unavailable("not run: needs checkpoint blocks' measured peak, from the same run")
    return fitted_step(task, shared[CHECKPOINT_PEAK], shared)


def whole_configs() -> list[Config]:
    return [
        Config("compiled", "no offload", _stock),
        Config("offload_pass auto", "offload_pass", _ours()),
        Config(
            "offload_pass auto, recompute search",
            "offload_pass",
            _ours(recompute_budget="search"),
        ),
        Config("offload_pass fraction 0.5", "offload_pass", _ours(fraction=0.5)),
        Config("offload_pass budget 0.7", "offload_pass", _ours(memory_budget=0.7)),
        Config("memory_budget 0.7", "memory_budget", _partitioner_budget),
        Config("checkpoint blocks", "checkpointing", _checkpointed),
        Config(
            "offload_pass budget at checkpointing's peak, fitted",
            "offload_pass",
            _fitted_to_checkpointing,
            cuda_only=True,
        ),
    ]


def per_block_configs(blocks: Callable[[nn.Module], nn.ModuleList]) -> list[Config]:
    return [
        Config("compiled", "no offload", _per_block(blocks, _stock_blocks)),
        Config("offload_pass auto", "offload_pass", _per_block(blocks, _our_blocks())),
        Config(
            "offload_pass fraction 0.5",
            "offload_pass",
            _per_block(blocks, _our_blocks(fraction=0.5)),
        ),
    ]


def check_targets(rows: list[dict[str, Any]]) -> list[str]:
    """Issue targets for one model: auto's ratio, saving, peak and predictions."""
    base = next((r for r in rows if r["config"] == BASELINE and r["status"] == "ok"), None)
    auto = next((r for r in rows if r["config"] == AUTO), None)
    if base is None or auto is None or auto["status"] != "ok" or auto.get("peak_bytes") is None:
        return ["auto or the stock compile did not run with memory figures: not checked"]
    paired = auto.get("paired_step_ratio")
    ratio, how = (auto["step_ratio"], "") if paired is None else (paired, " in turns")
    control = base.get("paired_step_ratio")
    spread = (
        ""
        if control is None
        else f" (the stock compile against a second one, in turns: {control:.3f})"
    )
    lines = [
        _verdict(
            f"auto step ratio{how} {ratio:.3f}{spread}", ratio <= RATIO_LIMIT, f"<= {RATIO_LIMIT}"
        ),
        _verdict(
            f"auto peak {auto['peak_bytes'] / GiB:.2f} GiB against stock "
            f"{base['peak_bytes'] / GiB:.2f}",
            auto["peak_bytes"] <= base["peak_bytes"],
            "never above stock",
        ),
    ]
    predicted = auto.get("predicted_peak_saved_bytes")
    if predicted:
        share = auto["peak_saved_bytes"] / predicted
        lines.append(
            _verdict(
                f"auto saves {auto['peak_saved_bytes'] / GiB:.2f} GiB of the "
                f"{predicted / GiB:.2f} predicted ({share:.0%})",
                share >= SAVING_SHARE,
                f">= {SAVING_SHARE:.0%}",
            )
        )
    elif predicted is not None and auto["bytes_moved"]:
        lines.append(
            f"auto moves {auto['bytes_moved'] / GiB:.2f} GiB for no predicted saving: MISSED"
        )
    for row in rows:
        for key in PREDICTION_ERRORS:
            if key in row:
                lines.append(
                    _verdict(
                        f"{row['config']}: {key.replace('_', ' ')} {row[key]:.1%}",
                        row[key] <= PREDICTION_LIMIT,
                        f"<= {PREDICTION_LIMIT:.0%}",
                    )
                )
    return lines


def _verdict(what: str, met: bool, target: str) -> str:
    return f"{what} (target {target}): {'met' if met else 'MISSED'}"


def run_model(
    name: str,
    configs: Sequence[Config],
    wanted: Sequence[str],
    steps: int,
    device: torch.device,
    paired_rounds: int,
) -> list[Measurement]:
    """Each configuration measured alone; then, with ``paired_rounds``, auto's step
    against the stock compile's in turns (:func:`benchmarks.measure.steps_in_turns`),
    and the stock compile's against a second stock compile's: how far from 1 a ratio in
    turns strays on this model where both sides run the same code."""
    model = MODELS[name]
    results = []
    shared: dict[str, Any] = {}  # one run's: checkpointing's peak for the configs after it
    for config in configs:
        if wanted and config.name not in wanted:
            continue
        result = measure(config, lambda: model.build(device), device, steps, shared)
        print(f"{name} {config.name}: {result.status}, step {result.step_ms} ms", flush=True)
        if config.family == "checkpointing" and result.peak_bytes is not None:
            shared[CHECKPOINT_PEAK] = result.peak_bytes
        results.append(result)
    by_name = {c.name: c for c in configs}
    ran = {r.config: i for i, r in enumerate(results) if r.ok}
    if paired_rounds and {BASELINE, AUTO} <= ran.keys():
        for other in (AUTO, BASELINE):
            turns = steps_in_turns(
                by_name[BASELINE],
                by_name[other],
                lambda: model.build(device),
                device,
                paired_rounds,
            )
            print(f"{name} {other}: {turns.ratio:.3f} of the stock step, in turns", flush=True)
            i = ran[other]
            results[i] = dataclasses.replace(
                results[i], paired_step_ratio=turns.ratio, paired_step_ms=turns.other_ms
            )
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="*", default=[], help="names to run (default: all)")
    parser.add_argument(
        "--compilations",
        nargs="+",
        default=["whole", "per-block"],
        choices=["whole", "per-block"],
        help="compile each model whole, each block on its own (language models), or both",
    )
    parser.add_argument(
        "--profile-auto",
        action="store_true",
        help="also hold auto's prediction against a profiled step (CUDA; per copy)",
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=0,
        help="also step auto and the stock compile in turns, this many rounds, and check "
        "auto's ratio on those (a host-bound step drifts between configurations run apart)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.paired_rounds < 0:
        parser.error(f"--paired-rounds must be 0 or more, got {args.paired_rounds}")
    known = {c.name for c in [*whole_configs(), *per_block_configs(lambda model: model)]}
    unknown = [name for name in args.configs if name not in known]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {sorted(known)}")

    device = torch.device(args.device)
    hardware = compare.Hardware.measured(device)
    results = compare.new_results(hardware)
    # named by its models: a second run into the same folder keeps the first one's files
    stem = compare.results_stem(args.out, results, "-".join(["zoo", *args.models]))
    for name in args.models:
        runs = [(name, whole_configs())] if "whole" in args.compilations else []
        blocks = MODELS[name].blocks
        if blocks is not None and "per-block" in args.compilations:
            runs.append((f"{name} per block", per_block_configs(blocks)))
        for workload, configs in runs:
            rows = compare.derive(
                run_model(name, configs, args.configs, args.steps, device, args.paired_rounds),
                hardware,
            )
            profiled = args.profile_auto and workload == name
            results["workloads"][workload] = {
                "rows": rows,
                "targets": check_targets(rows) + compare.against_checkpointing(rows, hardware),
                "auto_profiled": (
                    compare.profile_auto(functools.partial(MODELS[name].build, device), device)
                    if profiled
                    else ""
                ),
            }
            print(compare.workload_report(workload, results), flush=True)
            compare.write(results, stem)
    return results


if __name__ == "__main__":
    main()
