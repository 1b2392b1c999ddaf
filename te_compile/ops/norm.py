"""TE's normalization kernels (LayerNorm, RMSNorm): Python helpers for every op that
normalizes, and the ops of te.LayerNorm / te.RMSNorm.

    norm_fwd -> (out, mu, rsigma)
    norm_bwd -> (dx, dgamma, dbeta)

`norm` is `NormSpec.key` (spec.py). `x` is 2-D [tokens, hidden] and x, weight, bias share one
dtype (the module casts, as TE's ops do); mu and rsigma are float32 [tokens]. RMSNorm has no
bias, mean or dbeta: those slots hold empty tensors ([0]).

Helpers (run inside op kernels only; `spec` is a NormSpec, or any object with its fields):
- `tex_norm_fwd` / `tex_norm_bwd`: one call of tex.layernorm_fwd / rmsnorm_fwd / *_bwd, with
  the arguments eager TE's `apply_normalization` and `_LayerNormLinear.backward` pass.
- `norm_for_gemm`: the norm in front of a GEMM (LayerNormLinear, LayerNormMLP), quantizing
  its output for the GEMM the way eager TE does: one fused tex call with the GEMM input's
  quantizer where TE fuses (FP8 and the norm output not returned; TE's C++ then picks fully
  fused for delayed scaling, norm + fused amax then quantize for current scaling and NVFP4,
  norm then quantize for block scaling and MXFP8), else the norm in high precision then
  `gemm_layer.quantize`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..recipes import QuantConfig
from ..spec import NormSpec
from . import core, gemm_layer
from .registry import op

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _check(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def has_beta(spec) -> bool:
    """LayerNorm has a bias (beta) and a mean; RMSNorm neither."""
    return spec.normalization == "LayerNorm"


def tex_norm_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, spec, *, out_dtype, quantizer=None
):
    """(out, mu, rsigma) of TE's norm kernel on 2-D `x`. `out` is a `out_dtype` tensor, or the
    TE storage `quantizer` makes (TE's C++ decides how far it fuses); mu is None for RMSNorm."""
    _check(spec.normalization)
    otype = core.te_dtype(out_dtype)
    margin, zcg = spec.fwd_sm_margin, spec.zero_centered_gamma
    if has_beta(spec):
        return core.tex().layernorm_fwd(
            x, weight, bias, spec.eps, None, quantizer, otype, margin, zcg
        )
    out, _, rsigma = core.tex().rmsnorm_fwd(
        x, weight, spec.eps, None, quantizer, otype, margin, zcg
    )
    return out, None, rsigma


def tex_norm_bwd(dz: Tensor, x: Tensor, mu: Tensor | None, rsigma: Tensor, gamma: Tensor, spec):
    """(dx, dgamma, dbeta) of TE's norm backward kernel; dbeta is None for RMSNorm."""
    _check(spec.normalization)
    margin, zcg = spec.bwd_sm_margin, spec.zero_centered_gamma
    if has_beta(spec):
        return core.tex().layernorm_bwd(dz, x, mu, rsigma, gamma, margin, zcg)
    dx, dgamma = core.tex().rmsnorm_bwd(dz, x, rsigma, gamma, margin, zcg)
    return dx, dgamma, None


def norm_for_gemm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    cfg: QuantConfig,
    spec,
    *,
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
    if not cfg.fp8:
        out, mu, rsigma = tex_norm_fwd(x, weight, bias, spec, out_dtype=x.dtype)
        return out, out, mu, rsigma
    if not return_hp:
        with gemm_layer.bound_quantizer(
            cfg, "input", rowwise=True, columnwise=columnwise, state=state, gemm=gemm
        ) as q:
            out, mu, rsigma = tex_norm_fwd(x, weight, bias, spec, out_dtype=x.dtype, quantizer=q)
        return out, None, mu, rsigma
    out, mu, rsigma = tex_norm_fwd(x, weight, bias, spec, out_dtype=x.dtype)
    quantized = gemm_layer.quantize(out, cfg, "input", True, columnwise, state, gemm=gemm)
    return quantized, out, mu, rsigma


def stats_shapes(spec, tokens: int) -> tuple[list[int], list[int]]:
    """Shapes of (mu, rsigma), float32: RMSNorm's mu is empty."""
    return [tokens if has_beta(spec) else 0], [tokens]


# ---- te.LayerNorm / te.RMSNorm ops ---------------------------------------------------------------


@op()
def norm_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, norm: str
) -> tuple[Tensor, Tensor, Tensor]:
    spec = NormSpec.from_key(norm)
    out, mu, rsigma = tex_norm_fwd(x, weight, bias, spec, out_dtype=x.dtype)
    if mu is None:
        mu = x.new_empty(stats_shapes(spec, x.shape[0])[0], dtype=torch.float32)
    return out, mu, rsigma


@norm_fwd.fake
def _(a):
    spec = NormSpec.from_key(a.norm)
    _check(spec.normalization)
    mu, rsigma = stats_shapes(spec, a.x.shape[0])
    f32 = torch.float32
    return torch.empty_like(a.x), a.x.new_empty(mu, dtype=f32), a.x.new_empty(rsigma, dtype=f32)


@op()
def norm_bwd(
    dz: Tensor, x: Tensor, mu: Tensor, rsigma: Tensor, gamma: Tensor, norm: str
) -> tuple[Tensor, Tensor, Tensor]:
    spec = NormSpec.from_key(norm)
    dx, dgamma, dbeta = tex_norm_bwd(dz.contiguous(), x, mu, rsigma, gamma, spec)
    return dx, dgamma, gamma.new_empty([0]) if dbeta is None else dbeta


@norm_bwd.fake
def _(a):
    spec = NormSpec.from_key(a.norm)
    _check(spec.normalization)
    dbeta = list(a.gamma.shape) if has_beta(spec) else [0]
    return torch.empty_like(a.x), torch.empty_like(a.gamma), a.gamma.new_empty(dbeta)


def _setup_context(ctx, a, output) -> None:
    _, mu, rsigma = output
    ctx.mark_non_differentiable(mu, rsigma)
    ctx.save_for_backward(a.x, mu, rsigma, a.weight)
    ctx.norm = a.norm


def _backward(ctx, grad_out, _grad_mu, _grad_rsigma):
    x, mu, rsigma, weight = ctx.saved_tensors
    dx, dgamma, dbeta = norm_bwd(grad_out, x, mu, rsigma, weight, ctx.norm)
    needs = ctx.needs_input_grad
    return {
        "x": dx if needs[0] else None,
        "weight": dgamma if needs[1] else None,
        "bias": dbeta if needs[2] and has_beta(NormSpec.from_key(ctx.norm)) else None,
    }


norm_fwd.autograd(_setup_context, _backward)
