"""One codec for every configuration that crosses a custom-op boundary.

An op's configuration (recipe, norm, activation, GEMM flags) is a frozen dataclass derived from
`Spec` and declared with `@spec`. It crosses the boundary as one canonical string, `spec.key` ("name=value;..."), built
while dynamo traces, and the op side gets the dataclass back with `Cls.from_key(key)`: cached
by value, so an op call pays one dict lookup, never a parse. Keys must round-trip exactly
(`from_key` checks it), so a field type the codec cannot carry fails at build time, not on the
GPU.

Field values are str, bool, int, float or tuples of one of those; a field may name a shorter
key label in its metadata (`field(metadata={"label": "eps"})`).
"""

from __future__ import annotations

import dataclasses
import functools
import typing

_SCALARS = (bool, int, float, str)  # bool before int: bool is an int


def spec(cls):
    """Class decorator of a `Spec`: a frozen dataclass whose field table (name, key label,
    scalar type, is a tuple) is read from its annotations once, at import. `key` is built
    while dynamo traces, so it must only read that table, never introspect."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    hints = typing.get_type_hints(cls)
    table = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        is_tuple = typing.get_origin(hint) is tuple
        scalar = typing.get_args(hint)[0] if is_tuple else hint
        if scalar not in _SCALARS:
            raise TypeError(f"{cls.__name__}.{f.name}: a Spec field must be one of {_SCALARS}")
        table.append((f.name, f.metadata.get("label", f.name), scalar, is_tuple))
    cls._FIELDS = tuple(table)
    cls.key = property(_key_function(cls.__name__, cls._FIELDS))
    return cls


class Spec:
    """Base of the op configurations (declare them with `@spec`): `key` / `from_key`."""

    _FIELDS: tuple = ()
    key: str  # "label=value;..." in field order: a property `@spec` generates (_key_function)

    @classmethod
    def from_key(cls, key: str):
        """Inverse of `key`, cached: ops call it on every run."""
        return _from_key(cls, key)


def _key_function(class_name: str, fields: tuple):
    """`key` for one Spec class as straight-line code with its field table written in: dynamo
    traces `key`, and reading the table there put a guard on every entry of it into each
    compiled frame, checked on every call (FusedAttnSpec's alone was 115 guard lines of a
    TransformerLayer's 2,030, session 34). Each value as `_encode` writes it
    (tests/cpu/test_spec_keys.py checks the string against the table for every Spec)."""
    parts = [
        f"{label!r} + '=' + _encode(self.{name}, {scalar.__name__}, {is_tuple})"
        for name, label, scalar, is_tuple in fields
    ]
    source = "def key(self):\n    return " + (" + ';' + ".join(parts) or "''") + "\n"
    namespace = {}
    exec(compile(source, f"<{class_name}.key>", "exec"), globals(), namespace)  # noqa: S102
    return namespace["key"]


def _encode(value, scalar: type, is_tuple: bool) -> str:
    """As the declared type says (an int given for a float field still reads back equal)."""
    if is_tuple:
        return ",".join(_encode(v, scalar, False) for v in value)
    if scalar is bool:
        return str(int(bool(value)))
    if scalar is str:
        return str(value)
    number = constant_number(value)
    return repr(float(number)) if scalar is float else str(int(number))


def constant_number(value):
    """`value`, an int or float read from a recipe or module while dynamo traces, as a constant.
    Under torch.compile(dynamic=True) dynamo reads such numbers as symbolic ones, which repr,
    str and assume_constant_result refuse; %-formatting one specializes it (a guard: another
    value recompiles), on torch 2.11 and 2.14 alike."""
    text = "%r" % (float(value),)  # noqa: UP031 (the one form dynamo specializes)
    return float(text) if isinstance(value, float) else int(float(text))


def _decode(raw: str, scalar: type, is_tuple: bool):
    if is_tuple:
        return tuple(_decode(r, scalar, False) for r in raw.split(",") if r)
    if scalar is bool:
        return bool(int(raw))
    return scalar(raw)


@functools.lru_cache(maxsize=4096)
def _from_key(cls, key: str):
    raw = dict(item.split("=", 1) for item in key.split(";"))
    spec = cls(**{n: _decode(raw[label], s, t) for n, label, s, t in cls._FIELDS})
    if spec.key != key:
        raise ValueError(f"not a canonical {cls.__name__} key: {key!r}")
    return spec


def labelled(label: str, default):
    """A field whose key label is `label` instead of its name (keeps keys short)."""
    return dataclasses.field(default=default, metadata={"label": label})


@spec
class NormSpec(Spec):
    """A norm's options, as TE's layernorm/rmsnorm kernels take them (te.LayerNorm, te.RMSNorm,
    the norm of LayerNormLinear and LayerNormMLP)."""

    normalization: str = labelled("norm", "LayerNorm")  # or "RMSNorm"
    eps: float = 1e-5
    zero_centered_gamma: bool = labelled("zcg", False)
    fwd_sm_margin: int = labelled("fwd_margin", 0)
    bwd_sm_margin: int = labelled("bwd_margin", 0)


@spec
class GemmGrads(Spec):
    """What a one-GEMM backward op (te.Linear's, LayerNormLinear's) computes: decided from
    `needs_input_grad` when autograd traces the backward, and from what the forward saved."""

    has_bias: bool = labelled("bias", False)
    dgrad: bool = True  # LayerNormLinear: the norm's gradients, which need dgrad
    wgrad: bool = True
    accumulate: bool = labelled("acc", False)  # wgrad adds to main_grad (fuse_wgrad_accumulation)
    input_parts: int = labelled("in_parts", 0)  # the input's column-wise parts heading `parts`


@spec
class ParallelSpec(Spec):
    """A GEMM's tensor parallelism, as TE's tp_group / parallel_mode / sequence_parallel give
    it. "column": output features sharded; under sequence parallelism the input arrives
    sharded along its first dimension and is all-gathered, and dgrad is reduce-scattered
    (else all-reduced). "row": input features sharded; the output is reduce-scattered under
    sequence parallelism (else all-reduced), and grad_output all-gathered. An op gets its key,
    or "" for a GEMM without tensor-parallel communication."""

    mode: str = "column"  # or "row"
    sequence: bool = labelled("sp", False)
    group: str = ""  # the tp_group's name (kernels/process_groups.py)
    size: int = 2

    @property
    def gathers_input(self) -> bool:
        return self.mode == "column" and self.sequence

    @property
    def gathers_grad(self) -> bool:
        return self.mode == "row" and self.sequence

    def leading(self, n: int, forward: bool) -> int:
        """The first dimension of a GEMM op's output (forward) or dgrad (backward) given its
        input's (or grad_output's) first dimension `n`."""
        if not self.sequence:
            return n
        grows = (self.mode == "column") == forward
        return n * self.size if grows else n // self.size
