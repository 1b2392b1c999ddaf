"""Op registration through `torch.library.Library` (define + impl), with fake kernels and
autograd formulas from `torch.library.register_fake` / `register_autograd`.

Why not `torch.library.custom_op`: its Python wrapper (schema inference, a Python backend
kernel that re-checks output aliasing on every call) costs tens of microseconds per call on the
hot path of every compiled step (bench/op_overhead.py); a schema written out and a Python
kernel registered for CUDA costs a few. The schema also documents the op: types, and `(a!)`
on every tensor the op mutates in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "te_compile"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define(schema: str, impl: Callable, fake: Callable):
    """Register `NAMESPACE::<schema>` with `impl` as its CUDA kernel and `fake` as its fake
    (and meta) kernel; returns the op's overload packet (`torch.ops.te_compile.<name>`)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name)


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    torch.library.register_autograd(op.default, backward, setup_context=setup_context, lib=_LIB)
