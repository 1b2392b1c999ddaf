"""Each op declared once: its typed Python implementation is the single source of its schema,
its fake kernel's arguments, its autograd context's unpacking and its None-gradient padding.

    @op(mutates=("cache", "valid"))
    def quantize_weight(weight: Tensor, cache: list[Tensor], valid: Tensor, config: str) -> None:
        ...

    @quantize_weight.fake
    def _(a):            # `a.weight`, `a.cache`, ...: the call's arguments by name
        return None

The schema comes from `torch.library.infer_schema` (mutated arguments marked `(a!)`) and is
registered through `torch.library.Library.define` with the implementation as the CUDA kernel:
`torch.library.custom_op`'s Python wrapper would re-check aliasing on every call, tens of
microseconds of CPU per op in every compiled step (bench/op_overhead.py); this costs a few.

On torch < 2.14 an op returning `list[Tensor]` carries one trailing empty tensor past its
declared result, which calling it through its `Op` drops (so do its autograd wrappers): there,
inductor's C++ wrapper (`cpp_wrapper`) dereferenced a null tensor for a one-element list
result (pytorch#190551), which e.g. `fused_attn_bwd` gives for packed QKV. Call list ops through
their `Op`, not `torch.ops.te_compile.<name>`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import SimpleNamespace

import torch

NAMESPACE = "te_compile"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
PAD_LIST_RESULTS = torch.__version__ < "2.14"  # see the module docstring


class Op:
    """A registered custom op; call it like the function it was declared from."""

    def __init__(
        self,
        impl: Callable,
        mutates: tuple[str, ...],
        tags: tuple = (),
        pad_lists: bool = PAD_LIST_RESULTS,
    ):
        self.name = impl.__name__
        self.signature = inspect.signature(impl)
        self.params = tuple(self.signature.parameters)
        unknown = set(mutates) - set(self.params)
        if unknown:
            raise ValueError(f"{self.name}: mutates names no argument: {sorted(unknown)}")
        schema = torch.library.infer_schema(impl, mutates_args=mutates)
        _LIB.define(self.name + schema, tags=tags)
        self.pads = pad_lists and schema.endswith("-> Tensor[]")
        self.impl = impl
        self.kernel = (lambda *a, **kw: _padded(impl(*a, **kw))) if self.pads else impl
        _LIB.impl(self.name, self.kernel, "CUDA")
        # The packet, as `torch.ops.te_compile.<name>` (what traced graphs have always named).
        self.packet = getattr(getattr(torch.ops, NAMESPACE), self.name)

    def __call__(self, *args, **kwargs):
        out = self.packet(*args, **kwargs)
        return out[:-1] if self.pads else out

    def args(self, args: tuple, kwargs: dict | None = None) -> SimpleNamespace:
        """The call's arguments by name."""
        if not kwargs and len(args) == len(self.params):  # autograd's inputs: all, in order
            return SimpleNamespace(**dict(zip(self.params, args, strict=True)))
        bound = self.signature.bind(*args, **(kwargs or {}))
        bound.apply_defaults()
        return SimpleNamespace(**bound.arguments)

    def fake(self, fn: Callable[[SimpleNamespace], object]) -> Callable:
        """Register `fn(a)` (arguments by name) as the fake (and meta) kernel."""
        pad = _padded if self.pads else (lambda result: result)
        torch.library.register_fake(
            f"{NAMESPACE}::{self.name}", lambda *args, **kw: pad(fn(self.args(args, kw))), lib=_LIB
        )
        return fn

    def autograd(self, setup_context: Callable, backward: Callable) -> None:
        """`setup_context(ctx, a, output)` gets the arguments by name; `backward(ctx, *grads)`
        returns {argument name: gradient} for the differentiable inputs it computed. Every other
        argument gets None (a list of tensors: a list of None of its length; torch takes any
        other list, of ints or holding a None, as one value whose gradient is None)."""
        params, pads = self.params, self.pads

        def _setup(ctx, inputs, output):
            ctx.list_lengths = [len(v) if _is_tensor_list(v) else -1 for v in inputs]
            setup_context(ctx, self.args(inputs), output[:-1] if pads else output)

        def _backward(ctx, *grads):
            got = backward(ctx, *((grads[0][:-1],) if pads else grads))
            return tuple(
                got[name] if name in got else (None if n < 0 else [None] * n)
                for name, n in zip(params, ctx.list_lengths, strict=True)
            )

        torch.library.register_autograd(
            f"{NAMESPACE}::{self.name}", _backward, setup_context=_setup, lib=_LIB
        )


def _padded(result: list) -> list:
    return [*result, result[0].new_empty(0)]


def _is_tensor_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v)


def op(*, mutates: tuple[str, ...] = (), tags: tuple = ()) -> Callable[[Callable], Op]:
    """Declare `te_compile::<function name>` from the decorated, fully annotated function
    (`tags`: torch.Tag values of its schema, e.g. nondeterministic_seeded)."""
    return lambda impl: Op(impl, mutates, tags)
