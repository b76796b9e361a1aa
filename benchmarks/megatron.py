"""Megatron-Core's fine-grained activation offloading on W1's decoder, as a peer.

Megatron-Core's ``TransformerBlock`` is built from its local (torch-only) layer spec at the
workload's dimensions: LayerNorm, fused QKV linear, causal attention through
``scaled_dot_product_attention`` (the local spec's own attention materialises the score
matrix), output projection, LayerNorm, Linear(d, 4d), GELU, Linear(4d, d). Megatron-Core
puts a bias on every linear or on none, so its QKV linear has the 3d bias W1's lacks.
Its offloading is switched on with ``fine_grained_activation_offloading`` and
``offload_modules``; it runs eagerly, as Megatron-Core does. Each step lays the batch out
as Megatron-Core's [sequence, batch, hidden] with one copy (64 MiB for W1).

Megatron-Core 0.16.1 sets a flag in Transformer Engine's CPU-offload module while it
offloads and refuses to run when Transformer Engine is missing. Only Transformer Engine's
own layers read that flag, and none is used here, so where Transformer Engine is absent
the flag is given a stand-in. The offloading itself (hooks, streams, pinned pool) is
Megatron-Core's.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.configs import Unavailable
from benchmarks.workloads import Decoder, loss_of

try:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.extensions import transformer_engine
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as offloading,
    )
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as error:
    raise Unavailable(f"megatron-core does not import here: {error}") from error


class ScaledDotProductAttention(nn.Module):
    """Causal attention for Megatron's [sequence, batch, heads, head dim] layout."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, **_: Any) -> None:
        super().__init__()

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any
    ) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)


def _join_single_process_group(device: torch.device) -> None:
    if not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    if transformer_engine.cpu_offload is None:
        transformer_engine.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)


def _decoder(like: Decoder, device: torch.device, offload: Sequence[str]) -> nn.Module:
    first = like.blocks[0]
    dtype = first.qkv.weight.dtype
    config = TransformerConfig(
        num_layers=len(like.blocks),
        hidden_size=first.qkv.in_features,
        num_attention_heads=first.heads,
        ffn_hidden_size=first.fc1.out_features,
        add_bias_linear=True,
        activation_func=F.gelu,
        normalization="LayerNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type != "cuda",
        fine_grained_activation_offloading=bool(offload),
        offload_modules=list(offload),
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ScaledDotProductAttention
    # The whole block in the workload's dtype, as Megatron's Float16Module casts it: its
    # torch LayerNorm fallback makes float32 weights, which CUDA's layer_norm refuses
    # beside bf16 activations.
    block = TransformerBlock(config, spec, post_layer_norm=False).to(device, dtype)
    for parameter in block.parameters():
        parameter.offloading_activation = False  # parameters are not activations
    return block


class MegatronDecoderLoss(nn.Module):
    """The loss of one batch through ``block``; backward is the caller's."""

    def __init__(self, block: nn.Module, offload: bool) -> None:
        super().__init__()
        self.block = block
        self.offload = offload

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.block.zero_grad(set_to_none=True)
        if self.offload:
            offloading.reset()  # between steps, as Megatron's schedules do after backward
            offloading.init_chunk_handler(None, None, self.block.config.min_offloaded_tensor_size)
        hidden = self.block(hidden_states=x.transpose(0, 1).contiguous(), attention_mask=None)
        return loss_of(hidden)


def megatron_forward(like: Decoder, offload: Sequence[str]) -> MegatronDecoderLoss:
    """A Megatron-Core decoder shaped like ``like``, which is moved off the device."""
    device = like.blocks[0].qkv.weight.device
    _join_single_process_group(device)
    block = _decoder(like, device, offload)
    like.to("meta")
    if offload:
        offloading.reset_instance()  # the manager is a singleton; start it afresh per model
    return MegatronDecoderLoss(block, bool(offload))
