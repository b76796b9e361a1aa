"""One test per version-dependent path of offload_pass._compat."""

from __future__ import annotations

import types

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from offload_pass import _compat


def test_exact_strides_tag_when_torch_has_it():
    assert _compat.exact_strides_tags() == (torch.Tag.needs_exact_strides,)


def test_fixed_stride_order_tag_on_older_torch():
    older = types.SimpleNamespace(needs_fixed_stride_order="fixed")
    assert _compat.exact_strides_tags(older) == ("fixed",)


def test_no_layout_tag_when_torch_has_none():
    assert _compat.exact_strides_tags(types.SimpleNamespace()) == ()


def test_module_paths_in_both_source_spellings():
    assert _compat.split_source_path("L['self'].blocks.0.attn") == ("L['self']", "blocks.0.attn")
    assert _compat.split_source_path("L['self'].blocks[0].attn") == ("L['self']", "blocks.0.attn")
    assert _compat.split_source_path("L['fn']._modules['blocks']._modules['1']") == (
        "L['fn']",
        "blocks.1",
    )
    assert _compat.split_source_path("L['fn']") == ("L['fn']", "")


def test_concrete_int_reads_symbolic_hints():
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(7, source=ConstantSource("n")), hint=7)
    assert _compat.concrete_int(backed) == 7
    assert _compat.concrete_int(env.create_unbacked_symint()) is None
    assert _compat.concrete_int(5) == 5


def test_no_root_modules_outside_dynamo():
    assert _compat.root_modules_being_compiled() == {}
