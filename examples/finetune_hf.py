"""Fine-tune an HF causal LM with transformers.Trainer, saved activations offloaded to host memory.

    python examples/finetune_hf.py                     # CUDA if present (bf16), else CPU
    python examples/finetune_hf.py --configs none auto --steps 12
    python examples/finetune_hf.py --explain h200      # plan for an H200 on any machine
    python examples/finetune_hf.py --regional          # each decoder layer compiled alone

The model is built from a config (random weights, nothing downloaded) and trained on
synthetic token sequences of varying length, padded per batch. Each configuration trains
a fresh copy of the same model, compiled in place before the Trainer sees it
(``model.compile(backend=...)``, or ``offload_pass.compile_regions``) for symbolic sizes
(``dynamic=True``: one compile serves every length), with
``TrainingArguments.torch_compile`` left off. Every step prints its loss, time, peak
device memory and the bytes it offloaded; a table at the end compares the configurations
(median step time and largest peak after the first two steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from typing import Any

import tabulate
import torch
import transformers
from torch import nn

import offload_pass
from offload_pass.report import summary, why_nothing_moved

CONFIGS: dict[str, dict[str, float] | None] = {
    "none": None,
    "auto": {},
    "budget 0.7": {"memory_budget": 0.7},
    "auto, recompute 0.7": {"recompute_budget": 0.7},
}
"""The options of ``offload_pass.backend`` each configuration compiles with; "none" is
stock ``torch.compile`` (Inductor)."""
WARMUP = 2


@dataclasses.dataclass(frozen=True)
class Sizes:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    seq: int
    batch: int


CPU_SIZES = Sizes(hidden=128, intermediate=344, layers=2, heads=4, vocab=1024, seq=128, batch=4)
CUDA_SIZES = Sizes(
    hidden=2048, intermediate=5632, layers=8, heads=16, vocab=32000, seq=4096, batch=2
)
"""On CUDA, the Llama of the model-zoo benchmark (benchmarks/zoo.py), at up to its length."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        help="what to compare (default: all, but recompute only at a GPU's sizes, to be quick)",
    )
    parser.add_argument("--steps", type=int, help="optimizer steps (default: 8 on CUDA, 4 on CPU)")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation")
    parser.add_argument("--regional", action="store_true", help="compile each layer alone")
    parser.add_argument(
        "--explain",
        metavar="PROFILE",
        help="plan each configuration for this device profile (h200, h100, a100, cpu) and "
        "print the predictions, training nothing; sizes and dtype are a GPU's by default",
    )
    for field in dataclasses.fields(Sizes):
        parser.add_argument(f"--{field.name}", type=int, help="model or batch size")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    args.gpu_sized = device.type == "cuda" or args.explain not in (None, "cpu")
    defaults = CUDA_SIZES if args.gpu_sized else CPU_SIZES
    args.sizes = Sizes(
        **{
            f.name: getattr(args, f.name) or getattr(defaults, f.name)
            for f in dataclasses.fields(Sizes)
        }
    )
    args.steps = args.steps or (8 if device.type == "cuda" else 4)
    args.configs = args.configs or [
        name for name in CONFIGS if args.gpu_sized or "recompute" not in name
    ]
    return args


def make_model(sizes: Sizes, device: torch.device, bf16: bool) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.heads,
        max_position_embeddings=sizes.seq,
        attn_implementation="sdpa",
        use_cache=False,  # training keeps no KV cache (with one, each layer compiles again)
    )
    dtype = torch.bfloat16 if bf16 else torch.float32
    return transformers.LlamaForCausalLM(config).to(device, dtype)


class Sequences(torch.utils.data.Dataset):
    """Random token sequences of half to full length ``seq``."""

    def __init__(self, sizes: Sizes, count: int) -> None:
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(sizes.seq // 2, sizes.seq + 1, (count,), generator=gen)
        self.items = [torch.randint(1, sizes.vocab, (int(n),), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


PAD_TO_MULTIPLE_OF = 64
"""Padded lengths are multiples of this, as HF's collators offer (``pad_to_multiple_of``):
fewer distinct shapes, and sizes the attention kernels' alignment rules accept."""


def padded_length(length: int) -> int:
    """``length`` rounded up to a multiple of ``PAD_TO_MULTIPLE_OF``."""
    return -(-length // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF


def pad(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding past the batch's longest sequence to a multiple of
    ``PAD_TO_MULTIPLE_OF``, masked out of attention and loss."""
    longest = max(len(f["input_ids"]) for f in features)
    width = padded_length(longest)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def warm_kernel_caches(sizes: Sizes, device: torch.device, bf16: bool) -> None:
    """Run the eager model's forward and backward once at every padded length a batch can
    take, so the kernels' per-shape caches (cuDNN's attention plans, cuBLAS's heuristics)
    are built before any configuration is timed. Otherwise the first configuration pays for them at
    each length it meets first, and the configurations after it, meeting the same lengths
    (the same seed), do not."""
    model = make_model(sizes, device, bf16)
    shortest, longest = padded_length(sizes.seq // 2), padded_length(sizes.seq)
    for width in range(shortest, longest + 1, PAD_TO_MULTIPLE_OF):
        rows = [
            {"input_ids": torch.ones(width - 1 - row % 2, dtype=torch.long)}
            for row in range(sizes.batch)
        ]
        batch = {k: v.to(device) for k, v in pad(rows).items()}
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
    del model


@dataclasses.dataclass
class Step:
    loss: float = float("nan")
    seconds: float = 0.0
    peak_bytes: int | None = None
    offloaded_bytes: int = 0


class StepMeter(transformers.TrainerCallback):
    """Times each optimizer step and reads its peak memory and offloaded bytes."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.device = name, device
        self.steps: list[Step] = []
        self._start = 0.0
        self._offloaded = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._offloaded = offload_pass.counts().bytes_offloaded
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._sync()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        offloaded = offload_pass.counts().bytes_offloaded - self._offloaded
        self.steps.append(Step(float("nan"), time.perf_counter() - self._start, peak, offloaded))

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if not logs or "loss" not in logs or not self.steps:
            return
        step = self.steps[-1]
        step.loss = float(logs["loss"])
        peak = "n/a" if step.peak_bytes is None else f"{step.peak_bytes / 2**30:.2f} GiB"
        print(
            f"{self.name:>20}  step {len(self.steps):3d}  loss {step.loss:.4f}  "
            f"{step.seconds * 1e3:9.1f} ms  peak {peak:>10}  "
            f"offloaded {step.offloaded_bytes / 2**20:9.1f} MiB"
        )


class LossOf(nn.Module):
    """The model's loss as a module of positional inputs, for ``offload_pass.explain``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def explain(args: argparse.Namespace, device: torch.device) -> None:
    """Plan each configuration for the ``--explain`` profile on one batch, running nothing."""
    batch = pad([Sequences(args.sizes, args.sizes.batch)[i] for i in range(args.sizes.batch)])
    inputs = [batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")]
    model = LossOf(make_model(args.sizes, device, args.gpu_sized))
    rows = []
    for name in args.configs:
        if CONFIGS[name] is None:
            continue
        report = offload_pass.explain(model, *inputs, profile=args.explain, **CONFIGS[name])
        torch.compiler.reset()
        for plan in report.plans:
            print(f"--- {name}\n{summary(plan)}")
            p = plan.prediction
            rows.append(
                [
                    name,
                    f"{p.baseline_peak_bytes / 2**30:.2f}",
                    f"{p.peak_bytes / 2**30:.2f}",
                    f"{plan.bytes_moved / 2**30:.2f}",
                    f"{p.baseline_seconds * 1e3:.1f}",
                    f"{p.step_seconds * 1e3:.1f}",
                ]
            )
    headers = ["config", "peak GiB without", "with", "moved GiB", "step ms without", "with"]
    print(f"\npredicted for {args.explain!r}, one batch of {inputs[0].shape[1]} tokens a row:")
    print(tabulate.tabulate(rows, headers=headers, disable_numparse=True))


def train(
    name: str, args: argparse.Namespace, device: torch.device, output_dir: str
) -> tuple[StepMeter, Any]:
    options = CONFIGS[name]
    backend = "inductor" if options is None else offload_pass.backend(**options)
    model = make_model(args.sizes, device, args.gpu_sized)
    # dynamic=True: the lengths vary, so compile for symbolic sizes at once instead of
    # compiling the first length static and the second again
    if args.regional:
        offload_pass.compile_regions(model, backend, dynamic=True)
    else:
        model.compile(backend=backend, dynamic=True)
    meter = StepMeter(name, device)
    arguments = transformers.TrainingArguments(
        output_dir=output_dir,  # nothing is saved (save_strategy="no")
        per_device_train_batch_size=args.sizes.batch,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=device.type == "cpu",
        seed=0,
        disable_tqdm=True,
    )
    count = args.steps * args.accumulation * args.sizes.batch
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=Sequences(args.sizes, count),
        data_collator=pad,
        callbacks=[meter],
    )
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    del trainer, model
    torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return meter, backend


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    transformers.logging.set_verbosity_error()
    s = args.sizes
    print(
        f"device={device} Llama hidden={s.hidden} layers={s.layers} vocab={s.vocab} "
        f"batch={s.batch}x{args.accumulation} sequences {s.seq // 2}..{s.seq} tokens, "
        f"{'regional' if args.regional else 'whole-model'} compile"
    )
    if args.explain:
        explain(args, device)
        return
    if device.type == "cuda":
        warm_kernel_caches(args.sizes, device, args.gpu_sized)
    rows, medians = [], {}
    for name in args.configs:
        with tempfile.TemporaryDirectory() as output_dir:
            meter, backend = train(name, args, device, output_dir)
        timed = meter.steps[WARMUP:] or meter.steps
        medians[name] = statistics.median(step.seconds for step in timed)
        peaks = [step.peak_bytes for step in timed if step.peak_bytes is not None]
        plans = getattr(backend, "plans", [])
        # plans for symbolic sizes predict at the sizes first traced: the first batch's
        predicted = max((p.prediction.peak_bytes for p in plans), default=None)
        rows.append(
            [
                name,
                f"{medians[name] * 1e3:.1f}",
                f"{max(peaks) / 2**30:.2f}" if peaks else "n/a",
                f"{statistics.median(st.offloaded_bytes for st in timed) / 2**20:.1f}",
                f"{predicted / 2**30:.3f}" if predicted is not None else "",
                f"{meter.steps[-1].loss:.4f}",
            ]
        )
        for reason in sorted({why_nothing_moved(plan) for plan in plans} - {None}):
            print(f"{name:>20}  {reason}")
    if "none" in medians:  # step time over stock torch.compile's
        for row in rows:
            row.insert(2, f"{medians[row[0]] / medians['none']:.3f}")
    print()
    headers = ["config", "step ms", "peak GiB", "moved MiB", "pred. peak GiB (1st batch)", "loss"]
    if "none" in medians:
        headers.insert(2, "ratio")
    print(tabulate.tabulate(rows, headers=headers, disable_numparse=True))
    if device.type == "cpu":
        print(
            "\nOn the CPU, copies run on the compute thread and device memory is host "
            "memory: auto moves nothing (no copy can hide), and what the budget moves is "
            "copied within host memory, which lowers no real peak (the predicted one counts "
            "the CPU as a device). The table shows the mechanics, and CPU step times swing "
            "with whatever else runs; run on a GPU for the trade-off, or "
            "pass --explain h200 to see an H200's plans."
        )


if __name__ == "__main__":
    main()
