"""te.Linear's FP8 forward and backward as graph operations (Float8CurrentScaling).

The same three GEMMs eager TE runs on Hopper, each a cuBLASLt FP8 GEMM in TN layout with
per-tensor scale_inv pointers (aten's `_scaled_mm`, which hands cuBLASLt the problem TE hands
it: m = rows of the result's transpose, A transposed):

    fprop  y  = x  @ W.T   A = W   [N, K],      B = x   [M, K]   fast accumulation unless acc[0]
    dgrad  dx = dy @ W     A = W.T [K, N] copy, B = dy  [M, N]   unless acc[1]
    wgrad  dW = dy.T @ x   A = x.T [K, M] copy, B = dy.T [N, M]  unless acc[2]

The transposed copies are TE's column-wise data: transposes of the same FP8 bytes. Quantization
is quantize.py's, traced, so inductor fuses each amax and cast into its neighbours. dbias is a
sum over rows of grad_output in the graph (eager TE's bgrad_quantize reduces in its own order).

The GEMM is called as `torch.ops.aten._scaled_mm`, the operator torchao's float8 training and
inductor's scaled-GEMM lowering use: the public `F.scaled_mm` wraps `torch._scaled_mm_v2`,
which dynamo on torch 2.11 refuses to trace ("marked as skipped").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..recipes import QuantConfig
from . import quantize

# aten's scaled GEMM's constraint on every dimension of an FP8 GEMM (cuBLASLt's 16-byte alignment).
_ALIGN = 16


class LinearFP8(NamedTuple):
    """What the graph path needs of a te.Linear call, as trace-time constants."""

    cfg: QuantConfig
    out_dtype: torch.dtype


def applies(cfg: QuantConfig, inp: torch.Tensor, weight: torch.Tensor, dtype) -> str:
    """ "" when the graph path computes this GEMM, else why not (the TE-op path runs then)."""
    if cfg.kind != "current":
        return f"recipe kind {cfg.kind!r} (the graph path has Float8CurrentScaling)"
    if dtype not in (torch.bfloat16, torch.float16) or inp.dtype != dtype or weight.dtype != dtype:
        return "input, weight and activation dtypes not one 16-bit dtype"
    rows = inp.numel() // inp.shape[-1] if inp.shape[-1] else 0
    dims = (rows, *weight.shape)
    if not all(isinstance(d, int) and d % _ALIGN == 0 and d > 0 for d in dims):
        return f"GEMM dimensions {dims} not static multiples of {_ALIGN}"
    return ""


def _quantize(t: torch.Tensor, cfg: QuantConfig, role: int):
    return quantize.quantize_current(t, cfg.dtypes[role], cfg.amax_eps[role], cfg.pow2[role])


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """`t` with the same values, stored transposed (TE's column-wise copy)."""
    return t.t().contiguous().t()


def _gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, split_accumulator, bias=None):
    return torch.ops.aten._scaled_mm(
        a,
        b,
        a_scale_inv,
        b_scale_inv,
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=not split_accumulator,
    )


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: LinearFP8):
        cfg = call.cfg
        x2d = x.reshape(-1, x.shape[-1])
        xq, x_si = _quantize(x2d, cfg, 0)
        wq, w_si = _quantize(weight, cfg, 1)
        y = _gemm(xq, x_si, wq.t(), w_si, call.out_dtype, cfg.split_acc[0], bias)
        ctx.save_for_backward(xq, x_si, wq, w_si)
        ctx.call, ctx.x_shape, ctx.has_bias = call, x.shape, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xq, x_si, wq, w_si = ctx.saved_tensors
        cfg, out_dtype = ctx.call.cfg, ctx.call.out_dtype
        dy2d = dy.reshape(-1, dy.shape[-1])
        gq, g_si = _quantize(dy2d, cfg, 2)
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            dx = _gemm(gq, g_si, _column_major(wq), w_si, out_dtype, cfg.split_acc[1])
            dx = dx.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = _gemm(
                gq.t().contiguous(), g_si, _column_major(xq), x_si, out_dtype, cfg.split_acc[2]
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = dy2d.sum(dim=0)
        return dx, dw, dbias, None


def linear(x, weight, bias, call: LinearFP8) -> torch.Tensor:
    """y = x @ weight.T + bias with FP8 operands (see the module docstring)."""
    return _LinearFunction.apply(x, weight, bias, call)
