"""Plan a GPT meant for an H200 on any machine, and look at what offload_pass would do.

    python examples/inspect_plan.py                 # report, graph excerpt, trace file
    python -m offload_pass explain examples/inspect_plan.py:gpt --profile h200

Nothing of the model runs: ``offload_pass.explain`` compiles and plans only. Open
``plan-trace/*.trace.json`` in https://ui.perfetto.dev or chrome://tracing to see the
predicted compute, device-to-host and host-to-device tracks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import offload_pass
from offload_pass.report import format_graphs


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).float().pow(2).mean()


def gpt(dim: int = 1024, heads: int = 8, layers: int = 4, seq: int = 2048) -> tuple:
    """A bf16 GPT and a batch on the CPU: small enough to plan anywhere."""
    model = GPT(dim, heads, layers).to(torch.bfloat16)
    return model, torch.randn(2, seq, dim, dtype=torch.bfloat16)


def main() -> None:
    model, x = gpt()
    report = offload_pass.explain(model, x, profile="h200", dump_dir="plan-trace")
    print(report)
    graphs = format_graphs(report.plans[0]).splitlines()
    print("\n".join(line for line in graphs if "<<<" in line)[:3000])
    print("\nfull graphs, table and trace in plan-trace/")


if __name__ == "__main__":
    main()
