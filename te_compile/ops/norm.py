"""TE's normalization kernels (LayerNorm, RMSNorm): Python helpers for every op that
normalizes, and the ops of te.LayerNorm / te.RMSNorm.

    te_compile::norm_fwd(x, weight, bias?, normalization, eps, sm_margin, bwd_sm_margin,
                         zero_centered_gamma) -> (out, mu, rsigma)
    te_compile::norm_bwd(dz, x, mu, rsigma, gamma, normalization, sm_margin,
                         zero_centered_gamma) -> (dx, dgamma, dbeta)

`x` is 2-D [tokens, hidden] and x, weight, bias share one dtype (the module casts, as TE's
ops do); mu and rsigma are float32 [tokens]. RMSNorm has no bias, mean or dbeta: those
slots hold empty tensors ([0]).

Helpers (run inside op kernels only):
- `norm_fwd` / `norm_bwd`: one call of tex.layernorm_fwd / rmsnorm_fwd / *_bwd, with the
  arguments eager TE's `apply_normalization` and `_LayerNormLinear.backward` pass.
- `norm_for_gemm`: the norm in front of a GEMM (LayerNormLinear, LayerNormMLP), quantizing
  its output for the GEMM the way eager TE does: one fused tex call with the GEMM input's
  quantizer where TE fuses (FP8 and the norm output not returned; TE's C++ then picks fully
  fused for delayed scaling, norm + fused amax then quantize for current scaling and NVFP4,
  norm then quantize for block scaling and MXFP8), else the norm in high precision then
  `gemm_layer.quantize`.
"""

from __future__ import annotations

import torch

from ..recipes import QuantConfig
from . import core, gemm_layer, registry

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _check(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    normalization: str,
    eps: float,
    sm_margin: int,
    zero_centered_gamma: bool,
    out_dtype: torch.dtype,
    quantizer=None,
):
    """(out, mu, rsigma) of TE's norm kernel on 2-D `x`. `out` is a `out_dtype` tensor, or the
    TE storage `quantizer` makes (TE's C++ decides how far it fuses); mu is None for RMSNorm."""
    _check(normalization)
    otype = core.te_dtype(out_dtype)
    if normalization == "LayerNorm":
        out, mu, rsigma = core.tex().layernorm_fwd(
            x, weight, bias, eps, None, quantizer, otype, sm_margin, zero_centered_gamma
        )
        return out, mu, rsigma
    out, _, rsigma = core.tex().rmsnorm_fwd(
        x, weight, eps, None, quantizer, otype, sm_margin, zero_centered_gamma
    )
    return out, None, rsigma


def norm_bwd(
    dz: torch.Tensor,
    x: torch.Tensor,
    mu: torch.Tensor | None,
    rsigma: torch.Tensor,
    gamma: torch.Tensor,
    *,
    normalization: str,
    sm_margin: int,
    zero_centered_gamma: bool,
):
    """(dx, dgamma, dbeta) of TE's norm backward kernel; dbeta is None for RMSNorm."""
    _check(normalization)
    if normalization == "LayerNorm":
        dx, dgamma, dbeta = core.tex().layernorm_bwd(
            dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma
        )
        return dx, dgamma, dbeta
    dx, dgamma = core.tex().rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma)
    return dx, dgamma, None


def norm_for_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: QuantConfig,
    *,
    normalization: str,
    eps: float,
    sm_margin: int,
    zero_centered_gamma: bool,
    state,
    columnwise: bool,
    return_hp: bool,
    gemm: int = 0,
):
    """(gemm_input, ln_out, mu, rsigma): the norm of 2-D `x` as the input of GEMM `gemm`.

    Without FP8 both are the high-precision output. With FP8, `gemm_input` is a TE storage
    quantized by the GEMM's input quantizer (row-wise, plus column-wise when `columnwise`),
    DelayedScaling through `state` as in `gemm_layer.bound_quantizer`; `ln_out` is the
    high-precision output when `return_hp` (then TE does not fuse), else None."""
    kwargs = dict(
        normalization=normalization,
        eps=eps,
        sm_margin=sm_margin,
        zero_centered_gamma=zero_centered_gamma,
        out_dtype=x.dtype,
    )
    if not cfg.fp8:
        out, mu, rsigma = norm_fwd(x, weight, bias, **kwargs)
        return out, out, mu, rsigma
    if not return_hp:
        with gemm_layer.bound_quantizer(
            cfg, "input", rowwise=True, columnwise=columnwise, state=state, gemm=gemm
        ) as q:
            out, mu, rsigma = norm_fwd(x, weight, bias, quantizer=q, **kwargs)
        return out, None, mu, rsigma
    out, mu, rsigma = norm_fwd(x, weight, bias, **kwargs)
    quantized = gemm_layer.quantize(out, cfg, "input", True, columnwise, state, gemm=gemm)
    return quantized, out, mu, rsigma


# ---- te.LayerNorm / te.RMSNorm ops ---------------------------------------------------------------


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty([0], dtype=torch.float32)


def _norm_fwd_op(x, weight, bias, normalization, eps, sm_margin, bwd_sm_margin, zcg):
    out, mu, rsigma = norm_fwd(
        x,
        weight,
        bias,
        normalization=normalization,
        eps=eps,
        sm_margin=sm_margin,
        zero_centered_gamma=zcg,
        out_dtype=x.dtype,
    )
    return out, _empty(x) if mu is None else mu, rsigma


def _norm_fwd_fake(x, weight, bias, normalization, eps, sm_margin, bwd_sm_margin, zcg):
    _check(normalization)
    tokens = x.shape[0]
    mu = x.new_empty([tokens if normalization == "LayerNorm" else 0], dtype=torch.float32)
    return torch.empty_like(x), mu, x.new_empty([tokens], dtype=torch.float32)


def _norm_bwd_op(dz, x, mu, rsigma, gamma, normalization, sm_margin, zcg):
    dx, dgamma, dbeta = norm_bwd(
        dz.contiguous(),
        x,
        mu,
        rsigma,
        gamma,
        normalization=normalization,
        sm_margin=sm_margin,
        zero_centered_gamma=zcg,
    )
    return dx, dgamma, gamma.new_empty([0]) if dbeta is None else dbeta


def _norm_bwd_fake(dz, x, mu, rsigma, gamma, normalization, sm_margin, zcg):
    _check(normalization)
    dbeta_shape = list(gamma.shape) if normalization == "LayerNorm" else [0]
    return torch.empty_like(x), torch.empty_like(gamma), gamma.new_empty(dbeta_shape)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, normalization, eps, sm_margin, bwd_sm_margin, zcg = inputs
    _, mu, rsigma = output
    ctx.mark_non_differentiable(mu, rsigma)
    ctx.save_for_backward(x, mu, rsigma, weight)
    ctx.normalization, ctx.bwd_sm_margin, ctx.zcg = normalization, bwd_sm_margin, zcg


def _backward(ctx, grad_out, _grad_mu, _grad_rsigma):
    x, mu, rsigma, weight = ctx.saved_tensors
    dx, dgamma, dbeta = torch.ops.te_compile.norm_bwd(
        grad_out, x, mu, rsigma, weight, ctx.normalization, ctx.bwd_sm_margin, ctx.zcg
    )
    needs = ctx.needs_input_grad
    return (
        dx if needs[0] else None,
        dgamma if needs[1] else None,
        dbeta if needs[2] and ctx.normalization == "LayerNorm" else None,
        None,
        None,
        None,
        None,
        None,
    )


NORM_FWD = registry.define(
    "norm_fwd(Tensor x, Tensor weight, Tensor? bias, str normalization, float eps, "
    "int sm_margin, int bwd_sm_margin, bool zero_centered_gamma) -> (Tensor, Tensor, Tensor)",
    _norm_fwd_op,
    _norm_fwd_fake,
)
registry.register_autograd(NORM_FWD, _backward, _setup_context)
NORM_BWD = registry.define(
    "norm_bwd(Tensor dz, Tensor x, Tensor mu, Tensor rsigma, Tensor gamma, str normalization, "
    "int sm_margin, bool zero_centered_gamma) -> (Tensor, Tensor, Tensor)",
    _norm_bwd_op,
    _norm_bwd_fake,
)
