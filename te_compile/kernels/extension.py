"""The lean core every te_compile op builds on: TE's GEMM and quantizers, called with as little
Python per call as TE's C++ kernels allow.

- `gemm` calls `transformer_engine_torch.generic_gemm` directly with TE's cached cuBLAS
  workspace: the arguments TE's `general_gemm` wrapper would pass for a plain (no userbuffers,
  no debug, no custom-recipe) GEMM, without its per-call dispatch. Per-tensor FP8 GEMMs go
  through aten's `_scaled_mm` instead (aten_gemm.py: the same cuBLASLt GEMM, cheaper to call),
  and block-scaled ones through its `_scaled_mm_v2` with `configure(aten_block_gemm=True)`.
- `with_state`: DelayedScaling quantizers (cached per config, fp8_operands.quantizer) read a
  module's scale/amax tensors only for the duration of a call: two attribute writes.
- `quantize` calls `transformer_engine_torch.quantize` directly (TE's `Quantizer.__call__`
  adds an autograd.Function hop that internal quantizers do not need).

Everything here runs inside real op kernels only, never in fake kernels or at trace time.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .. import options
from .aten_gemm import block_scaled_mm, scaled_mm

_LAYOUTS = {"TN": (True, False), "NN": (False, False), "NT": (False, True)}


@functools.cache
def tex():
    """transformer_engine_torch (TE's C++ extension), imported once."""
    import transformer_engine_torch as tex

    return tex


@functools.cache
def te_dtype(dtype: torch.dtype):
    from transformer_engine.pytorch.constants import TE_DType

    return TE_DType[dtype]


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    from transformer_engine.pytorch.cpp_extensions.gemm import get_cublas_workspace

    # TE's own cached workspace: shared with eager TE GEMMs on the same device.
    return get_cublas_workspace(device_index, False, False)


def gemm(
    a,
    b,
    *,
    layout: str,
    out_dtype: torch.dtype,
    split_accumulator: bool,
    bias: torch.Tensor | None = None,
    grad: bool = False,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    device_index: int,
):
    """TE's GEMM as TE's `general_gemm(a, b, layout=..., ...)` runs it: returns (out, dbias).

    With `grad=True` a bias only flags the dbias fused into the epilogue; the new dbias comes
    back second. `a` and `b` are plain tensors or TE storages (FP8 operands)."""
    if out is None:
        opts = options.current()
        if not grad and opts.aten_fp8_gemm:
            result = scaled_mm(a, b, layout, out_dtype, split_accumulator, bias)
            if result is not None:
                return result, None
        # grad=True without a bias is TE's plain epilogue too: dgrad and wgrad GEMMs qualify.
        if opts.aten_block_gemm and not (grad and bias is not None):
            result = block_scaled_mm(a, b, layout, out_dtype, bias)
            if result is not None:
                return result, None
    transa, transb = _LAYOUTS[layout]
    ws = _workspace(device_index)
    bias_type = te_dtype(torch.bfloat16 if bias is None else bias.dtype)
    result = tex().generic_gemm(
        a,
        transa,
        b,
        transb,
        out,
        None,  # no output quantizer
        te_dtype(out_dtype),
        bias,
        bias_type,
        False,  # gelu
        None,  # gelu input
        grad,
        ws,
        ws.shape[0],
        accumulate,
        split_accumulator,
        alpha=1.0,
        beta=1.0 if accumulate else 0.0,  # as TE's validate_gemm_scale gives it
    )
    return result[0], result[1]


def quantize(tensor: torch.Tensor, quantizer):
    """A TE storage of `tensor` quantized by an internal TE quantizer."""
    return tex().quantize(tensor, quantizer)


def bgrad_quantize(tensor: torch.Tensor, quantizer):
    """(dbias, quantized tensor): TE's dbias fused into the cast where TE fuses it."""
    return tex().bgrad_quantize(tensor, quantizer)


def quantize_into(tensor: torch.Tensor, quantizer, out, noop: torch.Tensor | None = None) -> None:
    """Quantize into an existing TE storage (FP8 weight caches); skipped on the GPU when `noop`
    holds 1 (TE's skip_fp8_weight_update flag)."""
    tex().quantize(tensor, quantizer, out, noop)


@contextlib.contextmanager
def with_state(q, scale: torch.Tensor, amax: torch.Tensor):
    """Within the block, a cached DelayedScaling quantizer reads one module's scale and
    max-accumulates into its amax (1-element tensors). On exit the cached object lets go of
    them: it outlives the op, and a kept reference would keep op-local tensors alive (inside
    CUDA-graph pools, where cudagraph trees check that nothing untracked survives a step)."""
    q.scale, q.amax = scale, amax
    try:
        yield q
    finally:
        q.scale = q.amax = None
