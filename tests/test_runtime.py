"""The runtime's layout staging, on the CPU: what an offload copies from."""

from __future__ import annotations

import torch

from offload_pass import runtime


def test_an_offload_copies_from_the_device_tensor_itself_where_layouts_match():
    a = torch.randn(4, 1, 6)
    h = torch.empty_permuted((4, 1, 6), (1, 0, 2))  # the size-1 dimension's stride differs
    assert runtime._in_layout_of(h, a) is a


def test_an_offload_reorders_on_the_device_where_layouts_differ():
    a = torch.randn(4, 6)
    h = torch.empty_permuted((4, 6), (1, 0))
    staged = runtime._in_layout_of(h, a)
    assert staged.stride() == h.stride() and staged.device == a.device
    assert torch.equal(staged, a)
