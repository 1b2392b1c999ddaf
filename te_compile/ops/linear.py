"""te.Linear's forward and backward as custom ops running TE's own kernels.

    linear_fwd -> [out, *input_parts, *weight_parts] (+ [fwd_amax] with DelayedScaling)
    linear_bwd -> (dgrad, wgrad, dbias), each empty ([0]) when not computed (a mutating op may
                  not return a list)
    quantize_weight: fills an FP8 weight cache in place

`config` is `QuantConfig.key` (recipes.py). `delayed_state` holds DelayedScaling's tensors
(empty for other recipes): a snapshot of the forward scale, then the backward [scale,
amax_history] that ride along to the backward op. Mutated in place (`mutates`): that
TE-owned backward scale and amax history, an FP8 weight cache, `weight.main_grad` under
fuse_wgrad_accumulation.

linear_fwd carries an autograd formula, so it may not mutate: with DelayedScaling it returns the
new forward amaxes for the caller to write back. With FP8, forward also returns what backward
needs as plain tensors (the column-wise half of the quantized input, when wgrad is needed, and
of the quantized weight, when dgrad is needed; see fp8_operands.py). A cached FP8 weight
(`weight_cache`, filled by quantize_weight) is read instead of quantizing, and backward reads
its column-wise half straight from the cache. Without FP8, the saved tensors are the op's own
inputs. The GEMMs get the arguments eager TE's `_linear_forward_impl`/`_linear_backward_impl`
pass (TE 2.20.2); fuse_wgrad_accumulation writes the wgrad GEMM into `main_grad`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import gemm_layer, single_gemm, tensor_parallel
from ..kernels.fp8_operands import columnwise_count, weight_cache_columnwise, weight_cache_storage
from ..recipes import QuantConfig
from ..spec import GemmGrads
from . import envelope
from .registry import op


@op()
def linear_fwd(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    delayed_state: list[Tensor],
    weight_cache: list[Tensor],
    main_grad: Tensor | None,
    config: str,
    out_dtype: torch.dtype,
    save_input: bool,
    save_weight: bool,
    accumulate: bool,
    parallel: str,
) -> list[Tensor]:
    """y = inp @ weight.T + bias, with FP8 operands when the config's kind is not "none".

    DelayedScaling only: the op quantizes with the forward scales heading `delayed_state` (a
    snapshot of TE's `scale` of the forward slots) and returns this call's amaxes last, for the
    caller to max-merge into TE's history (row 0). The backward slots' [scale, amax_history]
    after it and `main_grad` (with `accumulate`, see linear_bwd) ride along to the backward op.
    `parallel`: a ParallelSpec key (tensor parallelism, the communication inside the op) or
    ""."""
    cfg = QuantConfig.from_key(config)
    state = gemm_layer.fresh_amax_state(delayed_state[:1])
    return single_gemm.single_forward(
        *(inp, weight, bias, cfg, state, weight_cache, save_input, save_weight),
        out_dtype=out_dtype,
        like=inp,
        tp=tensor_parallel.decode(parallel),
    )


@linear_fwd.fake
def _(a):
    cfg = QuantConfig.from_key(a.config)
    tp = tensor_parallel.decode(a.parallel)
    return single_gemm.fake_single_forward(a, cfg, a.out_dtype, tp=tp)


@op(mutates=("cache", "valid", "fwd_amax"))
def quantize_weight(
    weight: Tensor,
    cache: list[Tensor],
    valid: Tensor,
    fwd_scale: Tensor | None,
    fwd_amax: Tensor | None,
    config: str,
    refresh: bool,
) -> None:
    """Quantize `weight` into its FP8 cache (both halves), as eager TE's weight workspace.

    `refresh` (is_first_microbatch=True): always. Otherwise (False) only while the cache holds
    nothing yet: `valid` (float32 [1], 1 once filled) is TE's noop flag, so the GPU skips the
    kernels without a host sync. DelayedScaling records the weight's amax into `fwd_amax`
    (TE's amax_history[0] of the forward slots) when it quantizes."""
    cfg = QuantConfig.from_key(config)
    state = [fwd_scale, fwd_amax] if fwd_scale is not None else None
    out = weight_cache_storage(cache, cfg, weight.dtype)
    gemm_layer.quantize(
        weight, cfg, "weight", True, True, state, into=out, noop=None if refresh else valid
    )
    valid.fill_(1.0)


quantize_weight.fake(lambda a: None)


@op(mutates=("bwd_state", "main_grad"))
def linear_bwd(
    grad_out: Tensor,
    inp: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    parts: list[Tensor],
    bwd_state: list[Tensor],
    main_grad: Tensor | None,
    config: str,
    grads: str,
    out_dtype: torch.dtype,
    in_features: int,
    parallel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of linear_fwd, as `grads` (a GemmGrads key) asks. Without FP8,
    `inp`/`weight`/`bias` are the forward inputs (the bias only flags the dbias fused into the
    wgrad GEMM); with FP8 they are None and `parts` carry the operands: the input's column-wise
    half (`grads.input_parts` tensors), then the weight's. `bwd_state`: DelayedScaling's
    [scale, amax_history] of the backward slots, grad_output's amax merged into row 0 (the
    update: gemm_layer.update_backward_state) (empty for other recipes).
    With `main_grad` (fuse_wgrad_accumulation) the wgrad GEMM writes into it, adding to its
    contents when `grads.accumulate`, and the returned wgrad is empty."""
    cfg = QuantConfig.from_key(config)
    g = grad_out.reshape(-1, grad_out.shape[-1])
    dgrad, wgrad, dbias = single_gemm.single_backward(
        *(g if g.is_contiguous() else g.contiguous(), cfg, parts, bwd_state),
        GemmGrads.from_key(grads),
        hp_operands=(inp, weight, bias),
        main_grad=main_grad,
        out_dtype=out_dtype,
        tp=tensor_parallel.decode(parallel),
    )
    if dgrad is not None:  # (under sequence parallelism its first dimension differs)
        dgrad = dgrad.view([-1, *grad_out.shape[1:-1], in_features])
    return envelope.results(grad_out, out_dtype, dgrad, wgrad, dbias)


@linear_bwd.fake
def _(a):
    cfg, grads = QuantConfig.from_key(a.config), GemmGrads.from_key(a.grads)
    out_features = a.grad_out.shape[-1]
    leading = list(a.grad_out.shape[:-1])
    if a.parallel:
        leading[0] = tensor_parallel.decode(a.parallel).leading(leading[0], forward=False)
    return envelope.fake_results(
        a.grad_out,
        a.out_dtype,
        ([*leading, a.in_features], grads.dgrad),
        ([out_features, a.in_features], grads.wgrad and a.main_grad is None),
        ([out_features], gemm_layer.returns_dbias(cfg, grads.has_bias, grads.wgrad)),
    )


# ---- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, a, output) -> None:
    cfg = QuantConfig.from_key(a.config)
    ctx.a = envelope.ride_along(a)  # the scalars and the state backward mutates
    ctx.in_features = a.weight.shape[1]
    ctx.has_bias = a.bias is not None
    ctx.n_input_parts = columnwise_count(cfg) if a.save_input else 0
    ctx.mark_non_differentiable(*output[1:])
    saved = list(output[1 : len(output) - len(a.delayed_state[:1])])  # not the returned amaxes
    if cfg.fp8:
        if a.save_weight and a.weight_cache:
            saved += weight_cache_columnwise(a.weight_cache, cfg)
        ctx.save_for_backward(None, None, None, *saved)
    else:
        # The op's own inputs; the dtype cast is redone in backward (same bits, no copy kept).
        ctx.save_for_backward(
            a.inp if a.save_input else None, a.weight if a.save_weight else None, a.bias
        )


def _backward(ctx, grads):
    grad_out = grads[0]
    needs_dgrad, needs_wgrad, needs_dbias = ctx.needs_input_grad[:3]
    if grad_out is None or not (needs_dgrad or needs_wgrad or needs_dbias):
        return {}
    a = ctx.a
    inp, weight, bias, *parts = ctx.saved_tensors
    dgrad, wgrad, dbias = linear_bwd(
        grad_out,
        inp,
        weight,
        bias,
        parts,
        a.delayed_state[1:],  # the backward [scale, amax_history]
        a.main_grad,
        a.config,
        GemmGrads(ctx.has_bias, needs_dgrad, needs_wgrad, a.accumulate, ctx.n_input_parts).key,
        a.out_dtype,
        ctx.in_features,
        a.parallel,
    )
    return {
        "inp": dgrad if needs_dgrad else None,
        **single_gemm.weight_grads(a, ctx.has_bias, needs_wgrad, needs_dbias, wgrad, dbias),
    }


linear_fwd.autograd(_setup_context, _backward)
