"""Tiny, randomly initialised models of the families people train, with their batches.

Every entry builds its model from a fixed seed and gives, for steps 0..2, a batch whose
batch size or sequence length changes; a compiled run compiles those sizes symbolically.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_symbols

Batch = dict[str, torch.Tensor]

VOCAB = 256
SEQ_LENS = (16, 24, 20)
IMAGE_BATCHES = (4, 4, 3)
IMAGE_SIZE = 32
CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Entry:
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    requires: str | None = None
    """A package the model comes from, skipped without it."""

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return self.make_model().train()


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def _tokens(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


def causal_lm_batch(step: int) -> Batch:
    ids = _tokens(2, SEQ_LENS[step], _generator(step))
    return {"input_ids": ids, "labels": ids.clone()}


def masked_lm_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = _tokens(2, SEQ_LENS[step], gen)
    masked = torch.rand(ids.shape, generator=gen) < 0.25
    masked[:, 0] = True
    return {"input_ids": ids, "labels": torch.where(masked, ids, -100)}


def seq2seq_batch(step: int) -> Batch:
    gen = _generator(step)
    ids = _tokens(2, SEQ_LENS[step], gen)
    return {"input_ids": ids, "labels": _tokens(2, SEQ_LENS[step] // 2, gen)}


def padded_causal_lm_batch(step: int) -> Batch:
    """Three rows, the second padded on the right and the third on the left, their
    padding masked and left out of the loss."""
    gen = _generator(step)
    seq = SEQ_LENS[step]
    ids = _tokens(3, seq, gen)
    mask = torch.ones(3, seq, dtype=torch.long)
    mask[1, seq - 5 :] = 0
    mask[2, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


def speech_batch(step: int) -> Batch:
    """Log-mel frames (16 bins, 32 frames) and target tokens, the batch changing size."""
    gen = _generator(step)
    n = IMAGE_BATCHES[step]
    frames = torch.randn(n, 16, 32, generator=gen)
    return {"input_features": frames, "labels": _tokens(n, SEQ_LENS[step] // 2, gen)}


def hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


def _image_batch(step: int, channels_last: bool, size: int = IMAGE_SIZE) -> Batch:
    gen = _generator(step)
    n = IMAGE_BATCHES[step]
    pixels = torch.randn(n, 3, size, size, generator=gen)
    if channels_last:
        pixels = pixels.to(memory_format=torch.channels_last)
    return {"pixels": pixels, "labels": torch.randint(0, CLASSES, (n,), generator=gen)}


def image_batch(step: int) -> Batch:
    return _image_batch(step, channels_last=False)


def channels_last_image_batch(step: int) -> Batch:
    return _image_batch(step, channels_last=True)


def large_image_batch(step: int) -> Batch:
    """Images large enough that the ResNet's last stage is 2x2, not 1x1: on CUDA, stock
    Inductor (torch 2.11) fails the channels-last 1x1 stage's weight-gradient stride check
    under symbolic batch sizes."""
    return _image_batch(step, channels_last=False, size=2 * IMAGE_SIZE)


def large_channels_last_image_batch(step: int) -> Batch:
    return _image_batch(step, channels_last=True, size=2 * IMAGE_SIZE)


def classifier_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["pixels"]), batch["labels"])


def _decoder_sizes() -> dict[str, object]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "attention_dropout": 0.0,
        "attn_implementation": "sdpa",
    }


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_decoder_sizes(), num_key_value_heads=4))


def qwen2_gqa() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_decoder_sizes(), num_key_value_heads=2))


def mixtral() -> nn.Module:
    """Routing decides values only: transformers' default experts (``grouped_mm``) sort the
    tokens by expert, so shapes stay static; its ``"eager"`` experts take ``nonzero`` per
    expert and break the graph at each."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **_decoder_sizes(),
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )
    return MixtralForCausalLM(config)


def mistral() -> nn.Module:
    """Sliding-window attention over a window shorter than the sequences."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**_decoder_sizes(), num_key_value_heads=2, sliding_window=8)
    return MistralForCausalLM(config)


def gemma2() -> nn.Module:
    """Soft-capped attention and output logits, local and global layers in turn; eager
    attention, as SDPA has no soft cap."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    sizes = {**_decoder_sizes(), "attn_implementation": "eager"}
    config = Gemma2Config(
        **sizes,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Gemma2ForCausalLM(config)


def whisper() -> nn.Module:
    """A speech encoder (convolutions over log-mel frames) and a text decoder with
    cross-attention."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        encoder_layers=1,
        decoder_layers=1,
        d_model=64,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=16,
        max_target_positions=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        attn_implementation="sdpa",
    )
    return WhisperForConditionalGeneration(config)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return BertForMaskedLM(config)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
        attn_implementation="eager",
    )
    return T5ForConditionalGeneration(config)


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-18's stem, stages and head at small widths, one basic block a stage."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32, 64), depth: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks = []
        inputs = widths[0]
        for i, width in enumerate(widths):
            for j in range(depth):
                blocks.append(BasicBlock(inputs, width, 2 if i > 0 and j == 0 else 1))
                inputs = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(inputs, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))


def channels_last_resnet() -> nn.Module:
    return ResNet().to(memory_format=torch.channels_last)


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, depth: int = 2, patch: int = 8) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.position = nn.Parameter(torch.randn(1, 1 + (IMAGE_SIZE // patch) ** 2, dim) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patches(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.position
        return self.head(self.ln(self.blocks(x))[:, 0])


def mobilenet_v3() -> nn.Module:
    """Depthwise convolutions, squeeze-and-excitation gates (a pooled mean scaling its
    own input) and hard-swish activations."""
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(num_classes=CLASSES, width_mult=0.5, dropout=0.0)


def densenet() -> nn.Module:
    """Dense blocks: each layer's input is the concatenation of every output before it."""
    from torchvision.models import DenseNet

    return DenseNet(
        growth_rate=8,
        block_config=(2, 2, 2),
        num_init_features=16,
        bn_size=2,
        drop_rate=0.0,
        num_classes=CLASSES,
    )


def swin() -> nn.Module:
    """Shifted-window attention: windows rolled across the image, masked where they wrap,
    with a relative-position bias gathered from a table."""
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4],
        embed_dim=32,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=[4, 4],
        stochastic_depth_prob=0.0,
        num_classes=CLASSES,
    )


ZOO: dict[str, Entry] = {
    "llama": Entry(llama, causal_lm_batch, hf_loss, "transformers"),
    "qwen2_gqa": Entry(qwen2_gqa, causal_lm_batch, hf_loss, "transformers"),
    "gpt2": Entry(gpt2, causal_lm_batch, hf_loss, "transformers"),
    "bert": Entry(bert, masked_lm_batch, hf_loss, "transformers"),
    "t5": Entry(t5, seq2seq_batch, hf_loss, "transformers"),
    "mixtral": Entry(mixtral, causal_lm_batch, hf_loss, "transformers"),
    "mistral": Entry(mistral, padded_causal_lm_batch, hf_loss, "transformers"),
    "gemma2": Entry(gemma2, padded_causal_lm_batch, hf_loss, "transformers"),
    "whisper": Entry(whisper, speech_batch, hf_loss, "transformers"),
    "resnet": Entry(channels_last_resnet, channels_last_image_batch, classifier_loss),
    "vit": Entry(ViT, image_batch, classifier_loss),
    "mobilenet_v3": Entry(mobilenet_v3, image_batch, classifier_loss, "torchvision"),
    "swin": Entry(swin, image_batch, classifier_loss, "torchvision"),
    "densenet": Entry(densenet, image_batch, classifier_loss, "torchvision"),
}


STEPS = 3
FLOOR_ULPS = 4
"""The least tolerance, in float32 roundings at a tensor's largest magnitude."""

Step = dict[str, torch.Tensor]
"""A step's loss (under "loss") and every parameter's gradient (under its name)."""


def _mark_varying_sizes(batches: list[Batch]) -> None:
    """Mark each size that changes from batch to batch dynamic in the first batch, so the
    first compile is already symbolic: one compile, where leaving it to Dynamo compiles
    the first sizes statically and then again symbolically."""
    for name, value in batches[0].items():
        for dim, size in enumerate(value.shape):
            if any(batch[name].shape[dim] != size for batch in batches[1:]):
                torch._dynamo.maybe_mark_dynamic(value, dim)


def train(model: nn.Module, entry: Entry, backend: object, device: str = "cpu") -> list[Step]:
    """``STEPS`` steps of ``model`` compiled with ``backend``, the batch changing size."""
    compiled = torch.compile(model, backend=backend)
    batches = [
        {name: value.to(device) for name, value in entry.make_batch(k).items()}
        for k in range(STEPS)
    ]
    _mark_varying_sizes(batches)
    steps = _steps(model, compiled, entry, batches)
    torch.compiler.reset()
    return steps


def train_in_float64(model: nn.Module, entry: Entry, device: str = "cpu") -> list[Step]:
    """``STEPS`` eager steps of ``model`` and its batches in float64: the values that
    float32 runs round."""
    model = model.to(device, torch.float64)
    batches = [
        {
            name: value.to(device, torch.float64) if value.is_floating_point() else value.to(device)
            for name, value in entry.make_batch(k).items()
        }
        for k in range(STEPS)
    ]
    return _steps(model, model, entry, batches)


def _steps(model: nn.Module, run: nn.Module, entry: Entry, batches: list[Batch]) -> list[Step]:
    """One training step per batch through ``run`` (``model`` or a compile of it): each
    step's loss and every gradient of ``model``'s parameters."""
    steps = []
    for batch in batches:
        loss = entry.loss(run, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        steps.append({"loss": loss.detach(), **grads})
        model.zero_grad(set_to_none=True)
    return steps


def largest_error(a: list[Step], b: list[Step]) -> list[Step]:
    return [{k: (x[k] - y[k]).abs().max() for k in x} for x, y in zip(a, b, strict=True)]


ROUNDING_MARGIN = 2.0
"""How many times the least exact stock run's error a run may have by rounding alone.
Where a gradient is nothing in exact arithmetic (a BatchNorm's bias whose output reaches
the loss only through further batch norms, which take any shift out), every run's value
is rounding noise, and another summation order's noise is as often larger as smaller: on
an H100, MobileNetV3's gradients under fraction 1 landed up to 2.2 times as far from
float64 as stock Inductor's and aot_eager's did (docs/gpu-validation.md)."""


def rounding_bound(stock: list[Step], others: list[list[Step]], exact: list[Step]) -> list[Step]:
    """Per tensor, how far a float32 run may land from ``stock`` by rounding alone:
    ``stock``'s own error against the float64 run ``exact``, plus ``ROUNDING_MARGIN``
    times the largest error of the stock runs (``stock`` and ``others``). A run whose
    error is within that margin lands within the sum (the triangle inequality); a value
    read from the wrong buffer or before its copy ends is off by the value itself."""
    stock_error = largest_error(stock, exact)
    errors = [stock_error, *(largest_error(other, exact) for other in others)]
    return [
        {k: own[k] + ROUNDING_MARGIN * max(error[k] for error in step_errors) for k in own}
        for own, *step_errors in zip(stock_error, *errors, strict=True)
    ]


def assert_within(steps: list[Step], stock: list[Step], spread: list[Step]) -> None:
    """Each tensor no further from ``stock`` than ``spread`` allows, plus the floor."""
    errors = largest_error(steps, stock)
    for k, (error, allowed, expected) in enumerate(zip(errors, spread, stock, strict=True)):
        assert error.keys() == expected.keys()
        for key, value in error.items():
            floor = FLOOR_ULPS * torch.finfo(expected[key].dtype).eps * expected[key].abs().max()
            assert value <= allowed[key] + floor, (k, key, value.item(), allowed[key].item())


def compiled_symbolically(plan: object) -> bool:
    """Whether a plan's chunk was compiled with symbolic sizes."""
    inputs = plan.forward.graph.find_nodes(op="placeholder")
    return any(free_symbols(node.meta.get("val")) for node in inputs)
