"""Arguments for the te_compile::norm_* and te_compile::layernorm_linear_* ops, shared by the
CPU (fake) and GPU opchecks."""

from __future__ import annotations

import linear_cases
import torch

from te_compile.recipes import QuantConfig

TOKENS, IN, OUT = 64, 128, 256


def norm_fwd_args(normalization: str, dtype=torch.bfloat16, zero_centered_gamma=False) -> tuple:
    torch.manual_seed(0)
    x = torch.randn(TOKENS, IN, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.rand(IN, device="cuda", dtype=dtype) + 0.5).requires_grad_()
    b = torch.randn(IN, device="cuda", dtype=dtype, requires_grad=True)
    bias = b if normalization == "LayerNorm" else None
    return (x, w, bias, normalization, 1e-5, 0, 0, zero_centered_gamma)


def norm_bwd_args(fwd: tuple) -> tuple:
    x, w, _, normalization, _, _, bwd_sm_margin, zcg = fwd
    with torch.no_grad():
        out, mu, rsigma = torch.ops.te_compile.norm_fwd(*fwd)
    return (torch.randn_like(out), x.detach(), mu, rsigma, w.detach(), normalization, 0, zcg)


def lnl_fwd_args(
    config: str,
    normalization: str,
    bias: bool,
    delayed: bool,
    return_ln_out: bool = False,
    cached_weight: bool = False,
) -> tuple:
    """layernorm_linear_fwd arguments on "cuda" (fake CUDA inside a FakeTensorMode)."""
    x, ln_w, ln_b, *_ = norm_fwd_args(normalization)
    lin = linear_cases.fwd_args(config, bias, delayed, cached_weight)
    w, b, fwd_state, bwd_state, cache = lin[1], lin[2], lin[3], lin[4], lin[5]
    return (
        x,
        ln_w,
        ln_b,
        w,
        b,
        fwd_state,
        bwd_state,
        cache,
        None,  # main_grad
        normalization,
        1e-5,
        0,
        0,
        False,  # zero_centered_gamma
        config,
        True,  # save_input
        True,  # save_weight
        return_ln_out,
        True,  # accumulate
    )


def lnl_bwd_args(fwd: tuple) -> tuple:
    """layernorm_linear_bwd arguments for the results of layernorm_linear_fwd(*fwd)."""
    x, ln_w, ln_b, w, b, fwd_state, bwd_state, cache, main_grad, normalization = fwd[:10]
    config, return_ln_out = fwd[14], fwd[17]
    cfg = QuantConfig.from_key(config)
    with torch.no_grad():
        out, mu, rsigma, *rest = torch.ops.te_compile.layernorm_linear_fwd(*fwd)
    if fwd_state:
        rest = rest[:-1]  # the returned forward amaxes
    has_ln_out = return_ln_out or not cfg.fp8
    ln_out = rest[0] if has_ln_out else None
    parts = rest[1:] if has_ln_out else rest
    if cache:
        from te_compile.ops.fp8_operands import weight_cache_columnwise

        parts = [*parts, *weight_cache_columnwise(cache, cfg)]
    n = len(parts) // 2
    scale, history = bwd_state or [None, None]
    hp = not cfg.fp8
    return (
        torch.randn_like(out),
        torch.randn_like(ln_out) if return_ln_out else None,
        x.detach(),
        mu,
        rsigma,
        ln_w.detach(),
        ln_out if hp else None,
        w.detach() if hp else None,
        b.detach() if hp and b is not None else None,
        parts[:n],
        parts[n:],
        scale,
        history,
        main_grad,
        normalization,
        0,
        False,
        config,
        b is not None,
        True,
        True,
        True,
    )
