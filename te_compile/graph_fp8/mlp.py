"""te.LayerNormMLP's FC1 -> GELU -> FC2 with Float8CurrentScaling as graph operations.

What eager TE runs for this MLP (TE 2.20.2, Hopper, `_LayerNormMLP` with a current-scaling
recipe), and what stands for it here (the norm before it is te_compile::norm_fwd, TE's kernel):

    forward                                          here
    quantize(ln_out)              amax of the bf16   linear.quantize_stored
    fc1_out = GEMM(+ fc1 bias)    cuBLASLt, TN       linear.fprop (aten._scaled_mm)
    tex.gelu(fc1_out, quantizer)  GELU in float32;   gelu() below; amax of its float32 value,
                                  amax of the float  the cast of the value rounded to bf16
                                  value, then the
                                  cast of the bf16
                                  it stored
    GEMM(+ fc2 bias)                                 linear.fprop

    backward
    bgrad_quantize(dy)            at::sum, quantize  linear.bias_grad, quantize_stored
    fc2 dgrad / wgrad GEMMs                          linear.dgrad / wgrad
    tex.dgelu(fc2_dgrad, fc1_out) float32, stored    the same kernel (te_compile::
                                  bf16                activation_grad)
    bgrad_quantize(dact)                             linear.bias_grad, quantize_stored
    fc1 dgrad / wgrad GEMMs                          linear.dgrad / wgrad

`gelu` is TE's formula (common/util/math.h) written operation for operation, with the one
multiply-add nvcc fuses rounded once (quantize.fused_multiply_add), and inductor's libdevice
tanh: on an H100 every one of the 65,536 bfloat16 inputs gave TE's float32 result bit for bit
(tests/gpu/test_graph_fp8_layers_gpu.py, when the fusion was left to inductor; eagerly, 6
differed then). The GELU's gradient is
TE's kernel: the same kind of formula compiled by inductor matched TE's on every input tried
alone, yet a GPT trained on it parted from eager TE at the 4th step (ops/graph_path.py).

With DelayedScaling (a stored scale per tensor, TE's slots: forward FC1 input 0, FC1 weight
1, FC2 input 3, FC2 weight 4; backward FC1 grad_output 0, FC2 grad_output 2), eager TE's kernels
cast float32 values straight to FP8 and record their amax: the norm's (the caller passes it,
graph_fp8/norm.py), the GELU's (`tex.gelu` with a Float8Quantizer) and the GELU gradient's
(`tex.dbias_dgelu`, which also sums FC1's dbias, with or without a bias). Here the first two
are cast from the same float32 values in the graph; the third, and FC2's grad_output with a
bias, come from TE's fused kernels (te_compile::delayed_grad_quantize), whose order of
additions only they have. The backward merges its amaxes into the module's backward history,
as te.Linear's does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.fp8_operands import delayed_slot
from ..recipes import QuantConfig
from . import delayed, linear, quantize

ACTIVATIONS = ("gelu",)
_INPUT, _WEIGHT, _GRAD = 0, 1, 2  # indices into recipes.ROLES
_FC1, _FC2 = 0, 1  # the GEMMs, as TE numbers their DelayedScaling slots


class MLPFP8(NamedTuple):
    """What the graph MLP needs of a LayerNormMLP call, as trace-time constants."""

    cfg: QuantConfig
    out_dtype: torch.dtype


def applies(cfg: QuantConfig, activation: str, x, w1, w2, dtype) -> str:
    """ "" when the graph MLP computes this call, else why not (TE's kernels run then)."""
    if cfg.kind not in ("current", "delayed"):
        return f"recipe kind {cfg.kind!r} (the graph MLP has per-tensor recipes)"
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} (the graph MLP has TE's tanh GELU)"
    return linear.applies(cfg, x, w1, dtype) or linear.applies(cfg, x, w2, dtype)


def gelu(v: torch.Tensor) -> torch.Tensor:
    """TE's tanh GELU of float32 `v`, `v * (0.5 + 0.5 * tanhf(v * (0.79788456 + 0.03567741 * v *
    v)))`, as nvcc compiles it for sm_90 (its SASS, session 29): `0.03567741 * v` rounded, then
    one FMA with `v` and 0.79788456 (0.7978845834732056 as a float32); `0.5 + 0.5 * t` is an
    FMA too, but `0.5 * t` is exact, so rounding it apart changes nothing."""
    inner = quantize.fused_multiply_add(v, 0.03567741 * v, 0.7978845834732056)
    return v * (0.5 + 0.5 * torch.tanh(v * inner))


def _quantized_gelu(fc1_out: torch.Tensor, cfg: QuantConfig):
    """tex.gelu with a current-scaling quantizer: the amax of the float32 GELU, the cast of
    the bfloat16 value TE's kernel stores."""
    act = gelu(fc1_out.float())
    fp8 = cfg.dtypes[_INPUT]
    scale = quantize.scale_from_amax(
        quantize.amax(act), fp8, cfg.amax_eps[_INPUT], cfg.pow2[_INPUT]
    )
    return quantize.cast(quantize.stored_bf16(act), scale, fp8), quantize.reciprocal(scale)


def _quantized_gelu_delayed(fc1_out: torch.Tensor, scales: delayed.Scales, cfg: QuantConfig):
    """tex.gelu with a DelayedScaling quantizer: the float32 GELU cast with FC2's input scale,
    its amax's row maxima recorded."""
    return delayed.quantize_delayed(
        gelu(fc1_out.float()), scales, cfg, _INPUT, False, _FC2, rows=True
    )


class _MLPFunction(torch.autograd.Function):
    """DelayedScaling passes `fwd_scale` (a snapshot of TE's forward scales), `bwd_scale` and
    `bwd_history` (TE's backward state: backward merges its amaxes into row 0) and `x_value` (the
    norm's float32 value, cast in place of `x`); the forward then also returns the amaxes of the
    forward slots for the caller's history merge (an empty tensor otherwise)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, fwd_scale, bwd_scale, bwd_history, call: MLPFP8, x_value):
        cfg, dtype, acc = call.cfg, call.out_dtype, call.cfg.split_acc
        needs = ctx.needs_input_grad
        if fwd_scale is None:
            x_amax, w1_amax, w2_amax = quantize.amaxes(x, w1, w2)
            xq, x_si = linear.quantize_stored(x, cfg, _INPUT, amax=x_amax)
            w1q, w1_si = linear.quantize_weight(w1, cfg, amax=w1_amax)
            fc1_out, w1q = linear.fprop_and_weight_copy(
                xq, x_si, w1q, w1_si, dtype, acc[0], b1, needs[0]
            )
            aq, a_si = _quantized_gelu(fc1_out, cfg)
            w2q, w2_si = linear.quantize_weight(w2, cfg, amax=w2_amax)
            amaxes = x.new_zeros(0, dtype=torch.float32)
        else:
            value, stored = (x, True) if x_value is None else (x_value, False)
            scales = delayed.Scales.of(fwd_scale)
            xq, x_si, x_rows = delayed.quantize_delayed(
                value, scales, cfg, _INPUT, stored, rows=True
            )
            w1q, w1_si, w1_rows = linear.quantize_weight(w1, cfg, scales, rows=True)
            fc1_out, w1q = linear.fprop_and_weight_copy(
                xq, x_si, w1q, w1_si, dtype, acc[0], b1, needs[0]
            )
            aq, a_si, a_rows = _quantized_gelu_delayed(fc1_out, scales, cfg)
            w2q, w2_si, w2_rows = linear.quantize_weight(w2, cfg, scales, _FC2, rows=True)
            x_amax, w1_amax, a_amax, w2_amax = quantize.maxima(x_rows, w1_rows, a_rows, w2_rows)
            slots = {  # (the GEMM output slots record nothing)
                delayed_slot("input", _FC1): x_amax,
                delayed_slot("weight", _FC1): w1_amax,
                delayed_slot("input", _FC2): a_amax,
                delayed_slot("weight", _FC2): w2_amax,
            }
            amaxes = delayed.in_slots(fwd_scale, slots)
        # FC2's dgrad runs whenever FC1's inputs need a gradient
        fc1_grads = needs[0] or needs[1] or needs[2]
        y, w2q = linear.fprop_and_weight_copy(aq, a_si, w2q, w2_si, dtype, acc[0], b2, fc1_grads)
        ctx.save_for_backward(xq, x_si, w1q, w1_si, fc1_out, aq, a_si, w2q, w2_si)
        ctx.call, ctx.biases = call, (b1 is not None, b2 is not None)
        # Backward mutates the DelayedScaling state: it rides on ctx, not in saved tensors.
        ctx.bwd_state = (bwd_scale, bwd_history)
        ctx.mark_non_differentiable(amaxes)
        return y, amaxes

    @staticmethod
    def backward(ctx, dy, _amaxes):
        xq, x_si, w1q, w1_si, fc1_out, aq, a_si, w2q, w2_si = ctx.saved_tensors
        cfg, dtype, acc = ctx.call.cfg, ctx.call.out_dtype, ctx.call.cfg.split_acc
        needs = ctx.needs_input_grad
        bwd_scale, bwd_history = ctx.bwd_state
        if bwd_scale is None:
            db2 = linear.bias_grad(dy) if ctx.biases[1] and needs[4] else None
            gq, g_si = linear.quantize_stored(dy, cfg, _GRAD)
            gq_t = None
        else:
            scale = delayed.scale_for_te_cast(cfg, bwd_scale, dy)
            if ctx.biases[1]:
                db2, gq, gq_t, g_si, g2_amax = delayed.delayed_grad_with_bias(
                    dy, bwd_scale, cfg, _FC2, te_scale=scale
                )
            else:
                db2, gq_t = None, None
                gq, g_si, g2_amax = delayed.quantize_grad(dy, bwd_scale, cfg, _FC2)
        fc2_dgrad, gq_t = linear.dgrad_and_grad_copy(
            gq, g_si, w2q, w2_si, dtype, acc[1], needs[3], gq_t
        )
        dw2 = linear.wgrad(gq, g_si, aq, a_si, dtype, acc[2], gq_t) if needs[3] else None
        g1q_t = None
        if bwd_scale is None:
            dact = torch.ops.te_compile.activation_grad(fc2_dgrad, fc1_out, "gelu")
            db1 = linear.bias_grad(dact) if ctx.biases[0] and needs[2] else None
            g1q, g1_si = linear.quantize_stored(dact, cfg, _GRAD)
        else:  # eager TE calls tex.dbias_dgelu with or without FC1's bias
            db1, g1q, g1q_t, g1_si, g1_amax = delayed.delayed_grad_with_dbias(
                fc2_dgrad, scale, cfg, _FC1, act_input=fc1_out, act="gelu"
            )
        dx = None
        if needs[0]:
            dx, g1q_t = linear.dgrad_and_grad_copy(
                g1q, g1_si, w1q, w1_si, dtype, acc[1], needs[1], g1q_t
            )
        dw1 = linear.wgrad(g1q, g1_si, xq, x_si, dtype, acc[2], g1q_t) if needs[1] else None
        if bwd_scale is not None:
            delayed.update_backward_state(cfg, bwd_scale, bwd_history, [g1_amax, g2_amax])
        db1 = db1 if needs[2] else None
        db2 = db2 if needs[4] else None
        return dx, dw1, db1, dw2, db2, None, None, None, None, None


def mlp(x, w1, b1, w2, b2, call: MLPFP8, delayed_state=None, x_value=None):
    """(FC2(GELU(FC1(x))) of 2-D `x` with FP8 GEMMs as eager TE computes it, amaxes): see the
    module docstring. `delayed_state` = (forward scale snapshot, backward scale, backward
    history) with DelayedScaling, else None; `x_value` as graph_fp8.linear.linear's."""
    fwd_scale, bwd_scale, bwd_history = delayed_state or (None, None, None)
    return _MLPFunction.apply(x, w1, b1, w2, b2, fwd_scale, bwd_scale, bwd_history, call, x_value)
