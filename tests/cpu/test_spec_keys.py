"""Every op configuration's key (spec.py): the code `@spec` generates per class gives the
string the field table gives, for the defaults and for every field changed, and reads back."""

from __future__ import annotations

import dataclasses

import pytest

from te_compile import spec as spec_module
from te_compile.modules import dot_product_attention, layernorm_mlp  # noqa: F401  (their Specs)


def _specs() -> list[type]:
    found, todo = [], [spec_module.Spec]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls is not spec_module.Spec:
            found.append(cls)
    return sorted(found, key=lambda c: c.__qualname__)


def _changed(value, scalar: type, is_tuple: bool):
    if is_tuple:
        return (*value, _changed(scalar(), scalar, False)) if value else (scalar(), scalar())
    if scalar is bool:
        return not value
    if scalar is str:
        return f"{value}x"
    return value + (scalar(3) if scalar is int else 0.1)


def _instances(cls) -> list:
    """The class with its defaults (a field without one: its type's zero value), then with each
    field changed in turn, where the class's own checks accept the change."""
    required = {
        f.name: (() if is_tuple else scalar())
        for f, (_, _, scalar, is_tuple) in zip(dataclasses.fields(cls), cls._FIELDS, strict=True)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    base = cls(**required)
    out = [base]
    for name, _label, scalar, is_tuple in cls._FIELDS:
        try:
            changed = _changed(getattr(base, name), scalar, is_tuple)
            out.append(dataclasses.replace(base, **{name: changed}))
        except ValueError:  # e.g. QuantConfig's recipe kind: one of a closed set
            continue
    assert len(out) > len(cls._FIELDS) // 2, cls
    return out


def test_every_spec_module_is_imported():
    names = {c.__name__ for c in _specs()}
    assert {"NormSpec", "QuantConfig", "FusedAttnSpec", "MLPSpec", "ParallelSpec"} <= names


@pytest.mark.parametrize("cls", _specs(), ids=lambda c: c.__name__)
def test_generated_key_is_the_table_key(cls):
    def table_key(value) -> str:  # the key as the field table spells it
        return ";".join(
            f"{label}={spec_module._encode(getattr(value, name), scalar, is_tuple)}"
            for name, label, scalar, is_tuple in cls._FIELDS
        )

    for value in _instances(cls):
        assert value.key == table_key(value)
        assert cls.from_key(value.key) == value


def test_quant_config_refuses_what_it_cannot_hold():
    """QuantConfig's checks (skipped while dynamo traces the decoders that build configs) run
    where a key is decoded: in an op body, eagerly."""
    from te_compile.recipes import QuantConfig

    key = QuantConfig(kind="current").key
    with pytest.raises(ValueError, match="kind must be one of"):
        QuantConfig.from_key(key.replace("kind=current", "kind=bogus"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        QuantConfig.from_key(key.replace("dtypes=e4m3,", "dtypes=e9m9,"))
    with pytest.raises(ValueError, match="dims must be 1 or 2"):
        QuantConfig(kind="block", block_dims=(1, 3, 1))
