"""te.LayerNormLinear's forward and backward as custom ops: TE's norm kernel (fused with the
GEMM input's quantization where eager TE fuses it, norm.norm_for_gemm) in front of the shared
GEMM layer (gemm_layer.py, the code te.Linear's ops run).

    te_compile::layernorm_linear_fwd(inp, ln_weight, ln_bias?, weight, bias?, fwd_state,
        bwd_state, weight_cache, main_grad?, normalization, eps, sm_margin, bwd_sm_margin,
        zero_centered_gamma, config, save_input, save_weight, return_ln_out, accumulate)
        -> [out, mu, rsigma, (ln_out), *input_parts, *weight_parts, (fwd_amax)]
    te_compile::layernorm_linear_bwd(grad_out, grad_ln_out?, inp, mu, rsigma, ln_weight,
        ln_out?, weight?, bias?, input_parts, weight_parts, bwd_scale!?, bwd_history!?,
        main_grad!?, normalization, sm_margin, zero_centered_gamma, config, has_bias,
        needs_norm_grads, needs_wgrad, accumulate)
        -> (dinp, dln_weight, dln_bias, wgrad, dbias), each empty ([0]) when not computed

`inp` is 2-D [tokens, in_features] and inp, ln_weight, ln_bias are in the activation dtype
(the module casts, as eager TE does inside its autograd.Function); the output has that dtype.
mu is empty for RMSNorm. `ln_out` (the high-precision norm output) is an output when the
module returns it (`return_ln_out`) or, without FP8, when wgrad reads it. State, caches,
main_grad, `config` and the saved parts are as in linear.py.
"""

from __future__ import annotations

import torch

from ..recipes import QuantConfig
from . import gemm_layer, registry
from .fp8_operands import columnwise_count, weight_cache_columnwise
from .norm import norm_bwd, norm_for_gemm


def _has_ln_out(cfg: QuantConfig, save_input: bool, return_ln_out: bool) -> bool:
    return return_ln_out or (not cfg.fp8 and save_input)


def layernorm_linear_fwd(
    inp,
    ln_weight,
    ln_bias,
    weight,
    bias,
    fwd_state,
    bwd_state,
    weight_cache,
    main_grad,
    normalization,
    eps,
    sm_margin,
    bwd_sm_margin,
    zero_centered_gamma,
    config,
    save_input,
    save_weight,
    return_ln_out,
    accumulate,
):
    """norm(inp) @ weight.T + bias. DelayedScaling: `fwd_state` = [scale]; this call's amaxes
    are returned last (see linear.linear_fwd)."""
    cfg = QuantConfig.from_key(config)
    state = gemm_layer.fresh_amax_state(fwd_state)
    x, ln_out, mu, rsigma = norm_for_gemm(
        inp,
        ln_weight,
        ln_bias,
        cfg,
        normalization=normalization,
        eps=eps,
        sm_margin=sm_margin,
        zero_centered_gamma=zero_centered_gamma,
        state=state,
        columnwise=save_input,
        return_hp=return_ln_out,
    )
    out, saved = gemm_layer.forward(
        x,
        weight,
        bias,
        cfg,
        state=state,
        weight_cache=weight_cache,
        save_input=save_input,
        save_weight=save_weight,
        out_dtype=inp.dtype,
        x_shape=inp.shape,
        device_index=inp.device.index,
    )
    if mu is None:
        mu = rsigma.new_empty([0])
    kept = [ln_out] if _has_ln_out(cfg, save_input, return_ln_out) else []
    return [out, mu, rsigma, *kept, *saved, *([state[1]] if state else [])]


def _fwd_fake(
    inp,
    ln_weight,
    ln_bias,
    weight,
    bias,
    fwd_state,
    bwd_state,
    weight_cache,
    main_grad,
    normalization,
    eps,
    sm_margin,
    bwd_sm_margin,
    zero_centered_gamma,
    config,
    save_input,
    save_weight,
    return_ln_out,
    accumulate,
):
    cfg = QuantConfig.from_key(config)
    tokens = inp.shape[0]
    out = inp.new_empty([tokens, weight.shape[0]])
    mu = inp.new_empty([tokens if normalization == "LayerNorm" else 0], dtype=torch.float32)
    rsigma = inp.new_empty([tokens], dtype=torch.float32)
    kept = [torch.empty_like(inp)] if _has_ln_out(cfg, save_input, return_ln_out) else []
    saved = gemm_layer.fake_saved_parts(
        inp.shape,
        weight.shape,
        cfg,
        save_input=save_input,
        save_weight=save_weight,
        weight_cache=weight_cache,
        like=inp,
    )
    amax = [torch.empty_like(fwd_state[0])] if fwd_state else []
    return [out, mu, rsigma, *kept, *saved, *amax]


def layernorm_linear_bwd(
    grad_out,
    grad_ln_out,
    inp,
    mu,
    rsigma,
    ln_weight,
    ln_out,
    weight,
    bias,
    input_parts,
    weight_parts,
    bwd_scale,
    bwd_history,
    main_grad,
    normalization,
    sm_margin,
    zero_centered_gamma,
    config,
    has_bias,
    needs_norm_grads,
    needs_wgrad,
    accumulate,
):
    """Gradients of layernorm_linear_fwd, as eager TE's `_LayerNormLinear.backward`: the GEMM
    layer's backward (grad_output quantized with both halves), the gradient of a returned
    norm output added to dgrad, then TE's norm backward."""
    cfg = QuantConfig.from_key(config)
    state = [bwd_scale, bwd_history[0]] if cfg.fp8 and bwd_history is not None else None
    g = grad_out if grad_out.is_contiguous() else grad_out.contiguous()
    dgrad, wgrad, dbias = gemm_layer.backward(
        g,
        cfg,
        x=ln_out,
        weight=weight,
        bias=bias,
        input_parts=input_parts,
        weight_parts=weight_parts,
        state=state,
        main_grad=main_grad,
        out_dtype=inp.dtype,
        has_bias=has_bias,
        needs_dgrad=needs_norm_grads,
        needs_wgrad=needs_wgrad,
        accumulate=accumulate,
        device_index=grad_out.device.index,
        grad_columnwise=True,
    )
    if bwd_history is not None:
        gemm_layer.update_backward_state(bwd_scale, bwd_history, cfg)
    dx = dgamma = dbeta = None
    if needs_norm_grads:
        if grad_ln_out is not None:
            dgrad = dgrad + grad_ln_out.reshape(dgrad.shape)
        dx, dgamma, dbeta = norm_bwd(
            dgrad,
            inp,
            mu,
            rsigma,
            ln_weight,
            normalization=normalization,
            sm_margin=sm_margin,
            zero_centered_gamma=zero_centered_gamma,
        )

    def none():  # a result not asked for (outputs of one op may not alias each other)
        return inp.new_empty([0])

    return tuple(none() if t is None else t for t in (dx, dgamma, dbeta, wgrad, dbias))


def _bwd_fake(
    grad_out,
    grad_ln_out,
    inp,
    mu,
    rsigma,
    ln_weight,
    ln_out,
    weight,
    bias,
    input_parts,
    weight_parts,
    bwd_scale,
    bwd_history,
    main_grad,
    normalization,
    sm_margin,
    zero_centered_gamma,
    config,
    has_bias,
    needs_norm_grads,
    needs_wgrad,
    accumulate,
):
    cfg = QuantConfig.from_key(config)
    out_features, in_features = grad_out.shape[-1], inp.shape[-1]

    def empty(shape, wanted: bool):
        return inp.new_empty(shape if wanted else [0])

    layernorm = normalization == "LayerNorm"
    return (
        empty(list(inp.shape), needs_norm_grads),
        empty([in_features], needs_norm_grads),
        empty([in_features], needs_norm_grads and layernorm),
        empty([out_features, in_features], needs_wgrad and main_grad is None),
        empty([out_features], gemm_layer.returns_dbias(cfg, has_bias, needs_wgrad)),
    )


# ---- autograd ----------------------------------------------------------------------------------

_N_INPUTS = 19  # arguments of layernorm_linear_fwd


def _setup_context(ctx, inputs, output) -> None:
    (inp, ln_weight, ln_bias, weight, bias, fwd_state, bwd_state, weight_cache, main_grad) = inputs[
        :9
    ]
    normalization, _, _, bwd_sm_margin, zcg, config, save_input, save_weight, return_ln_out = (
        inputs[9:18]
    )
    cfg = QuantConfig.from_key(config)
    ctx.config, ctx.normalization, ctx.bwd_sm_margin, ctx.zcg = (
        config,
        normalization,
        bwd_sm_margin,
        zcg,
    )
    ctx.n_fwd_state, ctx.n_weight_cache = len(fwd_state), len(weight_cache)
    # Mutable state rides on ctx, not save_for_backward: backward mutates it in place.
    ctx.bwd_state, ctx.main_grad, ctx.accumulate = bwd_state, main_grad, inputs[18]
    ctx.has_bias = bias is not None
    ctx.return_ln_out = return_ln_out
    ctx.n_input_parts = columnwise_count(cfg) if cfg.fp8 and save_input else 0
    out, mu, rsigma, *rest = output
    has_ln_out = _has_ln_out(cfg, save_input, return_ln_out)
    ln_out = rest[0] if has_ln_out else None
    parts = rest[1 if has_ln_out else 0 : len(rest) - (1 if fwd_state else 0)]
    non_diff = [mu, rsigma, *rest[1 if has_ln_out else 0 :]]
    if ln_out is not None and not return_ln_out:
        non_diff.append(ln_out)
    ctx.mark_non_differentiable(*non_diff)
    if cfg.fp8:
        if save_weight and weight_cache:
            parts = [*parts, *weight_cache_columnwise(weight_cache, cfg)]
        ctx.save_for_backward(inp, mu, rsigma, ln_weight, None, None, None, *parts)
    else:
        ctx.save_for_backward(
            inp,
            mu,
            rsigma,
            ln_weight,
            ln_out if save_input else None,
            weight if save_weight else None,
            bias,
        )


def _backward(ctx, grads):
    grad_out = grads[0]
    needs = ctx.needs_input_grad
    needs_norm_grads = any(needs[:3])
    needs_wgrad, needs_dbias = needs[3], needs[4]
    nones = (
        [None] * ctx.n_fwd_state,
        [None] * len(ctx.bwd_state),
        [None] * ctx.n_weight_cache,
        *([None] * (_N_INPUTS - 8)),
    )
    if grad_out is None or not (needs_norm_grads or needs_wgrad or needs_dbias):
        return None, None, None, None, None, *nones
    inp, mu, rsigma, ln_weight, ln_out, weight, bias, *parts = ctx.saved_tensors
    grad_ln_out = grads[3] if ctx.return_ln_out else None  # [out, mu, rsigma, ln_out, ...]
    n = ctx.n_input_parts
    dx, dgamma, dbeta, wgrad, dbias = torch.ops.te_compile.layernorm_linear_bwd(
        grad_out,
        grad_ln_out,
        inp,
        mu,
        rsigma,
        ln_weight,
        ln_out,
        weight,
        bias,
        parts[:n],
        parts[n:],
        *(ctx.bwd_state or [None, None]),
        ctx.main_grad,
        ctx.normalization,
        ctx.bwd_sm_margin,
        ctx.zcg,
        ctx.config,
        ctx.has_bias,
        needs_norm_grads,
        needs_wgrad,
        ctx.accumulate,
    )
    cfg = QuantConfig.from_key(ctx.config)
    return (
        dx if needs[0] else None,
        dgamma if needs[1] else None,
        dbeta if needs[2] and ctx.normalization == "LayerNorm" else None,
        wgrad if needs_wgrad and ctx.main_grad is None else None,
        dbias if needs_dbias and gemm_layer.returns_dbias(cfg, ctx.has_bias, needs_wgrad) else None,
        *nones,
    )


LAYERNORM_LINEAR_FWD = registry.define(
    "layernorm_linear_fwd(Tensor inp, Tensor ln_weight, Tensor? ln_bias, Tensor weight, "
    "Tensor? bias, Tensor[] fwd_state, Tensor[] bwd_state, Tensor[] weight_cache, "
    "Tensor? main_grad, str normalization, float eps, int sm_margin, int bwd_sm_margin, "
    "bool zero_centered_gamma, str config, bool save_input, bool save_weight, "
    "bool return_ln_out, bool accumulate) -> Tensor[]",
    layernorm_linear_fwd,
    _fwd_fake,
)
registry.register_autograd(LAYERNORM_LINEAR_FWD, _backward, _setup_context)
LAYERNORM_LINEAR_BWD = registry.define(
    "layernorm_linear_bwd(Tensor grad_out, Tensor? grad_ln_out, Tensor inp, Tensor mu, "
    "Tensor rsigma, Tensor ln_weight, Tensor? ln_out, Tensor? weight, Tensor? bias, "
    "Tensor[] input_parts, Tensor[] weight_parts, Tensor(a!)? bwd_scale, "
    "Tensor(b!)? bwd_history, Tensor(c!)? main_grad, str normalization, int sm_margin, "
    "bool zero_centered_gamma, str config, bool has_bias, bool needs_norm_grads, "
    "bool needs_wgrad, bool accumulate) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    layernorm_linear_bwd,
    _bwd_fake,
)
