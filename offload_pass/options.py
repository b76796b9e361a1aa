"""User options, checked once, and the rule that turns them into a fraction per module."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import torch

from offload_pass import _compat
from offload_pass.profiles import DeviceProfile, check_profile_spec

Compiler = Literal["inductor", "eager"]
COMPILERS: tuple[str, ...] = ("inductor", "eager")
DEFAULT_MIN_BYTES = 256 * 1024
DEFAULT_STALL_TOLERANCE = 0.02
SEARCH: Literal["search"] = "search"
"""``recompute_budget``'s value that lets the pass choose the split (offload_pass.joint)."""


def check_fraction(value: object, what: str = "fraction") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number in [0, 1], got {value!r}")
    if not (0.0 <= float(value) <= 1.0):
        raise ValueError(f"{what} must be in [0, 1], got {value!r}")
    return float(value)


Fractions = float | Mapping[str, float] | tuple[tuple[str, float], ...] | None
"""A share for every module, or shares by module-path pattern (a mapping, kept as pairs)."""


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """What the user asked for, checked when made (see :func:`offload_pass.backend` for
    each option's meaning).

    The planner mode: ``fraction`` (one share for every module, or a mapping from
    module-path patterns in ``fnmatch`` syntax such as ``"blocks.*.attn"`` to shares),
    else ``memory_budget`` (bytes, or a share of the predicted peak without offloading),
    else ``auto``. With a mapping, a pattern covers the modules it matches and everything
    inside them; where several cover a module, the one listed last wins, and what no
    pattern covers moves nothing (list ``"*"`` first to give the rest a share).
    """

    fraction: Fractions = None
    memory_budget: int | float | None = None
    stall_tolerance: float = DEFAULT_STALL_TOLERANCE
    profile: DeviceProfile | str | None = None
    min_bytes: int = DEFAULT_MIN_BYTES
    compiler: Compiler = "inductor"
    dump_dir: str | os.PathLike[str] | None = None
    in_flight_microbatches: int = 1
    recompute_budget: float | Literal["search"] | None = None

    def __post_init__(self) -> None:
        if self.fraction is not None and self.memory_budget is not None:
            raise ValueError("give either fraction or memory_budget, not both")
        min_bytes = self.min_bytes
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {self.compiler!r}")
        checked = {
            "fraction": _check_fractions(self.fraction),
            "memory_budget": _check_budget(self.memory_budget),
            "stall_tolerance": check_fraction(self.stall_tolerance, "stall_tolerance"),
            "profile": check_profile_spec(self.profile),
            "dump_dir": _check_dump_dir(self.dump_dir),
            "in_flight_microbatches": _check_in_flight(self.in_flight_microbatches),
            "recompute_budget": _check_recompute_budget(self.recompute_budget),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.fraction is not None and self.recompute_budget == SEARCH:
            raise ValueError(
                f"recompute_budget={SEARCH!r} chooses the split for auto or memory_budget; "
                "with fraction, give the split's budget as a number in (0, 1]"
            )

    @property
    def default_fraction(self) -> float | None:
        """The share of modules no pattern covers: 0 beside patterns, None in the other
        modes."""
        if isinstance(self.fraction, tuple):
            return 0.0
        return self.fraction

    @property
    def patterns(self) -> tuple[tuple[str, float], ...]:
        return self.fraction if isinstance(self.fraction, tuple) else ()

    @property
    def fixed_recompute_budget(self) -> float | None:
        """The split's recompute budget where the options fix one; None for torch's
        setting, as the first split a search tries."""
        return None if self.recompute_budget == SEARCH else self.recompute_budget

    @property
    def mode(self) -> str:
        if self.default_fraction is not None:
            return "fraction"
        return "auto" if self.memory_budget is None else "memory_budget"

    def fraction_rule(self) -> FractionRule:
        """The shares in force now: the options' and :func:`set_fraction`'s."""
        return FractionRule(
            self.default_fraction, self.patterns, tuple(sorted(fraction_overrides().items()))
        )

    def check_patterns_match(self, module_paths: Iterable[str]) -> None:
        paths = list(module_paths)
        for pattern, _ in self.patterns:
            if not any(fnmatch.fnmatchcase(path, pattern) for path in paths):
                example = ", ".join(repr(p) for p in paths[1:4] if p)
                raise ValueError(
                    f"fraction pattern {pattern!r} matches no module of the compiled "
                    f"model (module paths look like {example})"
                )


def _check_fractions(fraction: object) -> float | tuple[tuple[str, float], ...] | None:
    if fraction is None:
        return None
    if isinstance(fraction, Mapping):
        fraction = tuple(fraction.items())
    if isinstance(fraction, tuple):
        return tuple(
            (_check_pattern(p), check_fraction(f, f"fraction[{p!r}]")) for p, f in fraction
        )
    return check_fraction(fraction)


def _check_in_flight(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"in_flight_microbatches must be an int >= 1, got {count!r}")
    return count


def _check_recompute_budget(budget: object) -> float | Literal["search"] | None:
    if budget is None or (isinstance(budget, str) and budget == SEARCH):
        return budget  # type: ignore[return-value]
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"recompute_budget must be a number in (0, 1] or {SEARCH!r}, got {budget!r}"
        )
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"recompute_budget must be in (0, 1], got {budget!r}")
    return float(budget)


def _check_dump_dir(folder: object) -> str | None:
    if folder is None:
        return None
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"dump_dir must be a path, got {folder!r}")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"dump_dir must be a folder; {os.fspath(folder)!r} is a file")
    return os.fspath(folder)


def _check_budget(budget: object) -> int | float | None:
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"memory_budget must be bytes (int) or a share (float), got {budget!r}")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"memory_budget in bytes must be positive, got {budget!r}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(
            f"memory_budget as a share of the peak without offloading must be in (0, 1], "
            f"got {budget!r}"
        )
    return budget


def _check_pattern(pattern: object) -> str:
    if not isinstance(pattern, str):
        raise TypeError(f"fraction patterns must be strings, got {pattern!r}")
    return pattern


_overrides: weakref.WeakKeyDictionary[torch.nn.Module, float] = weakref.WeakKeyDictionary()
_compiled_frames: dict[types.CodeType, set[int]] = {}
"""Each frame compiled with an offload backend, and the ids of the modules its graphs
ran (ids of dead modules may linger: they only cost a needless recompile)."""
_frame_listeners: dict[types.CodeType, list[weakref.WeakMethod]] = {}


def record_compiled_frame(
    code: types.CodeType,
    module_ids: Iterable[int],
    on_discard: Callable[[types.CodeType], None],
) -> None:
    """Note that ``code``'s compiled graphs plan the modules ``module_ids``, and that
    ``on_discard`` (a bound method, held weakly) is to hear when that code is discarded."""
    _compiled_frames.setdefault(code, set()).update(module_ids)
    listeners = _frame_listeners.setdefault(code, [])
    listener = weakref.WeakMethod(on_discard)
    if listener not in listeners:  # one per backend, however often the frame recompiles
        listeners.append(listener)


def set_fraction(module: torch.nn.Module, fraction: float) -> None:
    """Offload ``fraction`` of ``module``'s activations from the next call on.

    Takes precedence over the backend's ``fraction`` option for this module and the
    modules inside it. What was compiled for the frames whose graphs run ``module`` is
    discarded, so their next call compiles and plans again with the new share; other
    compiled code is kept.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"set_fraction expects an nn.Module, got {type(module).__name__}")
    _overrides[module] = check_fraction(fraction)
    for code, module_ids in _compiled_frames.items():
        if id(module) in module_ids:
            _compat.discard_compiled_code(code)
            listeners = [ref() for ref in _frame_listeners.pop(code, [])]
            for listener in dict.fromkeys(filter(None, listeners)):
                listener(code)


def fraction_overrides() -> dict[int, float]:
    """The shares set with :func:`set_fraction`, by ``id`` of the live module."""
    return {id(module): share for module, share in _overrides.items()}


@dataclasses.dataclass(frozen=True)
class FractionRule:
    """The options and :func:`set_fraction` overrides in force when a chunk compiles."""

    default: float | None
    patterns: tuple[tuple[str, float], ...]
    overrides: tuple[tuple[int, float], ...]

    def resolve(self, stack: tuple[tuple[str, int | None], ...]) -> tuple[str, float | None]:
        """(the module whose share applies, the share) for a node's module stack; the
        share is None where the planner's mode (auto or memory budget) decides.

        A :func:`set_fraction` override decides first, the innermost one if several;
        then the pattern listed last among those covering a module in the stack, owned by
        the outermost module it matches; then the default, owned by the root.
        """
        overrides = dict(self.overrides)
        for path, module_id in reversed(stack):
            if module_id in overrides:
                return path, overrides[module_id]
        for pattern, share in reversed(self.patterns):
            for path, _ in stack:
                if fnmatch.fnmatchcase(path, pattern):
                    return path, share
        return "", self.default
