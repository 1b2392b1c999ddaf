"""te.LayerNormMLP's forward and backward as custom ops running TE's own kernels.

    layernorm_mlp_fwd -> [out, ln_out (return_ln), *saved, fwd_amax (DelayedScaling)]
    layernorm_mlp_bwd -> (dx, dgamma, dbeta, fc1_wgrad, fc1_dbias, fc2_wgrad, fc2_dbias), each
                         empty ([0]) when not computed (a mutating op may not return a list)

`config` is the recipe (`QuantConfig.key`), `norm` the norm's options (`NormSpec.key`), `mlp`
the activation's (`MLPSpec.key`), `flags` the call's save and accumulate flags
(`layernorm_mlp_layout.MLPFlags.key`). Mutated in place by the backward op: DelayedScaling's
TE-owned backward scale and amax history, the GEMM weights' `main_grad` under
fuse_wgrad_accumulation.

Forward, as eager TE's `_LayerNormMLP._forward` (TE 2.20.2): the norm, with FC1's input
quantization fused into it when FP8 is on and the norm output is not returned; FC1 (bias in
the GEMM epilogue, or in TE's bias-GeLU fusion); the activation, fused with FC2's input
quantization (ops/activation.py); FC2. The GEMMs are the shared GEMM layer (gemm_layer.py),
GEMM 0 and GEMM 1 of the module's DelayedScaling slots. Backward: FC2 (grad_output quantized
with its dbias as te.Linear does), the activation's backward fused with FC1's grad_output
quantization and dbias where TE fuses them, FC1, the norm's backward.

The forward op carries an autograd formula, so it may not mutate: it returns DelayedScaling's
amaxes for the caller to write back, and what backward reads (layernorm_mlp_layout.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ..kernels import activation, gemm_layer, tensor_parallel
from ..kernels.fp8_operands import columnwise_count, weight_cache_columnwise
from ..kernels.norm import norm_for_gemm, tex_norm_bwd
from ..recipes import QuantConfig
from ..spec import GemmGrads, NormSpec, Spec, labelled, spec
from . import envelope
from . import layernorm_mlp_layout as layout
from .registry import op

FC1, FC2 = 0, 1  # GEMM indices (DelayedScaling slots)


@spec
class MLPSpec(Spec):
    """The activation's options."""

    activation: str = labelled("act", "gelu")
    params: tuple[float, ...] = ()  # activation_params, positional (activation.params_tuple)
    bias_gelu: bool = False  # TE's bias-GeLU fusion (no FP8, gelu)
    return_ln: bool = False  # return_layernorm_output


def _specs(a) -> tuple[QuantConfig, NormSpec, MLPSpec]:
    return QuantConfig.from_key(a.config), NormSpec.from_key(a.norm), MLPSpec.from_key(a.mlp)


@op()
def layernorm_mlp_fwd(
    inp: Tensor,
    ln_weight: Tensor,
    ln_bias: Tensor | None,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    delayed_state: list[Tensor],
    fc1_cache: list[Tensor],
    fc2_cache: list[Tensor],
    fc1_main_grad: Tensor | None,
    fc2_main_grad: Tensor | None,
    config: str,
    norm: str,
    mlp: str,
    out_dtype: torch.dtype,
    flags: str,
    parallel: str,
) -> list[Tensor]:
    """DelayedScaling: `delayed_state` = [scale] of the six forward slots, then the backward
    slots' [scale, amax_history] (see linear.linear_fwd); this call's amaxes are returned last
    for the caller to max-merge into TE's history. `parallel`: FC1's ParallelSpec key (column;
    FC2 is row-parallel) or ""."""
    cfg, n, m = QuantConfig.from_key(config), NormSpec.from_key(norm), MLPSpec.from_key(mlp)
    f = layout.MLPFlags.from_key(flags)
    tps = tensor_parallel.decode_pair(parallel)
    dev = inp.device.index
    hidden = ln_weight.numel()
    x = gemm_layer.cast(inp.reshape(-1, hidden), out_dtype)
    gamma, beta = gemm_layer.cast(ln_weight, out_dtype), gemm_layer.cast(ln_bias, out_dtype)
    state = gemm_layer.fresh_amax_state(delayed_state[:1])

    def gemm_forward(gemm, x_in, weight, bias, cache, save_input, save_weight, x_shape):
        return gemm_layer.forward(
            *(x_in, weight, bias, cfg),
            state=state,
            weight_cache=cache,
            save_input=save_input,
            save_weight=save_weight,
            out_dtype=out_dtype,
            x_shape=x_shape,
            device_index=dev,
            gemm=gemm,
            tp=tps[gemm],
        )

    # Norm, with FC1's input quantization fused in unless its high-precision output is returned.
    ln_out, ln_out_hp, mu, rsigma = norm_for_gemm(
        x,
        gamma,
        beta,
        cfg,
        n,
        state=state,
        columnwise=f.save_fc1_input,
        return_hp=m.return_ln,
        gemm=FC1,
        tp=tps[FC1],
    )

    # FC1. TE's bias-GeLU fusion adds the bias in the activation instead of the GEMM.
    fc1_bias_in_gemm = None if m.bias_gelu else fc1_bias
    fc1_out, fc1_saved = gemm_forward(
        *(FC1, ln_out, fc1_weight, fc1_bias_in_gemm, fc1_cache),
        *(f.save_fc1_input, f.save_norm, x.shape),
    )
    if cfg.fp8:  # FC1's saved parts: input's column-wise half first, then the weight's
        n_in = columnwise_count(cfg) if f.save_fc1_input else 0
        fc1_in_parts, fc1_w_parts = fc1_saved[:n_in], fc1_saved[n_in:]
    else:
        fc1_in_parts, fc1_w_parts = ([ln_out] if f.save_fc1_input else []), []

    # Activation (+ FC2's input quantization), then FC2.
    if m.bias_gelu:
        act_out = activation.bias_gelu(fc1_out, gemm_layer.cast(fc1_bias, out_dtype))
    else:
        act_out = activation.forward(fc1_out, cfg, m.activation, m.params, state=state)
    if f.save_fc2_input and cfg.per_tensor and cfg.fp8_transpose:
        # TE's FC2 input quantizer is row-wise only; its backward makes the transpose from the
        # FP8 data (fp8_transpose, same bytes). Made here so it can be saved as a plain tensor.
        act_out.update_usage(columnwise_usage=True)
    out, fc2_saved = gemm_forward(
        *(FC2, act_out, fc2_weight, fc2_bias, fc2_cache),
        *(f.save_fc2_input, f.save_fc1_out, (fc1_out.shape[0], fc2_weight.shape[1])),
    )
    if not cfg.fp8:
        fc2_saved = [act_out] if f.save_fc2_input else []
    n_fc2_in = columnwise_count(cfg) if f.save_fc2_input else 0

    groups = {
        "mu": [mu],
        "rsigma": [rsigma],
        "fc1_input": fc1_in_parts,
        "fc1_weight": fc1_w_parts,
        "fc1_out": [fc1_out],
        "fc2_input": fc2_saved[:n_fc2_in] if cfg.fp8 else fc2_saved,
        "fc2_weight": fc2_saved[n_fc2_in:] if cfg.fp8 else [],
    }
    saved = layout.returned(
        layout.segments(cfg, n.normalization, f),
        layout.not_returned(cfg, m.return_ln, fc1_cache, fc2_cache),
        groups.__getitem__,
    )
    outputs = [out.view(*inp.shape[:-1], out.shape[-1])]
    if m.return_ln:
        outputs.append(ln_out_hp.view(inp.shape))
    return outputs + saved + ([state[1]] if state else [])


@layernorm_mlp_fwd.fake
def _(a):
    cfg, n, m = _specs(a)
    outputs = [a.inp.new_empty([*a.inp.shape[:-1], a.fc2_weight.shape[0]], dtype=a.out_dtype)]
    if m.return_ln:
        outputs.append(a.inp.new_empty(a.inp.shape, dtype=a.out_dtype))
    saved = layout.fake_returned(*layout.of_forward(cfg, n.normalization, m.return_ln, a), cfg, a)
    return outputs + saved + [torch.empty_like(s) for s in a.delayed_state[:1]]  # the amaxes


# ---- backward ----------------------------------------------------------------------------------


@op(mutates=("bwd_state", "fc1_main_grad", "fc2_main_grad"))
def layernorm_mlp_bwd(
    grad_out: Tensor,
    grad_ln_out: Tensor | None,
    inp: Tensor | None,
    ln_weight: Tensor | None,
    fc1_weight: Tensor | None,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor | None,
    fc2_bias: Tensor | None,
    saved: list[Tensor],
    bwd_state: list[Tensor],
    fc1_main_grad: Tensor | None,
    fc2_main_grad: Tensor | None,
    config: str,
    norm: str,
    mlp: str,
    fc1_features: int,
    flags: str,
    needs_norm_grads: bool,
    needs_fc1_wgrad: bool,
    needs_fc1_dbias: bool,
    needs_fc2_wgrad: bool,
    parallel: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of layernorm_mlp_fwd, in grad_out's dtype (autograd hands backward the
    gradient in the dtype of the forward's output, its out_dtype). `needs_norm_grads`: of the
    input or the norm's parameters (FC1 dgrad and the norm backward run). `saved` holds every
    group of the forward's save flags (layernorm_mlp_layout.py). Weights are passed without FP8
    only (FP8 operands come from `saved`); biases always (their presence decides TE's dbias
    work). DelayedScaling: `bwd_state` = [scale, amax_history] of TE's backward slots, as
    linear_bwd's."""
    cfg, n, m = QuantConfig.from_key(config), NormSpec.from_key(norm), MLPSpec.from_key(mlp)
    f = layout.MLPFlags.from_key(flags)
    out_dtype = grad_out.dtype
    hidden = grad_out.shape[-1]
    needs_act = needs_norm_grads or needs_fc1_wgrad or needs_fc1_dbias
    s = layout.split(saved, layout.segments(cfg, n.normalization, f))
    g = grad_out.reshape(-1, hidden)
    if not g.is_contiguous():
        g = g.contiguous()
    state = gemm_layer.backward_state(cfg, bwd_state)
    tps = tensor_parallel.decode_pair(parallel)

    def hp(name):  # a high-precision saved operand (no FP8)
        return s[name][0] if not cfg.fp8 and s[name] else None

    def gemm_backward(grad, gemm, weight, bias, main_grad, needs_dgrad, needs_wgrad, **kw):
        name = ("fc1", "fc2")[gemm]
        grads = GemmGrads(bias is not None, needs_dgrad, needs_wgrad, f.accumulate)
        return gemm_layer.backward(
            grad,
            cfg,
            grads,
            x=hp(f"{name}_input"),
            weight=weight,
            bias=bias,
            input_parts=s[f"{name}_input"],
            weight_parts=s[f"{name}_weight"],
            state=state,
            main_grad=main_grad,
            out_dtype=out_dtype,
            gemm=gemm,
            tp=tps[gemm],
            **kw,
        )

    fc2_dgrad, fc2_wgrad, fc2_dbias = gemm_backward(
        g,
        FC2,
        fc2_weight,
        fc2_bias,
        fc2_main_grad,
        needs_dgrad=needs_act,
        needs_wgrad=needs_fc2_wgrad,
        grad_columnwise=True,  # TE's LayerNormMLP asks for both halves of FC2's grad_output
    )
    dx = dgamma = dbeta = fc1_wgrad = fc1_dbias = None
    if needs_act:
        fc1_out = s["fc1_out"][0]
        if m.bias_gelu:
            dact, fc1_dbias = activation.bgrad_dgelu(
                fc2_dgrad, fc1_out, gemm_layer.cast(fc1_bias, out_dtype)
            )
            fc1_gemm_bias = None  # the dbias came from the fused bgrad-dgelu
        else:
            dact, fc1_dbias = activation.backward(
                fc2_dgrad, fc1_out, cfg, m.activation, m.params, state=state
            )
            fc1_gemm_bias = fc1_bias
        # Drop each large intermediate at its last use, as eager TE does: a name held to the
        # op's return is alive at the norm backward, the step's peak at TE's guide shape.
        del fc2_dgrad
        fc1_dgrad, fc1_wgrad, gemm_dbias = gemm_backward(
            dact,
            FC1,
            fc1_weight,
            fc1_gemm_bias,
            fc1_main_grad,
            needs_dgrad=needs_norm_grads,
            needs_wgrad=needs_fc1_wgrad,
            dbias=fc1_dbias,
        )
        if fc1_dbias is None:
            fc1_dbias = gemm_dbias
        if fc1_dbias is None and fc1_bias is not None and needs_fc1_dbias:
            # No FP8 and no FC1 wgrad: TE sums dact (its LayerNormMLP backward).
            fc1_dbias = dact.sum(dim=0)
        del dact
        if needs_norm_grads:
            dz = fc1_dgrad
            del fc1_dgrad
            if grad_ln_out is not None:  # return_layernorm_output: both paths' gradients
                dz = dz + grad_ln_out.reshape(dz.shape)
            x = gemm_layer.cast(inp.reshape(-1, hidden), out_dtype)
            gamma = gemm_layer.cast(ln_weight, out_dtype)
            mu = s["mu"][0] if s["mu"] else None
            dx, dgamma, dbeta = tex_norm_bwd(dz, x, mu, s["rsigma"][0], gamma, n)
            del dz
            dx = dx.view(grad_out.shape)
    gemm_layer.update_backward_state(cfg, bwd_state)
    return envelope.results(
        grad_out, out_dtype, dx, dgamma, dbeta, fc1_wgrad, fc1_dbias, fc2_wgrad, fc2_dbias
    )


@layernorm_mlp_bwd.fake
def _(a):
    cfg, n, m = _specs(a)
    computed = layout.computed_grads(cfg, n.normalization, m.bias_gelu, a)
    shapes = layout.grad_shapes(a, m.activation)
    return envelope.fake_results(a.grad_out, a.grad_out.dtype, *zip(shapes, computed, strict=True))


# ---- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, a, output) -> None:
    cfg, n, m = ctx.specs = _specs(a)
    ctx.a = envelope.ride_along(a)  # the plain values and the state backward mutates
    f = layout.MLPFlags.from_key(a.flags)
    ctx.fc1_features = a.fc1_weight.shape[0]
    n_out = 2 if m.return_ln else 1
    ctx.mark_non_differentiable(*output[n_out:])
    saved = layout.for_backward(
        *layout.of_forward(cfg, n.normalization, m.return_ln, a),
        list(output[n_out : len(output) - len(a.delayed_state[:1])]),  # not the returned amaxes
        {
            "fc1_input": lambda: [output[1].view(-1, output[1].shape[-1])],
            "fc1_weight": lambda: weight_cache_columnwise(a.fc1_cache, cfg),
            "fc2_weight": lambda: weight_cache_columnwise(a.fc2_cache, cfg),
        },
    )
    hp_weights = not cfg.fp8  # without FP8 the GEMMs read the op's own weights
    ctx.save_for_backward(
        a.inp if f.save_norm else None,
        a.ln_weight if f.save_norm else None,
        a.fc1_weight if f.save_norm and hp_weights else None,
        a.fc1_bias,
        a.fc2_weight if f.save_fc1_out and hp_weights else None,
        a.fc2_bias,
        *saved,
    )


# The forward's inputs setup_context saves (None where backward does not read them, then the
# saved groups) and the forward's arguments passed to the backward op unchanged.
_SAVED_INPUTS = ("inp", "ln_weight", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")
_FROM_FORWARD = ("fc1_main_grad", "fc2_main_grad", "config", "norm", "mlp", "flags", "parallel")


def _backward(ctx, grads):
    needs = ctx.needs_input_grad[: len(layout.GRADIENTS)]
    needs_x, needs_gamma, needs_beta, needs_w1, needs_b1, needs_w2, _ = needs
    grad_out = grads[0]
    if grad_out is None or not any(needs):
        return {}
    cfg, n, m = ctx.specs
    call = SimpleNamespace(
        grad_out=grad_out,
        grad_ln_out=grads[1] if m.return_ln else None,
        **dict(zip(_SAVED_INPUTS, ctx.saved_tensors, strict=False)),
        saved=list(ctx.saved_tensors[len(_SAVED_INPUTS) :]),
        bwd_state=ctx.a.delayed_state[1:],  # DelayedScaling's backward [scale, amax_history]
        fc1_features=ctx.fc1_features,
        needs_norm_grads=needs_x or needs_gamma or needs_beta,
        needs_fc1_wgrad=needs_w1,
        needs_fc1_dbias=needs_b1,
        needs_fc2_wgrad=needs_w2,
        **{name: getattr(ctx.a, name) for name in _FROM_FORWARD},
    )
    results = layernorm_mlp_bwd(**vars(call))
    computed = layout.computed_grads(cfg, n.normalization, m.bias_gelu, call)
    return {
        name: result if real and need else None
        for name, result, real, need in zip(layout.GRADIENTS, results, computed, needs, strict=True)
    }


layernorm_mlp_fwd.autograd(_setup_context, _backward)
