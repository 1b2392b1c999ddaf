"""te.Linear's forward and backward as custom ops running TE's own kernels.

    te_compile::linear_fwd(inp, weight, bias?, fwd_state, bwd_state, weight_cache, main_grad?,
                           config, out_dtype, save_input, save_weight, accumulate)
        -> [out, *input_parts, *weight_parts] (+ [fwd_amax] with DelayedScaling)
    te_compile::linear_bwd(grad_out, inp?, weight?, bias?, input_parts, weight_parts,
                           bwd_scale!?, bwd_history!?, main_grad!?, config, out_dtype,
                           in_features, has_bias, needs_dgrad, needs_wgrad, accumulate)
        -> (dgrad, wgrad, dbias), each empty ([0]) when not computed (a mutating op may not
           return a list)
    te_compile::quantize_weight(weight, cache!, valid!, fwd_scale?, fwd_amax!?, config, refresh)

`config` is `QuantConfig.key` (one string, decoded by a cached lookup); `!` marks tensors
mutated in place: DelayedScaling's TE-owned scale and amax history, an FP8 weight cache,
`weight.main_grad` under fuse_wgrad_accumulation.

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

from ..recipes import QuantConfig
from . import gemm_layer, registry
from .fp8_operands import columnwise_count, weight_cache_columnwise, weight_cache_storage

# ---- forward -----------------------------------------------------------------------------------


def linear_fwd(
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fwd_state: list[torch.Tensor],
    bwd_state: list[torch.Tensor],
    weight_cache: list[torch.Tensor],
    main_grad: torch.Tensor | None,
    config: str,
    out_dtype: torch.dtype,
    save_input: bool,
    save_weight: bool,
    accumulate: bool,
) -> list[torch.Tensor]:
    """y = inp @ weight.T + bias, with FP8 operands when the config's kind is not "none".

    DelayedScaling only: `fwd_state` = [scale] (a snapshot of TE's `scale` of the forward
    slots); the op quantizes with those scales and returns this call's amaxes last, for the
    caller to max-merge into TE's history (row 0). `bwd_state` = [scale, amax_history] of the backward slots and `main_grad` (with
    `accumulate`, see linear_bwd) are unused here: they ride along to the backward op."""
    cfg = QuantConfig.from_key(config)
    state = gemm_layer.fresh_amax_state(fwd_state)
    out, saved = gemm_layer.forward(
        inp,
        weight,
        bias,
        cfg,
        state=state,
        weight_cache=weight_cache,
        save_input=save_input,
        save_weight=save_weight,
        out_dtype=out_dtype,
        x_shape=inp.shape,
        device_index=inp.device.index,
    )
    return [out, *saved, *([state[1]] if state else [])]


def _linear_fwd_fake(
    inp,
    weight,
    bias,
    fwd_state,
    bwd_state,
    weight_cache,
    main_grad,
    config,
    out_dtype,
    save_input,
    save_weight,
    accumulate,
):
    cfg = QuantConfig.from_key(config)
    out = inp.new_empty([*inp.shape[:-1], weight.shape[0]], dtype=out_dtype)
    saved = gemm_layer.fake_saved_parts(
        inp.shape,
        weight.shape,
        cfg,
        save_input=save_input,
        save_weight=save_weight,
        weight_cache=weight_cache,
        like=inp,
    )
    if fwd_state:
        saved.append(torch.empty_like(fwd_state[0]))
    return [out, *saved]


# ---- FP8 weight cache --------------------------------------------------------------------------


def quantize_weight(
    weight: torch.Tensor,
    cache: list[torch.Tensor],
    valid: torch.Tensor,
    fwd_scale: torch.Tensor | None,
    fwd_amax: torch.Tensor | None,
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


def _quantize_weight_fake(weight, cache, valid, fwd_scale, fwd_amax, config, refresh) -> None:
    return None


# ---- backward ----------------------------------------------------------------------------------


def linear_bwd(
    grad_out: torch.Tensor,
    inp: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    input_parts: list[torch.Tensor],
    weight_parts: list[torch.Tensor],
    bwd_scale: torch.Tensor | None,
    bwd_history: torch.Tensor | None,
    main_grad: torch.Tensor | None,
    config: str,
    out_dtype: torch.dtype,
    in_features: int,
    has_bias: bool,
    needs_dgrad: bool,
    needs_wgrad: bool,
    accumulate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of linear_fwd. Without FP8, `inp`/`weight`/`bias` are the forward inputs (the
    bias only flags the dbias fused into the wgrad GEMM); with FP8 they are None and the parts
    carry the operands. With `main_grad` (fuse_wgrad_accumulation) the wgrad GEMM writes into
    it, adding to its contents when `accumulate`, and the returned wgrad is empty."""
    cfg = QuantConfig.from_key(config)
    g = grad_out.reshape(-1, grad_out.shape[-1])
    if not g.is_contiguous():
        g = g.contiguous()
    # DelayedScaling: the latest amaxes are row 0 of the history
    state = [bwd_scale, bwd_history[0]] if cfg.fp8 and bwd_history is not None else None
    dgrad, wgrad, dbias = gemm_layer.backward(
        g,
        cfg,
        x=inp,
        weight=weight,
        bias=bias,
        input_parts=input_parts,
        weight_parts=weight_parts,
        state=state,
        main_grad=main_grad,
        out_dtype=out_dtype,
        has_bias=has_bias,
        needs_dgrad=needs_dgrad,
        needs_wgrad=needs_wgrad,
        accumulate=accumulate,
        device_index=grad_out.device.index,
    )
    if bwd_history is not None:
        gemm_layer.update_backward_state(bwd_scale, bwd_history, cfg)

    def none():  # a result not asked for (outputs of one op may not alias each other)
        return grad_out.new_empty([0], dtype=out_dtype)

    if dgrad is not None:
        dgrad = dgrad.view([*grad_out.shape[:-1], in_features])
    return (
        none() if dgrad is None else dgrad,
        none() if wgrad is None else wgrad,
        none() if dbias is None else dbias,
    )


def _linear_bwd_fake(
    grad_out,
    inp,
    weight,
    bias,
    input_parts,
    weight_parts,
    bwd_scale,
    bwd_history,
    main_grad,
    config,
    out_dtype,
    in_features,
    has_bias,
    needs_dgrad,
    needs_wgrad,
    accumulate,
):
    cfg = QuantConfig.from_key(config)
    out_features = grad_out.shape[-1]

    def empty(shape, wanted: bool):
        return grad_out.new_empty(shape if wanted else [0], dtype=out_dtype)

    return (
        empty([*grad_out.shape[:-1], in_features], needs_dgrad),
        empty([out_features, in_features], needs_wgrad and main_grad is None),
        empty([out_features], gemm_layer.returns_dbias(cfg, has_bias, needs_wgrad)),
    )


# ---- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    (
        inp,
        weight,
        bias,
        fwd_state,
        bwd_state,
        weight_cache,
        main_grad,
        config,
        out_dtype,
        save_input,
        save_weight,
        accumulate,
    ) = inputs
    cfg = QuantConfig.from_key(config)
    ctx.config = config
    ctx.n_fwd_state = len(fwd_state)
    ctx.n_weight_cache = len(weight_cache)
    # Mutable state rides on ctx, not save_for_backward: backward mutates it in place, which
    # the saved-tensor version check would reject.
    ctx.bwd_state = bwd_state
    ctx.main_grad = main_grad
    ctx.accumulate = accumulate
    ctx.out_dtype = out_dtype
    ctx.in_features = weight.shape[1]
    ctx.has_bias = bias is not None
    ctx.n_input_parts = columnwise_count(cfg) if save_input else 0
    ctx.mark_non_differentiable(*output[1:])
    saved = list(output[1 : len(output) - (1 if fwd_state else 0)])  # not the returned amaxes
    if cfg.fp8:
        if save_weight and weight_cache:
            saved += weight_cache_columnwise(weight_cache, cfg)
        ctx.save_for_backward(None, None, None, *saved)
    else:
        # The op's own inputs; the dtype cast is redone in backward (same bits, no copy kept).
        ctx.save_for_backward(
            inp if save_input else None,
            weight if save_weight else None,
            bias,
        )


def _no_grads(ctx) -> tuple:
    """None for every input after (inp, weight, bias); tensor-list inputs get lists of None."""
    return (
        [None] * ctx.n_fwd_state,
        [None] * len(ctx.bwd_state),
        [None] * ctx.n_weight_cache,
        None,  # main_grad
        None,  # config
        None,  # out_dtype
        None,  # save_input
        None,  # save_weight
        None,  # accumulate
    )


def _backward(ctx, grads):
    needs_dgrad, needs_wgrad, needs_dbias = ctx.needs_input_grad[:3]
    grad_out = grads[0]
    nones = _no_grads(ctx)
    if grad_out is None or not (needs_dgrad or needs_wgrad or needs_dbias):
        return None, None, None, *nones
    inp, weight, bias, *parts = ctx.saved_tensors
    n = ctx.n_input_parts
    dgrad, wgrad, dbias = torch.ops.te_compile.linear_bwd(
        grad_out,
        inp,
        weight,
        bias,
        parts[:n],
        parts[n:],
        *(ctx.bwd_state or [None, None]),
        ctx.main_grad,
        ctx.config,
        ctx.out_dtype,
        ctx.in_features,
        ctx.has_bias,
        needs_dgrad,
        needs_wgrad,
        ctx.accumulate,
    )
    cfg = QuantConfig.from_key(ctx.config)
    dgrad = dgrad if needs_dgrad else None
    # fuse_wgrad_accumulation: the gradient went into main_grad; the weight gets none.
    wgrad = wgrad if needs_wgrad and ctx.main_grad is None else None
    dbias = dbias if gemm_layer.returns_dbias(cfg, ctx.has_bias, needs_wgrad) else None
    return dgrad, wgrad, dbias if needs_dbias else None, *nones


# ---- registration ------------------------------------------------------------------------------

LINEAR_FWD = registry.define(
    "linear_fwd(Tensor inp, Tensor weight, Tensor? bias, Tensor[] fwd_state, "
    "Tensor[] bwd_state, Tensor[] weight_cache, Tensor? main_grad, str config, "
    "ScalarType out_dtype, bool save_input, bool save_weight, bool accumulate) -> Tensor[]",
    linear_fwd,
    _linear_fwd_fake,
)
registry.register_autograd(LINEAR_FWD, _backward, _setup_context)
LINEAR_BWD = registry.define(
    "linear_bwd(Tensor grad_out, Tensor? inp, Tensor? weight, Tensor? bias, "
    "Tensor[] input_parts, Tensor[] weight_parts, Tensor(a!)? bwd_scale, "
    "Tensor(b!)? bwd_history, Tensor(c!)? main_grad, str config, ScalarType out_dtype, "
    "int in_features, bool has_bias, bool needs_dgrad, bool needs_wgrad, bool accumulate) "
    "-> (Tensor, Tensor, Tensor)",
    linear_bwd,
    _linear_bwd_fake,
)
QUANTIZE_WEIGHT = registry.define(
    "quantize_weight(Tensor weight, Tensor(a!)[] cache, Tensor(b!) valid, Tensor? fwd_scale, "
    "Tensor(c!)? fwd_amax, str config, bool refresh) -> ()",
    quantize_weight,
    _quantize_weight_fake,
)
