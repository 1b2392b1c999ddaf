"""Arguments for the te_compile::norm_* and te_compile::layernorm_linear_* ops, by name (call
them as `op(**args)`), shared by the CPU (fake) and GPU opchecks."""

from __future__ import annotations

import linear_cases
import torch

from te_compile.ops.layernorm_linear import layernorm_linear_fwd
from te_compile.ops.linear import linear_fwd
from te_compile.recipes import QuantConfig
from te_compile.spec import GemmGrads, NormSpec

TOKENS, IN, OUT = 64, 128, 256


def norm_fwd_args(normalization: str, dtype=torch.bfloat16, zero_centered_gamma=False) -> dict:
    torch.manual_seed(0)
    x = torch.randn(TOKENS, IN, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.rand(IN, device="cuda", dtype=dtype) + 0.5).requires_grad_()
    b = torch.randn(IN, device="cuda", dtype=dtype, requires_grad=True)
    norm = NormSpec(normalization=normalization, zero_centered_gamma=zero_centered_gamma)
    bias = b if normalization == "LayerNorm" else None
    return dict(x=x, weight=w, bias=bias, norm=norm.key)


def norm_bwd_args(fwd: dict) -> dict:
    with torch.no_grad():
        out, mu, rsigma = torch.ops.te_compile.norm_fwd(**fwd)
    return dict(
        dz=torch.randn_like(out),
        x=fwd["x"].detach(),
        mu=mu,
        rsigma=rsigma,
        gamma=fwd["weight"].detach(),
        norm=fwd["norm"],
    )


def lnl_fwd_args(
    config: str,
    normalization: str,
    bias: bool,
    delayed: bool,
    return_ln_out: bool = False,
    cached_weight: bool = False,
) -> dict:
    """layernorm_linear_fwd arguments on "cuda" (fake CUDA inside a FakeTensorMode)."""
    norm = norm_fwd_args(normalization)
    lin_args = linear_cases.fwd_args(config, bias, delayed, cached_weight)
    lin = dict(zip(linear_fwd.params, lin_args, strict=True))
    return dict(
        inp=norm["x"],
        ln_weight=norm["weight"],
        ln_bias=norm["bias"],
        weight=lin["weight"],
        bias=lin["bias"],
        delayed_state=lin["delayed_state"],
        weight_cache=lin["weight_cache"],
        main_grad=None,
        norm=norm["norm"],
        config=config,
        save_input=True,
        save_weight=True,
        return_ln_out=return_ln_out,
        accumulate=True,
        parallel="",
    )


def lnl_bwd_args(fwd: dict) -> dict:
    """layernorm_linear_bwd arguments for the results of layernorm_linear_fwd(**fwd)."""
    cfg = QuantConfig.from_key(fwd["config"])
    with torch.no_grad():
        out, mu, rsigma, *rest = layernorm_linear_fwd(**fwd)
    if fwd["delayed_state"]:
        rest = rest[:-1]  # the returned forward amaxes
    return_ln_out = fwd["return_ln_out"]
    has_ln_out = return_ln_out or not cfg.fp8
    ln_out = rest[0] if has_ln_out else None
    parts = rest[1:] if has_ln_out else rest
    if fwd["weight_cache"]:
        from te_compile.kernels.fp8_operands import weight_cache_columnwise

        parts = [*parts, *weight_cache_columnwise(fwd["weight_cache"], cfg)]
    hp = not cfg.fp8
    b = fwd["bias"]
    return dict(
        grad_out=torch.randn_like(out),
        grad_ln_out=torch.randn_like(ln_out) if return_ln_out else None,
        inp=fwd["inp"].detach(),
        mu=mu,
        rsigma=rsigma,
        ln_weight=fwd["ln_weight"].detach(),
        ln_out=ln_out if hp else None,
        weight=fwd["weight"].detach() if hp else None,
        bias=b.detach() if hp and b is not None else None,
        parts=parts,
        bwd_state=fwd["delayed_state"][1:],
        main_grad=fwd["main_grad"],
        norm=fwd["norm"],
        config=fwd["config"],
        grads=GemmGrads(b is not None, True, True, True, len(parts) // 2).key,
        parallel="",
    )
