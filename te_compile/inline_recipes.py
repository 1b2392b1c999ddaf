"""TE recipe objects constructed inside compiled code.

`with te.autocast(recipe=Float8CurrentScaling()):` in a model's forward is everyday TE code, but
TE's recipes are pydantic dataclasses: their constructor validates through pydantic-core (C), so
dynamo graph-breaks on it ("Pydantic dataclass constructor").

While patched, each recipe class gets an `__init__`
that, when not compiling, is TE's own (pydantic validation and `__post_init__` checks, errors
included), and while dynamo traces:

1. builds the recipe for real, eagerly, through TE's own constructor, in an
   `assume_constant_result` call keyed on (class, args, kwargs) that returns the name under
   which it keeps the object: validation errors surface at trace time, and equal arguments
   give the same object;
2. copies that object's fields into the instance being traced.

Dynamo reads the fields from the cached object, so each step's trace sees the same values and
guards: equal recipes do not recompile. The class marker `__is_pydantic_dataclass__`, which is
what makes dynamo refuse the constructor, is removed while patched (pydantic reads it only when
building schemas for new classes) and restored by `unpatch()`.

Arguments must be hashable constants (numbers, strings, enums, tuples) or objects built
outside the compiled code. QParams/MMParams constructed inside compiled code still graph-break
(dynamo cannot hand a frozen dataclass built in the trace to an eager call): build those once
outside, e.g. as module constants.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .patching import DELETED, Swap

_PYDANTIC_MARKER = "__is_pydantic_dataclass__"
_CLASS_NAMES = (
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
)


class _Built:
    """Holds each recipe built while tracing as an attribute: compiled code reads it by a
    constant name, so dynamo guards on that one attribute, not on a growing container."""


_BUILT = _Built()
_NAMES: dict[tuple, str] = {}  # (class, kwarg names, argument values) -> attribute of _BUILT
_TE_INIT: dict[type, Any] = {}


@torch.compiler.assume_constant_result
def _build(cls: type, kwarg_names: tuple, *values) -> str:
    """Build the recipe with TE's own constructor, once per key; runs eagerly while dynamo
    traces. Arguments arrive flat (dynamo hands an assume_constant_result call only top-level
    objects, not objects nested in tuples); the last len(kwarg_names) are keyword arguments."""
    key = (cls, kwarg_names, values)
    if key not in _NAMES:
        split = len(values) - len(kwarg_names)
        obj = cls.__new__(cls)
        _TE_INIT[cls](obj, *values[:split], **dict(zip(kwarg_names, values[split:], strict=True)))
        _NAMES[key] = f"{cls.__name__}_{len(_NAMES)}"
        setattr(_BUILT, _NAMES[key], obj)
    return _NAMES[key]


def _traceable_init(te_init):
    def __init__(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return te_init(self, *args, **kwargs)
        names = tuple(kwargs)
        built = getattr(_BUILT, _build(type(self), names, *args, *kwargs.values()))
        for field in dataclasses.fields(built):
            object.__setattr__(self, field.name, getattr(built, field.name))
        return None

    __init__.__wrapped__ = te_init
    return __init__


def swaps() -> list[Swap]:
    from transformer_engine.common import recipe

    out = []
    for name in _CLASS_NAMES:
        cls = getattr(recipe, name, None)
        if cls is None or _PYDANTIC_MARKER not in vars(cls):
            continue
        _TE_INIT[cls] = vars(cls)["__init__"]
        out.append(Swap(cls, "__init__", _traceable_init(_TE_INIT[cls])))
        out.append(Swap(cls, _PYDANTIC_MARKER, DELETED))
    return out
