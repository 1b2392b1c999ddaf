"""Reversible attribute swaps: the only way te-compile changes Transformer Engine.

A `Swap` replaces one attribute of a class or module. For a module-level function it also
replaces every other `transformer_engine.*` module attribute bound to the same function object
(TE re-exports functions by name, e.g. `fp8.check_recipe_support`), so callers see one behaviour
whichever name they imported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

_INHERITED = object()  # marks a class attribute that lived on a base class
DELETED = object()  # a Swap replacement that removes the attribute while patched


@dataclass(frozen=True)
class Swap:
    owner: Any  # a class or a module
    name: str
    replacement: Any  # for classes: the raw descriptor (classmethod/staticmethod/function),
    # or DELETED


@dataclass
class _Applied:
    # (owner, name, original raw attribute) in application order
    originals: list[tuple[Any, str, Any]] = field(default_factory=list)


def _raw(owner: Any, name: str) -> Any:
    """The attribute as stored (a classmethod stays a classmethod)."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
        raise AttributeError(f"{owner.__qualname__} has no attribute {name!r}")
    return getattr(owner, name)


def _aliases(obj: Any, skip: Any) -> list[tuple[Any, str]]:
    """Other TE modules that hold `obj` under some name (re-exports)."""
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is skip or not mod_name.startswith("transformer_engine"):
            continue
        for attr, value in list(vars(mod).items()):
            if value is obj:
                found.append((mod, attr))
    return found


class Patcher:
    """Applies a list of swaps once and reverts them exactly."""

    def __init__(self) -> None:
        self._applied: _Applied | None = None

    @property
    def active(self) -> bool:
        return self._applied is not None

    def apply(self, swaps: list[Swap]) -> None:
        if self._applied is not None:
            return
        applied = _Applied()
        try:
            for swap in swaps:
                original = _raw(swap.owner, swap.name)
                targets = [(swap.owner, swap.name)]
                if not isinstance(swap.owner, type):
                    targets += _aliases(original, skip=swap.owner)
                for owner, name in targets:
                    applied.originals.append((owner, name, vars(owner).get(name, _INHERITED)))
                    if swap.replacement is DELETED:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, swap.replacement)
        except BaseException:
            self._restore(applied)
            raise
        self._applied = applied

    def revert(self) -> None:
        if self._applied is None:
            return
        self._restore(self._applied)
        self._applied = None

    @staticmethod
    def _restore(applied: _Applied) -> None:
        for owner, name, original in reversed(applied.originals):
            if original is _INHERITED:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
