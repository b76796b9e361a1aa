"""Small models covering the shapes of saved state a training job produces."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from offload_pass.profiles import BUILT_IN, DeviceProfile


def copies_at(profile: DeviceProfile, bandwidth: float, name: str) -> DeviceProfile:
    """``profile``'s rates with copies at ``bandwidth`` bytes/s each way."""
    return dataclasses.replace(
        profile,
        name=name,
        device_to_host=bandwidth,
        host_to_device=bandwidth,
        both_directions=2 * bandwidth,
    )


H200_INSTANT_HOST = dataclasses.replace(
    BUILT_IN["h200"],
    name="h200, instant host",
    kernel_launch_seconds=0.0,
    offload_host_seconds=0.0,
    reload_host_seconds=0.0,
    bucketed_offload_host_seconds=0.0,
    bucketed_reload_host_seconds=0.0,
)
"""The H200 with a host that issues work instantly: a small test model plans as a large
one does on the device. (With the host's real costs, its short kernels leave the step
to the host, and ``auto`` moves nothing.)"""
H200_QUICK_COPIES = dataclasses.replace(
    H200_INSTANT_HOST,
    name="h200, instant host, copies out 8x as fast",
    device_to_host=8 * H200_INSTANT_HOST.device_to_host,
)
"""Rates at which moving every activation of one small block (``BlockStack(dim=256,
heads=4, depth=1)`` on a (2, 512, 256) batch) takes its device-to-host queue 36 us of a
48 us forward, the last copy ending after forward: held by one forward, that copy is
waited for at its end; followed by another forward, it is released."""


class MLP(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


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
    """One W1 decoder block: pre-norm attention and a 4x GELU MLP, both residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class BlockStack(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class CheckpointedBlocks(nn.Module):
    """Each block under activation checkpointing: backward computes the block again from
    its saved input, so the inputs are what the step saves."""

    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


class ConvNet(nn.Module):
    """Channels-last convolutions: saved activations are dense but not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class DropoutMLP(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class SavedIsOutput(nn.Module):
    """Returns an activation that backward also reads."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.fc1(x))
        return self.fc2(torch.sin(hidden)), hidden


class SavedViews(nn.Module):
    """Backward reads two non-contiguous views of one intermediate storage."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        left, right = y[:, ::2], y[:, 1::2]
        return torch.sin(left) * torch.cos(right)


class IndexAndMask(nn.Module):
    """Backward reads an int64 index tensor and a bool mask made in forward."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc1(x), self.fc2(x)
        index = torch.argsort(a.detach(), dim=-1)
        mask = a.detach() > b.detach()
        return torch.gather(b, -1, index) * torch.where(mask, a, b)


class TwoChunks(nn.Module):
    """A graph break splits this into two compiled chunks."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.first = MLP(width)
        self.second = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def biased_product_graph(
    dtype: torch.dtype, device: str, user: object
) -> tuple[torch.fx.GraphModule, object]:
    """``user(addmm(bias, x, w))`` on fake tensors of ``device``, and their fake mode:
    Inductor's post-grad patterns run on such graphs without the device itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        values = {
            "bias": torch.empty(16, dtype=dtype, device=device),
            "x": torch.empty(4, 8, dtype=dtype, device=device),
            "w": torch.empty(8, 16, dtype=dtype, device=device),
        }
    graph = torch.fx.Graph()
    inputs = []
    for name, value in values.items():
        inputs.append(graph.placeholder(name))
        inputs[-1].meta["val"] = value
    with mode:
        product = graph.call_function(torch.ops.aten.addmm.default, tuple(inputs))
        product.meta["val"] = torch.ops.aten.addmm.default(*values.values())
        if user is None:
            graph.output((product,))
        else:
            used = graph.call_function(user, (product, inputs[0]))
            used.meta["val"] = user(product.meta["val"], values["bias"])
            graph.output((used,))
    return torch.fx.GraphModule(torch.nn.Module(), graph), mode
