"""The reference workloads of benchmarks/README.md: a GPT-style decoder stack."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    dim: int
    heads: int
    layers: int
    batch: int
    seq: int
    dtype: torch.dtype = torch.bfloat16


W1 = Workload("W1", dim=4096, heads=32, layers=8, batch=2, seq=4096)
W2 = dataclasses.replace(W1, name="W2", batch=8)
TINY = Workload("tiny", dim=64, heads=4, layers=2, batch=2, seq=32, dtype=torch.float32)
BY_NAME = {w.name: w for w in (W1, W2, TINY)}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, w: Workload) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(w.dim, w.heads) for _ in range(w.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(w: Workload, device: str | torch.device) -> tuple[nn.Module, torch.Tensor]:
    """The model and one input batch, in the workload's dtype on ``device``."""
    model = Decoder(w).to(device=device, dtype=w.dtype)
    x = torch.randn(w.batch, w.seq, w.dim, device=device, dtype=w.dtype)
    return model, x


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


class WithLoss(nn.Module):
    """The model and its loss, so one compiled region covers the whole step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return loss_of(self.model(x))
