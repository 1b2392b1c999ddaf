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
    tex.dgelu(fc2_dgrad, fc1_out) float32, stored    dgelu() below, times the gradient,
                                  bf16                rounded to bf16
    bgrad_quantize(dact)                             linear.bias_grad, quantize_stored
    fc1 dgrad / wgrad GEMMs                          linear.dgrad / wgrad

`gelu` and `dgelu` are TE's formulas (common/util/math.h) written operation for operation.
Inductor compiles them to the float32 code nvcc makes of TE's (the same libdevice tanh, the
same multiply-adds fused): on an H100 every one of the 65,536 bfloat16 inputs gives TE's
float32 result bit for bit (tests/gpu/test_graph_fp8_gpu.py). Eagerly, without fused
multiply-adds, a few hundred differ: this path is for compiled graphs only.

DelayedScaling is left to TE's kernels: its norm and activation kernels cast their float32
results straight to FP8, which a graph reading their bf16 outputs cannot reproduce.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..recipes import QuantConfig
from . import linear, quantize

ACTIVATIONS = ("gelu",)
_INPUT, _WEIGHT, _GRAD = 0, 1, 2  # indices into recipes.ROLES


class MLPFP8(NamedTuple):
    """What the graph MLP needs of a LayerNormMLP call, as trace-time constants."""

    cfg: QuantConfig
    out_dtype: torch.dtype


def applies(cfg: QuantConfig, activation: str, x, w1, w2, dtype) -> str:
    """ "" when the graph MLP computes this call, else why not (TE's kernels run then)."""
    if cfg.kind != "current":
        return f"recipe kind {cfg.kind!r} (the graph MLP has Float8CurrentScaling)"
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} (the graph MLP has TE's tanh GELU)"
    return linear.applies(cfg, x, w1, dtype) or linear.applies(cfg, x, w2, dtype)


def gelu(v: torch.Tensor) -> torch.Tensor:
    """TE's tanh GELU of float32 `v`."""
    return v * (0.5 + 0.5 * torch.tanh(v * (0.79788456 + 0.03567741 * v * v)))


def dgelu(v: torch.Tensor) -> torch.Tensor:
    """TE's derivative of its tanh GELU at float32 `v`."""
    t = torch.tanh(0.79788456 * v * (1.0 + 0.044715 * v * v))
    return 0.5 * v * ((1.0 - t * t) * (0.79788456 + 0.1070322243 * v * v)) + 0.5 * (1.0 + t)


def _quantized_gelu(fc1_out: torch.Tensor, cfg: QuantConfig):
    """tex.gelu with a current-scaling quantizer: the amax of the float32 GELU, the cast of
    the bfloat16 value TE's kernel stores."""
    act = gelu(fc1_out.float())
    fp8 = cfg.dtypes[_INPUT]
    scale = quantize.scale_from_amax(
        quantize.amax(act), fp8, cfg.amax_eps[_INPUT], cfg.pow2[_INPUT]
    )
    return quantize.cast(quantize.stored_bf16(act), scale, fp8), quantize.reciprocal(scale)


class _MLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, call: MLPFP8):
        cfg, dtype, acc = call.cfg, call.out_dtype, call.cfg.split_acc
        xq, x_si = linear.quantize_stored(x, cfg, _INPUT)
        w1q, w1_si = linear.quantize_stored(w1, cfg, _WEIGHT)
        fc1_out = linear.fprop(xq, x_si, w1q, w1_si, dtype, acc[0], b1)
        aq, a_si = _quantized_gelu(fc1_out, cfg)
        w2q, w2_si = linear.quantize_stored(w2, cfg, _WEIGHT)
        y = linear.fprop(aq, a_si, w2q, w2_si, dtype, acc[0], b2)
        ctx.save_for_backward(xq, x_si, w1q, w1_si, fc1_out, aq, a_si, w2q, w2_si)
        ctx.call, ctx.biases = call, (b1 is not None, b2 is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        xq, x_si, w1q, w1_si, fc1_out, aq, a_si, w2q, w2_si = ctx.saved_tensors
        cfg, dtype, acc = ctx.call.cfg, ctx.call.out_dtype, ctx.call.cfg.split_acc
        needs = ctx.needs_input_grad
        db2 = linear.bias_grad(dy) if ctx.biases[1] and needs[4] else None
        gq, g_si = linear.quantize_stored(dy, cfg, _GRAD)
        dw2 = linear.wgrad(gq, g_si, aq, a_si, dtype, acc[2]) if needs[3] else None
        fc2_dgrad = linear.dgrad(gq, g_si, w2q, w2_si, dtype, acc[1])
        dact = (dgelu(fc1_out.float()) * fc2_dgrad.float()).to(dtype)
        db1 = linear.bias_grad(dact) if ctx.biases[0] and needs[2] else None
        g1q, g1_si = linear.quantize_stored(dact, cfg, _GRAD)
        dw1 = linear.wgrad(g1q, g1_si, xq, x_si, dtype, acc[2]) if needs[1] else None
        dx = linear.dgrad(g1q, g1_si, w1q, w1_si, dtype, acc[1]) if needs[0] else None
        return dx, dw1, db1, dw2, db2, None


def mlp(x, w1, b1, w2, b2, call: MLPFP8) -> torch.Tensor:
    """FC2(GELU(FC1(x))) of 2-D `x` with FP8 GEMMs, as eager TE computes it (module docstring)."""
    return _MLPFunction.apply(x, w1, b1, w2, b2, call)
