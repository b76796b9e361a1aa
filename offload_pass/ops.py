"""The four graph ops of the offload contract (see docs/design.md).

``offload_wait`` and ``reload_wait`` declare that they mutate the tensor they complete.
That keeps them from being dropped as dead code, and orders every later read of that
tensor after them, in the FX graph and in Inductor's schedule alike. ``offload_wait``
also declares that it mutates the device tensor, so every earlier read of it is ordered
before the wait. ``offload_wait`` and ``reload`` take ``after``: values computed where the
planner placed them, so no compiler pass can move them earlier than that point.
"""

from collections.abc import Sequence

import torch
import torch.fx
from torch import Tensor

from offload_pass import _compat, runtime


@torch.library.custom_op(
    "offload_pass::offload", mutates_args=(), tags=_compat.exact_strides_tags()
)
def offload(a: Tensor, stride: Sequence[int]) -> Tensor:
    """Start copying ``a`` into a host buffer with strides ``stride``.

    The strides are fixed when the graph is rewritten, so the host tensor has the layout
    the backward graph was compiled for, whatever layout the compiler chose for ``a``.
    """
    return runtime.offload(a, stride)


@offload.register_fake
def _offload_fake(a: Tensor, stride: Sequence[int]) -> Tensor:
    return torch.empty_strided(a.shape, stride, dtype=a.dtype, device="cpu")


@torch.library.custom_op("offload_pass::offload_wait", mutates_args=("h", "a"))
def offload_wait(h: Tensor, a: Tensor, after: Sequence[Tensor]) -> None:
    """Make the compute stream wait until ``h`` holds ``a``; the last use of ``a``."""
    runtime.offload_wait(h, a)


@offload_wait.register_fake
def _offload_wait_fake(h: Tensor, a: Tensor, after: Sequence[Tensor]) -> None:
    return None


@torch.library.custom_op("offload_pass::reload", mutates_args=())
def reload(h: Tensor, device: torch.device, after: Sequence[Tensor]) -> Tensor:
    """Start copying ``h`` back to ``device`` once its offload has completed."""
    return runtime.reload(h, device)


@reload.register_fake
def _reload_fake(h: Tensor, device: torch.device, after: Sequence[Tensor]) -> Tensor:
    return torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)


@torch.library.custom_op("offload_pass::reload_wait", mutates_args=("g",))
def reload_wait(g: Tensor) -> None:
    """Make the compute stream wait until the reload into ``g`` has completed."""
    runtime.reload_wait(g)


@reload_wait.register_fake
def _reload_wait_fake(g: Tensor) -> None:
    return None


OFFLOAD = torch.ops.offload_pass.offload.default
OFFLOAD_WAIT = torch.ops.offload_pass.offload_wait.default
RELOAD = torch.ops.offload_pass.reload.default
RELOAD_WAIT = torch.ops.offload_pass.reload_wait.default
TRANSFERS = frozenset({OFFLOAD, OFFLOAD_WAIT, RELOAD, RELOAD_WAIT})


def holds_transfers(gm: torch.fx.GraphModule) -> bool:
    return any(node.target in TRANSFERS for node in gm.graph.nodes)
