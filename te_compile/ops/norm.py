"""The ops of te.LayerNorm / te.RMSNorm, on TE's norm kernels (kernels/norm.py).

    norm_fwd -> (out, mu, rsigma)
    norm_bwd -> (dx, dgamma, dbeta)

`norm` is `NormSpec.key` (spec.py). `x` is 2-D [tokens, hidden] and x, weight, bias share one
dtype (the module casts, as TE's ops do); mu and rsigma are float32 [tokens]. RMSNorm has no
bias, mean or dbeta: those slots hold empty tensors ([0]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.norm import check_normalization, has_beta, stats_shapes, tex_norm_bwd, tex_norm_fwd
from ..spec import NormSpec
from .registry import op

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
    check_normalization(spec.normalization)
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
    check_normalization(spec.normalization)
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
