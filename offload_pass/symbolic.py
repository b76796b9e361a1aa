"""Symbolic sizes across the boundary between forward and backward.

Under dynamic shapes a saved view takes SymInt arguments (``view(x, [s0, s1, 96])``),
computed by forward's nodes. When its storage moves, backward applies the view again to
the reloaded storage, so it needs the same values from its own nodes: a backward input
carrying the same symbolic expression, a size of the reloaded storage, or arithmetic on
those, copied from forward.
"""

from __future__ import annotations

import dataclasses

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree


def symbolic_expr(node: torch.fx.Node) -> sympy.Expr | None:
    value = node.meta.get("val")
    return value.node.expr if isinstance(value, torch.SymInt) else None


def _is_size_arithmetic(node: torch.fx.Node) -> bool:
    """A node computing a SymInt from SymInts and constants alone."""
    if node.op != "call_function" or symbolic_expr(node) is None:
        return False
    return all(symbolic_expr(arg) is not None for arg in node.all_input_nodes)


@dataclasses.dataclass(frozen=True)
class SymbolSources:
    """Where backward can read each symbolic size: one of its inputs, or a dimension of
    the storage it reloads."""

    inputs: dict[sympy.Expr, torch.fx.Node]
    dims: dict[sympy.Expr, int]

    @staticmethod
    def inputs_of(backward: torch.fx.Graph) -> dict[sympy.Expr, torch.fx.Node]:
        """Each symbolic size among backward's inputs, and the first input carrying it."""
        inputs: dict[sympy.Expr, torch.fx.Node] = {}
        for node in backward.find_nodes(op="placeholder"):
            expr = symbolic_expr(node)
            if expr is not None:
                inputs.setdefault(expr, node)
        return inputs

    @classmethod
    def of(cls, inputs: dict[sympy.Expr, torch.fx.Node], storage: torch.Tensor) -> SymbolSources:
        """The sources for a view of ``storage``: ``inputs`` (see :meth:`inputs_of`) and
        the storage's own dimensions."""
        dims = {}
        for d, size in enumerate(storage.shape):
            if isinstance(size, torch.SymInt):
                dims.setdefault(size.node.expr, d)
        return cls(inputs, dims)

    def can_derive(self, arg: object) -> bool:
        """Whether backward can compute every node among ``arg``'s leaves."""
        return all(self._derivable(n) for n in _nodes_in(arg))

    def _derivable(self, node: torch.fx.Node) -> bool:
        expr = symbolic_expr(node)
        if expr is None:
            return False
        if expr in self.inputs or expr in self.dims:
            return True
        return _is_size_arithmetic(node) and all(self._derivable(n) for n in node.all_input_nodes)

    def derive(self, arg: object, graph: torch.fx.Graph, storage: torch.fx.Node) -> object:
        """``arg`` with each forward node replaced by a backward node of the same value,
        inserted at the graph's insertion point (``storage`` is the reloaded storage)."""

        def derived(node: torch.fx.Node) -> torch.fx.Node:
            expr = symbolic_expr(node)
            if expr in self.inputs:
                return self.inputs[expr]
            if expr in self.dims:
                size = graph.call_function(torch.ops.aten.sym_size.int, (storage, self.dims[expr]))
                size.meta["val"] = node.meta["val"]
                return size
            copy = graph.node_copy(node, derived)
            copy.meta["val"] = node.meta["val"]
            return copy

        return torch.fx.node.map_arg(arg, derived)


def _nodes_in(arg: object) -> list[torch.fx.Node]:
    return [leaf for leaf in pytree.tree_leaves(arg) if isinstance(leaf, torch.fx.Node)]
