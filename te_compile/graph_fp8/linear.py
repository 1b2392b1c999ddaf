"""te.Linear's FP8 forward and backward as graph operations (Float8CurrentScaling and
DelayedScaling).

The same three GEMMs eager TE runs on Hopper, each a cuBLASLt FP8 GEMM in TN layout with
per-tensor scale_inv pointers (aten's `_scaled_mm`, which hands cuBLASLt the problem TE hands
it: m = rows of the result's transpose, A transposed):

    fprop  y  = x  @ W.T   A = W   [N, K],      B = x   [M, K]   fast accumulation unless acc[0]
    dgrad  dx = dy @ W     A = W.T [K, N] copy, B = dy  [M, N]   unless acc[1]
    wgrad  dW = dy.T @ x   A = x.T [K, M] copy, B = dy.T [N, M]  unless acc[2]

The transposed copies are TE's column-wise data: transposes of the same FP8 bytes. Quantization
is quantize.py's, traced, so inductor fuses each amax and cast into its neighbours. dbias is
ATen's row sum (te_compile::bias_grad), as eager TE's bgrad_quantize computes it for current
scaling; with DelayedScaling eager TE fuses dbias into grad_output's cast, whose order of
additions only its kernel has: that cast runs on TE's kernel (te_compile::delayed_grad_quantize),
or with the `graph_dbias` option in the graph, the sum in that kernel's order (te_dbias.py).
DelayedScaling's scales, casts and backward state: delayed.py.

The GEMM is called as `torch.ops.aten._scaled_mm`, the operator torchao's float8 training and
inductor's scaled-GEMM lowering use: the public `F.scaled_mm` wraps `torch._scaled_mm_v2`,
which dynamo on torch 2.11 refuses to trace ("marked as skipped").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import options
from ..kernels.fp8_operands import delayed_slot
from ..recipes import ROLES, QuantConfig
from . import quantize
from .delayed import (
    Scales,
    delayed_grad_with_bias,
    in_slots,
    quantize_delayed,
    quantize_grad,
    update_backward_state,
)

# aten's scaled GEMM's constraint on every dimension of an FP8 GEMM (cuBLASLt's 16-byte alignment).
_ALIGN = 16


class LinearFP8(NamedTuple):
    """What the graph path needs of a te.Linear call, as trace-time constants."""

    cfg: QuantConfig
    out_dtype: torch.dtype


# graph_fp8=None takes the graph path for GEMMs of at most this many multiply-adds: about 0.1 ms
# of FP8 work on an H100, the CPU time TE's path spends issuing one GEMM's kernels (three to four
# calls into TE's extension at 25-125 us each, docs/perf/history.md). Below it the step waits on
# the CPU and the graph path, which makes none of those calls, is faster (1.44-1.51x at
# 4 TransformerLayers of H=1024 and 2048); above it the GPU bounds the step and TE's fused
# kernels are faster (TE's guide layer, 2^40 per FC1: 5-7%).
AUTO_MAX_MACS = 1 << 36
# ... for these recipes, where the graph path is bit-identical to eager TE (docs/graph_fp8.md).
AUTO_KINDS = ("current", "delayed")


def _rows(inp: torch.Tensor):
    """The GEMM's row count: every dimension of `inp` but the last."""
    return inp.numel() // inp.shape[-1] if inp.shape[-1] else 0


def wanted(cfg: QuantConfig, inp: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `te_compile.configure(graph_fp8=...)` asks for the graph path for GEMMs of input
    `inp` and these weights (see AUTO_MAX_MACS; `applies` then says whether it can)."""
    setting = options.current().graph_fp8
    if setting is not None:
        return setting
    rows = _rows(inp)
    return cfg.kind in AUTO_KINDS and all(
        rows * w.shape[0] * w.shape[1] <= AUTO_MAX_MACS for w in weights
    )


def applies(cfg: QuantConfig, inp: torch.Tensor, weight: torch.Tensor, dtype) -> str:
    """ "" when the graph path computes this GEMM, else why not (the TE-op path runs then)."""
    if cfg.kind not in ("current", "delayed"):
        return f"recipe kind {cfg.kind!r} (the graph path has per-tensor recipes)"
    if cfg.amax_group and not cfg.defers_backward_update:
        # each backward op would reduce its amaxes over the group (a collective AOT autograd's
        # backward graph cannot hold); deferred, the eager autocast exit reduces them
        return (
            "DelayedScaling's amax reduction over ranks, with te.autocast inside the compiled code"
        )
    if not dtype == inp.dtype == weight.dtype == torch.bfloat16:
        return "input, weight and activation dtypes not all bfloat16"
    dims = (_rows(inp), *weight.shape)
    # (a dynamic dimension is tested too: dynamo guards on the answer; the reason names no
    # dimension, which may be symbolic: dynamo cannot test a string formatted from one)
    if not all(d % _ALIGN == 0 and d > 0 for d in dims):
        return f"GEMM dimensions not all positive multiples of {_ALIGN}"
    return ""


def quantize_stored(t: torch.Tensor, cfg: QuantConfig, role: int, stored=True, amax=None):
    """Float8CurrentScaling's (FP8 data, scale_inv) of the bfloat16 tensor `t` as stored, with the
    quantizer of `role` (an index into ROLES); `stored` as quantize_delayed's; `amax`: t's, if
    already taken (quantize.amaxes)."""
    return quantize.quantize_current(
        t, cfg.dtypes[role], cfg.amax_eps[role], cfg.pow2[role], stored, amax
    )


def quantize_weight(
    w: torch.Tensor, cfg: QuantConfig, scales: Scales | None = None, gemm=0, amax=None, rows=False
):
    """A GEMM weight's (FP8 data, scale_inv), and its amax with DelayedScaling `scales` (`amax`,
    `rows`: as quantize_stored's and quantize_delayed's). Its values are loads of a bfloat16
    parameter (or a concatenation of them), so the re-rounding of a fused producer's value is
    the identity here; without it inductor's passes over the weight do no integer work (H200,
    [8192, 2048]: 28 against 38 us for current scaling's amax and cast)."""
    role = ROLES.index("weight")
    if scales is None:
        return quantize_stored(w, cfg, role, stored=False, amax=amax)
    return quantize_delayed(w, scales, cfg, role, stored=False, gemm=gemm, rows=rows)


# Transposed copies of at least this many elements go through TE's transpose kernel: at TE's
# guide layer (H100) inductor's transposing stores cost 0.47 ms of a 24.6 ms step more than
# TE's kernel (docs/graph_fp8.md); below it one more call into TE costs more CPU than it saves.
TE_TRANSPOSE_MIN_ELEMENTS = 1 << 24


def _te_transposes(t: torch.Tensor) -> bool:
    # A dynamic size takes inductor's transpose (the same bits) unless its bounds decide: a
    # guard here, with `wanted`'s on AUTO_MAX_MACS, pinned 4096 rows of a GEMM 4096 wide
    # (2^24 elements, 2^36 multiply-adds) to that one size (session 44)
    return quantize.holds_for_every_size(t.numel() >= TE_TRANSPOSE_MIN_ELEMENTS)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """2-D FP8 `t` transposed, contiguous (TE's column-wise data)."""
    if _te_transposes(t):
        return torch.ops.te_compile.fp8_transpose(t)
    return t.t().contiguous()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """`t` with the same values, stored transposed (TE's column-wise copy); `t` itself if it
    already is (a copy fprop_and_weight_copy made)."""
    if t.stride() == (1, t.shape[0]):
        return t
    return _transposed(t).t()


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


# The three GEMMs of one FP8 linear layer (see the module docstring), on (data, scale_inv) pairs
# of 2-D tensors; `acc` is the layer's split-accumulator flag for that GEMM.
def fprop(xq, x_si, wq, w_si, out_dtype, acc: bool, bias=None):
    """y = x @ w.T (+ bias in the GEMM's epilogue)."""
    return _gemm(xq, x_si, wq.t(), w_si, out_dtype, acc, bias)


# Where TE's transpose kernel makes a transposed copy of an FP8 tensor the graph has just cast,
# the GEMM reading that tensor and the copy are one op (te_compile::scaled_mm_transposing): as
# two consumers that each ask inductor for exact strides, they made it store the cast's bytes
# twice (3 x 16 MiB per TransformerLayer step at H=2048: FC1's and FC2's weights, FC1's
# grad_output). The GEMM is the same `_scaled_mm` call.
def fprop_and_weight_copy(xq, x_si, wq, w_si, out_dtype, acc: bool, bias=None, dgrad=True):
    """(fprop's y, the weight as dgrad reads it): TE's transposed copy of a large weight (a
    column-major view of it) made beside the GEMM when `dgrad` will run, else `wq` (dgrad
    transposes it then). The input's copy for wgrad stays apart: made by this op it failed to
    trace on torch 2.11 once the row count was dynamic (an AssertionError in dynamo's
    higher-order-op output handling; 2.14 traces it), and an input's cast has rarely been
    cheap enough for inductor to store it twice (DelayedScaling's FC2 input is)."""
    if not (dgrad and _te_transposes(wq)):
        return fprop(xq, x_si, wq, w_si, out_dtype, acc, bias), wq
    y, wq_t = torch.ops.te_compile.scaled_mm_transposing(
        xq, x_si, wq, w_si, bias, out_dtype, not acc, True
    )
    return y, wq_t.t()


def dgrad(gq, g_si, wq, w_si, out_dtype, acc: bool):
    """dx = dy @ w, reading w's transposed copy."""
    return _gemm(gq, g_si, _column_major(wq), w_si, out_dtype, acc)


def dgrad_and_grad_copy(gq, g_si, wq, w_si, out_dtype, acc: bool, wgrad: bool, gq_t=None):
    """(dgrad's dx, grad_output's transposed copy for wgrad): `gq_t` if already made (TE's
    fused dbias kernel's), else made beside the GEMM where TE's transpose kernel makes it and
    `wgrad` will run, else None (wgrad transposes then)."""
    if gq_t is not None or not (wgrad and _te_transposes(gq)):
        return dgrad(gq, g_si, wq, w_si, out_dtype, acc), gq_t
    dx, gq_t = torch.ops.te_compile.scaled_mm_transposing(
        gq, g_si, _column_major(wq).t(), w_si, None, out_dtype, not acc, False
    )
    return dx, gq_t


def wgrad(gq, g_si, xq, x_si, out_dtype, acc: bool, gq_t=None):
    """dw = dy.T @ x, reading the transposed copies of both (`gq_t`: dy's, if already made)."""
    gq_t = _transposed(gq) if gq_t is None else gq_t
    return _gemm(gq_t, g_si, _column_major(xq), x_si, out_dtype, acc)


def bias_grad(dy2d: torch.Tensor) -> torch.Tensor:
    """dbias as eager TE sums it (ATen's row sum, outside inductor: ops/bias_grad.py)."""
    return torch.ops.te_compile.bias_grad(dy2d)


class _LinearFunction(torch.autograd.Function):
    """DelayedScaling passes its tensors (`fwd_scale` a snapshot of TE's forward scales,
    `bwd_scale` and `bwd_history` TE's backward state): forward quantizes with the snapshot
    and returns the input's and weight's amaxes for the caller's history merge; backward
    quantizes grad_output with the backward scale and merges its amax into the module's
    backward history (`update_backward_state`), as the TE-kernel path does.
    Per-tensor current scaling passes None for all three and gets an empty amax tensor."""

    @staticmethod
    def forward(ctx, x, weight, bias, fwd_scale, bwd_scale, bwd_history, call: LinearFP8, value):
        cfg = call.cfg
        x2d = x.reshape(-1, x.shape[-1])
        if fwd_scale is None:
            x_amax, w_amax = quantize.amaxes(x2d, weight)
            xq, x_si = quantize_stored(x2d, cfg, 0, amax=x_amax)
            wq, w_si = quantize_weight(weight, cfg, amax=w_amax)
            amaxes = x.new_zeros(0, dtype=torch.float32)
        else:
            scales = Scales.of(fwd_scale)
            if value is None:
                xq, x_si, x_rows = quantize_delayed(x2d, scales, cfg, 0, rows=True)
            else:  # a fused producer's float32 value (graph_fp8/norm.py), cast as TE casts it
                xq, x_si, x_rows = quantize_delayed(value, scales, cfg, 0, False, rows=True)
            wq, w_si, w_rows = quantize_weight(weight, cfg, scales, rows=True)
            x_amax, w_amax = quantize.maxima(x_rows, w_rows)
            slots = {delayed_slot("input"): x_amax, delayed_slot("weight"): w_amax}
            amaxes = in_slots(fwd_scale, slots)  # the output slot: none
        dgrad_runs = ctx.needs_input_grad[0]
        y, wq = fprop_and_weight_copy(
            xq, x_si, wq, w_si, call.out_dtype, cfg.split_acc[0], bias, dgrad_runs
        )
        ctx.save_for_backward(xq, x_si, wq, w_si)
        # Backward mutates the DelayedScaling state: it rides on ctx, not in saved tensors
        # (whose version check would refuse the mutation).
        ctx.bwd_state = (bwd_scale, bwd_history)
        ctx.call, ctx.x_shape, ctx.has_bias = call, x.shape, bias is not None
        ctx.mark_non_differentiable(amaxes)
        return y.reshape(*x.shape[:-1], weight.shape[0]), amaxes

    @staticmethod
    def backward(ctx, dy, _amaxes):
        xq, x_si, wq, w_si = ctx.saved_tensors
        cfg, out_dtype = ctx.call.cfg, ctx.call.out_dtype
        bwd_scale, bwd_history = ctx.bwd_state
        dy2d = dy.reshape(-1, dy.shape[-1])
        gq_t = fused_dbias = None
        if bwd_scale is None:
            gq, g_si = quantize_stored(dy2d, cfg, 2)
        else:
            if ctx.has_bias:  # TE's fused dbias + cast (see the module docstring)
                fused_dbias, gq, gq_t, g_si, g_amax = delayed_grad_with_bias(dy2d, bwd_scale, cfg)
            else:
                gq, g_si, g_amax = quantize_grad(dy2d, bwd_scale, cfg)
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            dx, gq_t = dgrad_and_grad_copy(
                gq, g_si, wq, w_si, out_dtype, cfg.split_acc[1], ctx.needs_input_grad[1], gq_t
            )
            dx = dx.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = wgrad(gq, g_si, xq, x_si, out_dtype, cfg.split_acc[2], gq_t)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = bias_grad(dy2d) if fused_dbias is None else fused_dbias
        if bwd_scale is not None:
            update_backward_state(cfg, bwd_scale, bwd_history, [g_amax])
        return dx, dw, dbias, None, None, None, None, None


def linear(x, weight, bias, call: LinearFP8, delayed_state=None, x_value=None):
    """(y = x @ weight.T + bias with FP8 operands, amaxes): see the module docstring.
    `delayed_state` = (forward scale snapshot, backward scale, backward history) with
    DelayedScaling, else None. `x_value` (DelayedScaling only): the float32 value to quantize
    in place of `x`'s, where TE's fused producer casts it unrounded (graph_fp8/norm.py)."""
    fwd_scale, bwd_scale, bwd_history = delayed_state or (None, None, None)
    return _LinearFunction.apply(x, weight, bias, fwd_scale, bwd_scale, bwd_history, call, x_value)
