"""The runtime on the CPU: what an offload copies from, and one op moving several
tensors."""

from __future__ import annotations

import pytest
import torch

from offload_pass import ops, runtime


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


def test_one_op_moves_a_bucket_of_tensors_each_into_its_layout_and_back():
    a = torch.randn(4, 6)
    b = torch.randn(3, 5, dtype=torch.bfloat16).t()
    layouts = [0, 1, 1, 0]
    before = runtime.counts()
    hosts = ops.offload_wait(ops.offload([a, b], layouts), [a, b], layouts, [])
    assert [h.stride() for h in hosts] == [(6, 1), (1, 5)]
    assert runtime.counts().offloads - before.offloads == 2
    loaded = ops.reload_wait(ops.reload(hosts, a.device, []), hosts, a.device)
    assert torch.equal(loaded[0], a) and torch.equal(loaded[1], b)
    assert runtime.counts().pending_offloads == before.pending_offloads
    assert runtime.counts().pending_reloads == before.pending_reloads


def test_an_op_given_no_tensors_or_layouts_of_other_ranks_says_so():
    with pytest.raises(runtime.OffloadError, match="offload: no tensors given"):
        ops.offload([], [])
    with pytest.raises(ValueError, match=r"layouts: 3 dimensions given for tensors of \[2, 2\]"):
        ops.offload([torch.randn(2, 2), torch.randn(2, 2)], [0, 1, 0])
