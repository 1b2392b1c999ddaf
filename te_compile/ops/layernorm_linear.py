"""te.LayerNormLinear's forward and backward as custom ops: TE's norm kernel (fused with the
GEMM input's quantization where eager TE fuses it, norm.norm_for_gemm) in front of the shared
GEMM layer (gemm_layer.py, the code te.Linear's ops run).

    layernorm_linear_fwd -> [out, mu, rsigma, (ln_out), *input_parts, *weight_parts,
                             (fwd_amax)]
    layernorm_linear_bwd -> (dinp, dln_weight, dln_bias, wgrad, dbias), each empty ([0]) when
                            not computed

`inp` is 2-D [tokens, in_features] and inp, ln_weight, ln_bias are in the activation dtype
(the module casts, as eager TE does inside its autograd.Function); the output has that dtype.
mu is empty for RMSNorm. `ln_out` (the high-precision norm output) is an output when the
module returns it (`return_ln_out`) or, without FP8, when wgrad reads it. `norm` is
`NormSpec.key`; `delayed_state`, caches, main_grad, `config` and the saved parts are as in
linear.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import gemm_layer, single_gemm, tensor_parallel
from ..kernels.fp8_operands import columnwise_count, weight_cache_columnwise
from ..kernels.norm import has_beta, norm_for_gemm, stats_shapes, tex_norm_bwd
from ..recipes import QuantConfig
from ..spec import GemmGrads, NormSpec
from . import envelope
from .registry import op


def _has_ln_out(cfg: QuantConfig, save_input: bool, return_ln_out: bool) -> bool:
    return return_ln_out or (not cfg.fp8 and save_input)


@op()
def layernorm_linear_fwd(
    inp: Tensor,
    ln_weight: Tensor,
    ln_bias: Tensor | None,
    weight: Tensor,
    bias: Tensor | None,
    delayed_state: list[Tensor],
    weight_cache: list[Tensor],
    main_grad: Tensor | None,
    norm: str,
    config: str,
    save_input: bool,
    save_weight: bool,
    return_ln_out: bool,
    accumulate: bool,
    parallel: str,
) -> list[Tensor]:
    """norm(inp) @ weight.T + bias. DelayedScaling: this call's amaxes are returned last (see
    linear.linear_fwd). `parallel`: as linear_fwd's (column-parallel
    only: the norm runs on this rank's rows, its output is all-gathered under sequence
    parallelism)."""
    cfg = QuantConfig.from_key(config)
    state = gemm_layer.fresh_amax_state(delayed_state[:1])
    tp = tensor_parallel.decode(parallel)
    x, ln_out, mu, rsigma = norm_for_gemm(
        inp,
        ln_weight,
        ln_bias,
        cfg,
        NormSpec.from_key(norm),
        state=state,
        columnwise=save_input,
        return_hp=return_ln_out,
        tp=tp,
    )
    if mu is None:
        mu = rsigma.new_empty([0])
    kept = [ln_out] if _has_ln_out(cfg, save_input, return_ln_out) else []
    return single_gemm.single_forward(
        *(x, weight, bias, cfg, state, weight_cache, save_input, save_weight),
        out_dtype=inp.dtype,
        like=inp,
        head=[mu, rsigma, *kept],
        tp=tp,
    )


@layernorm_linear_fwd.fake
def _(a):
    cfg = QuantConfig.from_key(a.config)
    inp = a.inp
    mu, rsigma = stats_shapes(NormSpec.from_key(a.norm), inp.shape[0])
    stats = [inp.new_empty(mu, dtype=torch.float32), inp.new_empty(rsigma, dtype=torch.float32)]
    kept = [torch.empty_like(inp)] if _has_ln_out(cfg, a.save_input, a.return_ln_out) else []
    tp = tensor_parallel.decode(a.parallel)
    return single_gemm.fake_single_forward(a, cfg, inp.dtype, *stats, *kept, tp=tp)


@op(mutates=("bwd_state", "main_grad"))
def layernorm_linear_bwd(
    grad_out: Tensor,
    grad_ln_out: Tensor | None,
    inp: Tensor,
    mu: Tensor,
    rsigma: Tensor,
    ln_weight: Tensor,
    ln_out: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    parts: list[Tensor],
    bwd_state: list[Tensor],
    main_grad: Tensor | None,
    norm: str,
    config: str,
    grads: str,
    parallel: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of layernorm_linear_fwd, as eager TE's `_LayerNormLinear.backward`: the GEMM
    layer's backward (grad_output quantized with both halves; dgrad reduced over the
    tensor-parallel group), the gradient of a returned norm output added to dgrad, then TE's
    norm backward. `parts`, `bwd_state`: as linear_bwd's."""
    cfg = QuantConfig.from_key(config)
    g = grad_out if grad_out.is_contiguous() else grad_out.contiguous()
    spec = GemmGrads.from_key(grads)  # its dgrad: the norm's gradients are needed
    dgrad, wgrad, dbias = single_gemm.single_backward(
        *(g, cfg, parts, bwd_state, spec),
        hp_operands=(ln_out, weight, bias),
        main_grad=main_grad,
        out_dtype=inp.dtype,
        grad_columnwise=True,
        tp=tensor_parallel.decode(parallel),
    )
    dx = dgamma = dbeta = None
    if spec.dgrad:
        if grad_ln_out is not None:
            dgrad = dgrad + grad_ln_out.reshape(dgrad.shape)
        dx, dgamma, dbeta = tex_norm_bwd(dgrad, inp, mu, rsigma, ln_weight, NormSpec.from_key(norm))
    return envelope.results(inp, inp.dtype, dx, dgamma, dbeta, wgrad, dbias)


@layernorm_linear_bwd.fake
def _(a):
    cfg, grads = QuantConfig.from_key(a.config), GemmGrads.from_key(a.grads)
    out_features, in_features = a.grad_out.shape[-1], a.inp.shape[-1]
    norm_grads = grads.dgrad
    return envelope.fake_results(
        a.inp,
        a.inp.dtype,
        (list(a.inp.shape), norm_grads),
        ([in_features], norm_grads),
        ([in_features], norm_grads and has_beta(NormSpec.from_key(a.norm))),
        ([out_features, in_features], grads.wgrad and a.main_grad is None),
        ([out_features], gemm_layer.returns_dbias(cfg, grads.has_bias, grads.wgrad)),
    )


# ---- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, a, output) -> None:
    cfg = QuantConfig.from_key(a.config)
    ctx.a = envelope.ride_along(a)  # the scalars and the state backward mutates
    ctx.has_bias = a.bias is not None
    ctx.n_input_parts = columnwise_count(cfg) if cfg.fp8 and a.save_input else 0
    _, mu, rsigma, *rest = output
    has_ln_out = _has_ln_out(cfg, a.save_input, a.return_ln_out)
    ln_out = rest[0] if has_ln_out else None
    after_ln_out = rest[1 if has_ln_out else 0 :]
    parts = after_ln_out[: len(after_ln_out) - len(a.delayed_state[:1])]  # not the returned amaxes
    non_diff = [mu, rsigma, *after_ln_out]
    if ln_out is not None and not a.return_ln_out:
        non_diff.append(ln_out)
    ctx.mark_non_differentiable(*non_diff)
    if cfg.fp8:
        if a.save_weight and a.weight_cache:
            parts = [*parts, *weight_cache_columnwise(a.weight_cache, cfg)]
        ctx.save_for_backward(a.inp, mu, rsigma, a.ln_weight, None, None, None, *parts)
    else:
        ctx.save_for_backward(
            a.inp,
            mu,
            rsigma,
            a.ln_weight,
            ln_out if a.save_input else None,
            a.weight if a.save_weight else None,
            a.bias,
        )


def _backward(ctx, grads):
    grad_out = grads[0]
    needs = ctx.needs_input_grad
    needs_norm_grads = any(needs[:3])
    needs_wgrad, needs_dbias = needs[3], needs[4]
    if grad_out is None or not (needs_norm_grads or needs_wgrad or needs_dbias):
        return {}
    a = ctx.a
    saved = ctx.saved_tensors  # inp, mu, rsigma, ln_weight, ln_out, weight, bias, *parts
    dx, dgamma, dbeta, wgrad, dbias = layernorm_linear_bwd(
        grad_out,
        grads[3] if a.return_ln_out else None,  # [out, mu, rsigma, ln_out, ...]
        *saved[:7],
        list(saved[7:]),
        *(a.delayed_state[1:], a.main_grad, a.norm, a.config),
        GemmGrads(ctx.has_bias, needs_norm_grads, needs_wgrad, a.accumulate, ctx.n_input_parts).key,
        a.parallel,
    )
    return {
        "inp": dx if needs[0] else None,
        "ln_weight": dgamma if needs[1] else None,
        "ln_bias": dbeta if needs[2] and has_beta(NormSpec.from_key(a.norm)) else None,
        **single_gemm.weight_grads(a, ctx.has_bias, needs_wgrad, needs_dbias, wgrad, dbias),
    }


layernorm_linear_fwd.autograd(_setup_context, _backward)
