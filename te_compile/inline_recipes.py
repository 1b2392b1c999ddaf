"""TE recipe objects constructed inside compiled code.

`with te.autocast(recipe=Float8CurrentScaling()):` in a model's forward is everyday TE code, but
TE's recipes are pydantic dataclasses: their constructor validates through pydantic-core (C), so
dynamo graph-breaks on it ("Pydantic dataclass constructor").

While patched, each recipe class (and QParams/MMParams, recipe arguments that are pydantic
dataclasses too) gets an `__init__` that, when not compiling, is TE's own (pydantic validation and `__post_init__` checks, errors
included), and while dynamo traces:

1. builds the recipe for real, eagerly, through TE's own constructor, in an
   `assume_constant_result` call keyed on (class, args, kwargs) that returns the name under
   which it keeps the object: validation errors surface at trace time, and equal arguments
   give the same object;
2. copies that object's attributes (its fields and what `__post_init__` set) into the instance
   being traced.

Dynamo reads the fields from the cached object, so each step's trace sees the same values and
guards: equal recipes do not recompile. The class marker `__is_pydantic_dataclass__`, which is
what makes dynamo refuse the constructor, is removed while patched (pydantic reads it only when
building schemas for new classes) and restored by `unpatch()`.

Arguments must be hashable constants (numbers, strings, enums, tuples), objects built
outside the compiled code, or QParams/MMParams instances (built inside or outside the compiled
code). Those cross into the eager call as their class and field values and are rebuilt there: dynamo cannot hand a frozen
dataclass instance to an `assume_constant_result` call (torch 2.11 refuses even one built
outside: "currently can't reconstruct arbitrary frozen dataclass instances").
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
    "QParams",  # recipe arguments, frozen pydantic dataclasses too
    "MMParams",
)


class _Built:
    """Holds each recipe built while tracing as an attribute: compiled code reads it by a
    constant name, so dynamo guards on that one attribute, not on a growing container."""


_BUILT = _Built()
_NAMES: dict[tuple, str] = {}  # (class, kwarg names, argument values) -> attribute of _BUILT
_TE_INIT: dict[type, Any] = {}
_PARAM_TYPES: tuple[type, ...] = ()  # TE's frozen dataclasses of recipe arguments, set by swaps()


class _Fields:
    """Marker in `_build`'s flat arguments: the next value is a dataclass, then its fields."""


def _flat(value) -> list:
    """One recipe argument as `_build` receives it: a QParams/MMParams instance as
    [_Fields, its class, *field values], read while tracing; anything else as is. (An
    isinstance test on TE's classes: dynamo cannot trace `dataclasses.is_dataclass` on every
    argument, e.g. an enum.)"""
    if not isinstance(value, _PARAM_TYPES):
        return [value]
    fields = dataclasses.fields(value)
    return [_Fields, type(value), *[getattr(value, f.name) for f in fields]]


def _unflat(values: tuple) -> list:
    """Inverse of `_flat` over all arguments: rebuilds each dataclass by its constructor."""
    out, rest = [], iter(values)
    for value in rest:
        if value is _Fields:
            cls = next(rest)
            names = [f.name for f in dataclasses.fields(cls)]
            value = cls(**{name: next(rest) for name in names})
        out.append(value)
    return out


@torch.compiler.assume_constant_result
def _build(cls: type, kwarg_names: tuple, *values) -> str:
    """Build the recipe with TE's own constructor, once per key; runs eagerly while dynamo
    traces. Arguments arrive flat (dynamo hands an assume_constant_result call only top-level
    constants: no objects nested in tuples, no dataclass instances; see `_flat`); the last
    len(kwarg_names) are keyword arguments."""
    key = (cls, kwarg_names, values)
    if key not in _NAMES:
        args = _unflat(values)
        split = len(args) - len(kwarg_names)
        obj = cls.__new__(cls)
        _TE_INIT[cls](obj, *args[:split], **dict(zip(kwarg_names, args[split:], strict=True)))
        _NAMES[key] = f"{cls.__name__}_{len(_NAMES)}"
        setattr(_BUILT, _NAMES[key], obj)
        # every instance attribute, not only the dataclass fields: __post_init__ sets more
        # (NVFP4BlockScaling's fp4_quant_* QParams, the _cached_repr of several classes)
        setattr(_BUILT, f"{_NAMES[key]}_attributes", tuple(vars(obj)))
    return _NAMES[key]


def _traceable_init(te_init):
    def __init__(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return te_init(self, *args, **kwargs)
        names = tuple(kwargs)
        flat = [v for arg in (*args, *kwargs.values()) for v in _flat(arg)]
        name = _build(type(self), names, *flat)
        built = getattr(_BUILT, name)
        for attribute in getattr(_BUILT, f"{name}_attributes"):
            object.__setattr__(self, attribute, getattr(built, attribute))
        return None

    __init__.__wrapped__ = te_init
    return __init__


def swaps() -> list[Swap]:
    from transformer_engine.common import recipe

    global _PARAM_TYPES
    _PARAM_TYPES = tuple(
        cls
        for cls in (getattr(recipe, n, None) for n in ("QParams", "MMParams"))
        if isinstance(cls, type) and all(f.init for f in dataclasses.fields(cls))
    )
    out = []
    for name in _CLASS_NAMES:
        cls = getattr(recipe, name, None)
        if cls is None or _PYDANTIC_MARKER not in vars(cls):
            continue
        _TE_INIT[cls] = vars(cls)["__init__"]
        out.append(Swap(cls, "__init__", _traceable_init(_TE_INIT[cls])))
        out.append(Swap(cls, _PYDANTIC_MARKER, DELETED))
    return out
