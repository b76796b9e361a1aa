"""Routes into training loops that compile the model for you (``transformers.Trainer``,
``accelerate``): option sets registered under a backend name, and regional compilation
in place.

Neither loop can be handed this backend by name: both turn the name into accelerate's
``DynamoBackend`` enum, which rejects names outside it. Compile the model in place
before handing it over, whole (``model.compile(backend=...)``) or block by block
(:func:`compile_regions`); the module keeps its class and its ``state_dict`` keys, so
checkpoints save and load as without compiling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from offload_pass import _compat
from offload_pass.backend import OffloadBackend, backend, default_backend

_registered: dict[str, OffloadBackend] = {}


def register_backend(name: str, **options: Any) -> OffloadBackend:
    """Register ``offload_pass.backend(**options)`` as ``torch.compile(backend=name)``.

    The options are checked here, so a bad value fails at registration with an error
    naming the option. Registering a name again with equal options returns the backend
    registered first; with other options, or a name torch already knows (``"inductor"``,
    ``"offload"``), it raises ``ValueError``. The returned backend keeps the plans of
    every model compiled under the name.
    """
    if not isinstance(name, str):
        raise TypeError(f"a backend name is a string, got {name!r}")
    if not name or name != name.strip():
        raise ValueError(f"a backend name is a non-empty string without edge spaces, got {name!r}")
    made = backend(**options)
    if name in _registered:
        if _registered[name].options != made.options:
            raise ValueError(
                f"backend name {name!r} is registered with other options "
                f"({_registered[name].options}); pick another name"
            )
        return _registered[name]
    if name in _compat.backend_names():
        raise ValueError(f"{name!r} is already a torch.compile backend name; pick another")
    _compat.register_backend_name(name, made)
    _registered[name] = made
    return made


def _is_repeated_blocks(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and all(isinstance(m, type(module[0])) for m in module)
    )


def _has_repeated_blocks(module: nn.Module) -> bool:
    return any(_is_repeated_blocks(m) for m in module.modules())


def compile_regions(
    model: nn.Module, backend: Callable[..., Any] | str = "offload", **compile_kwargs: Any
) -> list[str]:
    """Compile ``model`` region by region, in place, and return the compiled modules' paths.

    The regions are accelerate's (``use_regional_compilation``): each block of a
    ``ModuleList`` whose blocks share one class is compiled on its own, and every other
    module holding no such list is compiled whole. Blocks of one class share their
    compiled code and plan where Dynamo's guards let them (an HF decoder layer given a KV
    cache compiles again for each layer; training runs with ``use_cache=False``). Code
    outside these regions (a loss computed in the top module's ``forward``) runs eagerly.
    Each module is compiled with ``module.compile``, which keeps its class and parameter
    names, unlike ``accelerate.utils.compile_regions``, whose copies add ``_orig_mod.`` to
    the blocks' ``state_dict`` keys.

    ``backend`` is anything ``torch.compile`` takes (an :class:`OffloadBackend`, a
    registered name, ``"inductor"``); ``compile_kwargs`` are ``torch.compile``'s other
    arguments (``mode``, ``dynamic``, ``options``, ``fullgraph``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_regions expects an nn.Module, got {type(model).__name__}")
    if _compat.is_compiled_module(model):
        raise TypeError(
            "compile_regions got the result of torch.compile; pass the module itself "
            "(its _orig_mod)"
        )
    compiled: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        if _is_repeated_blocks(module):
            blocks_backend = _for_blocks(backend, len(module))
            for name, block in module.named_children():
                block.compile(backend=blocks_backend, **compile_kwargs)
                compiled.append(f"{path}.{name}" if path else name)
        elif _has_repeated_blocks(module):
            for name, child in module.named_children():
                visit(child, f"{path}.{name}" if path else name)
        else:
            module.compile(backend=backend, **compile_kwargs)
            compiled.append(path)

    visit(model, "")
    return compiled


def _for_blocks(backend: Callable[..., Any] | str, count: int) -> Callable[..., Any] | str:
    """``backend`` for ``count`` blocks sharing one chunk, where it is offload_pass's
    (by object or registered name): their forwards all run before a backward."""
    named = {"offload": default_backend, **_registered}
    found = named.get(backend) if isinstance(backend, str) else backend
    if isinstance(found, OffloadBackend):
        return found.with_forwards_in_flight(count)
    return backend
