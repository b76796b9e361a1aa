"""Train a small GPT on synthetic tokens with saved activations offloaded to host memory.

    python examples/train_gpt.py                       # CUDA if present, else CPU
    python examples/train_gpt.py --fraction 0.5 --steps 20 --show-plan

The decoder blocks are those of the W1 workload in benchmarks/README.md, scaled down.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import offload_pass
from offload_pass.report import why_nothing_moved


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--fraction", type=float, help="share of activations to move (default: auto)")
    mode.add_argument(
        "--memory-budget",
        type=float,
        help="predicted peak to reach, as a share of the peak without",
    )
    parser.add_argument("--profile", help="device profile to plan with (default: by device name)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compiler", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--dim", type=int, help="model width (default: 1024 on CUDA, 128 on CPU)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, help="sequence length (default: 1024 / 128)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--show-plan", action="store_true", help="print each chunk's plan")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    on_cuda = device.type == "cuda"
    args.dim = args.dim or (1024 if on_cuda else 128)
    args.seq = args.seq or (1024 if on_cuda else 128)
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.heads, args.layers, args.seq).to(device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    backend = offload_pass.backend(
        fraction=args.fraction,
        memory_budget=args.memory_budget,
        profile=args.profile,
        compiler=args.compiler,
    )
    compiled = torch.compile(model, backend=backend)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), device=device)

    print(f"device={device} dtype={dtype} {backend.options.mode} compiler={args.compiler}")
    for step in range(1, args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        offloaded_before = offload_pass.counts().bytes_offloaded
        start = time.perf_counter()
        logits = compiled(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        peak = (
            f"{torch.cuda.max_memory_allocated() / 2**20:8.1f} MiB"
            if device.type == "cuda"
            else "     n/a"
        )
        offloaded = offload_pass.counts().bytes_offloaded - offloaded_before
        print(
            f"step {step:3d}  loss {loss.item():.4f}  {elapsed_ms:8.1f} ms  "
            f"peak {peak}  offloaded {offloaded / 2**20:8.1f} MiB"
        )
        if step == 1:
            for plan in backend.plans:
                if (reason := why_nothing_moved(plan)) is not None:
                    print(reason)
    if args.show_plan:
        for plan in backend.plans:
            print(plan)


if __name__ == "__main__":
    main()
