"""te.Linear's forward and backward as custom ops running TE's own kernels.

    te_compile::linear_fwd(inp, weight, bias?, out_dtype, save_input, save_weight,
                           fwd_state, bwd_state, bwd_update, *quant)
        -> [out, *input_parts, *weight_parts] (+ [fwd_amax] with DelayedScaling)
    te_compile::linear_bwd(grad_out, inp?, weight?, bias?, has_bias, input_parts, weight_parts,
                           bwd_scale!?, bwd_history!?, bwd_update, out_dtype, in_features, needs_dgrad,
                           needs_wgrad, *quant)
        -> (dgrad, wgrad, dbias), each empty ([0]) when not computed (a mutating op may not
           return a list)

`*quant` is `QuantConfig.op_args()`; `!` marks state mutated in place (DelayedScaling's
TE-owned scale and amax-history tensors; empty lists for other recipes). linear_fwd carries an
autograd formula, so it may not mutate: it returns the new forward amaxes for the caller to
write back. With FP8, forward also returns what backward needs as
plain tensors (the column-wise half of the quantized input, when wgrad is needed, and of the
quantized weight, when dgrad is needed; see fp8_operands.py): the halves the backward GEMMs
read (eager TE keeps the input's column-wise half only, but the whole quantized weight).
Without FP8, the saved tensors are the op's own inputs. The GEMM calls pass the arguments
eager TE's `_linear_forward_impl`/`_linear_backward_impl` pass (TE 2.20.2).
"""

from __future__ import annotations

import torch

from ..recipes import QuantConfig
from .delayed_scaling import update_amax_and_scale
from .fp8_operands import (
    check_scale_layout,
    columnwise_count,
    columnwise_parts,
    columnwise_storage,
    fake_columnwise_parts,
    make_quantizer,
)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _gemm(*args, **kwargs):
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    return general_gemm(*args, **kwargs)


# ---- forward -----------------------------------------------------------------------------------


@torch.library.custom_op("te_compile::linear_fwd", mutates_args=())
def linear_fwd(
    inp: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    save_input: bool,
    save_weight: bool,
    fwd_state: list[torch.Tensor],
    bwd_state: list[torch.Tensor],
    bwd_update: str,
    kind: str,
    dtypes: str,
    pow2: list[bool],
    amax_eps: list[float],
    block_dims: list[int],
    split_acc: list[bool],
    fp8_transpose: bool,
    rht: list[bool],
    stochastic_rounding: list[bool],
) -> list[torch.Tensor]:
    """y = inp @ weight.T + bias, with FP8 operands when `kind` is not "none".

    DelayedScaling only: `fwd_state` = [scale, latest amaxes] (TE's `scale` and
    `amax_history[0]` of the forward slots); the op quantizes with those scales, max-accumulates
    into a copy of the amaxes and returns it last, for the caller to write back into the
    history. `bwd_state` = [scale, amax_history] of the backward slots, unused here but handed to
    the backward op, which mutates it and runs the backward amax/scale update described by
    `bwd_update` ("" for none, else "algo,margin,fused"; see `parse_update`)."""
    cfg = QuantConfig.from_op_args(
        kind,
        dtypes,
        pow2,
        amax_eps,
        block_dims,
        split_acc,
        fp8_transpose,
        rht,
        stochastic_rounding,
    )
    if not cfg.fp8:
        out, *_ = _gemm(
            _cast(weight, out_dtype),
            _cast(inp, out_dtype),
            out_dtype=out_dtype,
            bias=_cast(bias, out_dtype),
            use_split_accumulator=cfg.split_acc[0],
        )
        return [out]
    # Column-wise halves are produced only when backward will read them, as in eager TE.
    state = [fwd_state[0], fwd_state[1].clone()] if fwd_state else None
    x = make_quantizer(cfg, "input", rowwise=True, columnwise=save_input, state=state)(inp)
    w = make_quantizer(
        cfg, "weight", rowwise=True, columnwise=save_weight, state=state, weight=weight
    )(weight)
    # cuBLAS has no FP8 GEMM with an FP32 bias: TE casts the bias to BF16 then.
    bias_dtype = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
    out, *_ = _gemm(
        w,
        x,
        out_dtype=out_dtype,
        bias=_cast(bias, bias_dtype),
        use_split_accumulator=cfg.split_acc[0],
    )
    saved = []
    if save_input:
        check_scale_layout(x, cfg, "input", inp.shape)
        x.update_usage(rowwise_usage=False, columnwise_usage=True)  # row-wise is dead now
        saved += columnwise_parts(x, cfg)
    if save_weight:
        check_scale_layout(w, cfg, "weight", weight.shape)
        saved += columnwise_parts(w, cfg)
    return [out, *saved, *([state[1]] if state else [])]


@linear_fwd.register_fake
def _(
    inp, weight, bias, out_dtype, save_input, save_weight, fwd_state, bwd_state, bwd_update, *quant
):
    cfg = QuantConfig.from_op_args(*quant)
    out = inp.new_empty([*inp.shape[:-1], weight.shape[0]], dtype=out_dtype)
    saved = []
    if cfg.fp8 and save_input:
        saved += fake_columnwise_parts(inp.shape, cfg, "input", inp)
    if cfg.fp8 and save_weight:
        saved += fake_columnwise_parts(weight.shape, cfg, "weight", inp)
    if fwd_state:
        saved.append(torch.empty_like(fwd_state[1]))
    return [out, *saved]


# ---- backward ----------------------------------------------------------------------------------


def _returns_dbias(cfg: QuantConfig, has_bias: bool, needs_wgrad: bool) -> bool:
    # Without FP8, eager TE gets dbias from the wgrad GEMM's epilogue only: no wgrad, no dbias.
    return has_bias and (cfg.fp8 or needs_wgrad)


def make_update(amax_compute_algo: str, margin: float, fused: bool) -> str:
    """The backward amax/scale update spec `linear_fwd` carries to `linear_bwd` (plain string:
    op schemas have no records)."""
    return f"{amax_compute_algo},{float(margin)!r},{int(fused)}"


def parse_update(spec: str) -> tuple[str, float, bool]:
    algo, margin, fused = spec.split(",")
    return algo, float(margin), bool(int(fused))


@torch.library.custom_op("te_compile::linear_bwd", mutates_args=("bwd_scale", "bwd_history"))
def linear_bwd(
    grad_out: torch.Tensor,
    inp: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    has_bias: bool,
    input_parts: list[torch.Tensor],
    weight_parts: list[torch.Tensor],
    bwd_scale: torch.Tensor | None,
    bwd_history: torch.Tensor | None,
    bwd_update: str,
    out_dtype: torch.dtype,
    in_features: int,
    needs_dgrad: bool,
    needs_wgrad: bool,
    kind: str,
    dtypes: str,
    pow2: list[bool],
    amax_eps: list[float],
    block_dims: list[int],
    split_acc: list[bool],
    fp8_transpose: bool,
    rht: list[bool],
    stochastic_rounding: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of linear_fwd. Without FP8, `inp`/`weight`/`bias` are the forward inputs (the
    bias only flags the dbias fused into the wgrad GEMM); with FP8 they are None and the parts
    carry the operands."""
    cfg = QuantConfig.from_op_args(
        kind,
        dtypes,
        pow2,
        amax_eps,
        block_dims,
        split_acc,
        fp8_transpose,
        rht,
        stochastic_rounding,
    )
    in_shape = [*grad_out.shape[:-1], in_features]
    g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
    if cfg.fp8:
        # DelayedScaling: the latest amaxes are row 0 of the history
        state = [bwd_scale, bwd_history[0]] if bwd_history is not None else None
        g, dbias = _quantize_grad_output(g, cfg, has_bias, needs_wgrad, state)
        w = columnwise_storage(weight_parts, cfg, "weight", out_dtype) if needs_dgrad else None
        x = columnwise_storage(input_parts, cfg, "input", out_dtype) if needs_wgrad else None
        wgrad_bias = None
    else:
        dbias = None
        w, x = _cast(weight, out_dtype), _cast(inp, out_dtype)
        wgrad_bias = _cast(bias, out_dtype)  # with grad=True only a flag: dbias comes back

    def none():  # a result not asked for (outputs of one op may not alias each other)
        return grad_out.new_empty([0], dtype=out_dtype)

    dgrad, wgrad = none(), none()
    if needs_dgrad:
        dgrad, *_ = _gemm(
            w,
            g,
            layout="NN",
            grad=True,
            out_dtype=out_dtype,
            use_split_accumulator=cfg.split_acc[1],
        )
        dgrad = dgrad.view(in_shape)
    if needs_wgrad:
        wgrad, gemm_dbias, *_ = _gemm(
            x,
            g,
            layout="NT",
            grad=True,
            out_dtype=out_dtype,
            bias=wgrad_bias,
            use_split_accumulator=cfg.split_acc[2],
        )
        if dbias is None:
            dbias = gemm_dbias
    if not _returns_dbias(cfg, has_bias, needs_wgrad):
        dbias = none()
    if bwd_update:
        # Eager TE updates every registered backward state once, at the end of the first FP8
        # module's backward; per (history, scale) pair that is this update at the end of the
        # module's own backward (see docs/architecture.md for when the two differ).
        algo, margin, fused = parse_update(bwd_update)
        update_amax_and_scale([bwd_history], [bwd_scale], algo, cfg.dtypes[2], margin, fused)
    return dgrad, wgrad, dbias


def _quantize_grad_output(g, cfg: QuantConfig, has_bias: bool, needs_wgrad: bool, state):
    """grad_output quantization as TE's grad_output_preprocess does it: both halves (dgrad
    reads row-wise, wgrad column-wise), dbias fused into the cast where TE fuses it."""
    q = make_quantizer(cfg, "grad", rowwise=True, columnwise=has_bias or needs_wgrad, state=state)
    if not has_bias:
        return q(g), None
    if cfg.kind == "block":  # TE runs dbias unfused for block scaling
        return q(g), g.view(-1, g.shape[-1]).sum(dim=0)
    import transformer_engine_torch as tex

    # As grad_output_preprocess (base.py:1774-1786): bgrad_quantize fuses dbias into the cast
    # for per-tensor FP8 (SM >= 10.0 or both usages) and MXFP8 (nvte_quantize_dbias); for NVFP4
    # it sums in high precision, then quantizes (bias.cpp:58-79).
    dbias, g_fp8 = tex.bgrad_quantize(g, q)
    return g_fp8, dbias


@linear_bwd.register_fake
def _(
    grad_out,
    inp,
    weight,
    bias,
    has_bias,
    input_parts,
    weight_parts,
    bwd_scale,
    bwd_history,
    bwd_update,
    out_dtype,
    in_features,
    needs_dgrad,
    needs_wgrad,
    *quant,
):
    cfg = QuantConfig.from_op_args(*quant)
    out_features = grad_out.shape[-1]

    def empty(shape, wanted: bool):
        return grad_out.new_empty(shape if wanted else [0], dtype=out_dtype)

    return (
        empty([*grad_out.shape[:-1], in_features], needs_dgrad),
        empty([out_features, in_features], needs_wgrad),
        empty([out_features], _returns_dbias(cfg, has_bias, needs_wgrad)),
    )


# ---- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, weight, bias, out_dtype, save_input, save_weight, fwd_state, bwd_state, bwd_update = (
        inputs[:9]
    )
    quant = inputs[9:]
    cfg = QuantConfig.from_op_args(*quant)
    ctx.quant = quant
    ctx.n_fwd_state = len(fwd_state)
    # Mutable state rides on ctx, not save_for_backward: backward mutates it in place, which
    # the saved-tensor version check would reject.
    ctx.bwd_state = bwd_state
    ctx.bwd_update = bwd_update
    ctx.out_dtype = out_dtype
    ctx.in_features = weight.shape[1]
    ctx.has_bias = bias is not None
    ctx.n_input_parts = columnwise_count(cfg) if save_input else 0
    ctx.mark_non_differentiable(*output[1:])
    saved = output[1 : len(output) - (1 if fwd_state else 0)]  # not the returned amaxes
    if cfg.fp8:
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
        None,  # out_dtype
        None,  # save_input
        None,  # save_weight
        [None] * ctx.n_fwd_state,
        [None] * len(ctx.bwd_state),
        None,  # bwd_update
        *[None] * len(ctx.quant),
    )


def _backward(ctx, grads):
    needs_dgrad, needs_wgrad, needs_dbias = ctx.needs_input_grad[:3]
    grad_out = grads[0]
    nones = _no_grads(ctx)
    if grad_out is None or not (needs_dgrad or needs_wgrad or needs_dbias):
        return None, None, None, *nones
    inp, weight, bias, *parts = ctx.saved_tensors
    n = ctx.n_input_parts
    result = torch.ops.te_compile.linear_bwd(
        grad_out,
        inp,
        weight,
        bias,
        ctx.has_bias,
        parts[:n],
        parts[n:],
        *(ctx.bwd_state or [None, None]),
        ctx.bwd_update,
        ctx.out_dtype,
        ctx.in_features,
        needs_dgrad,
        needs_wgrad,
        *ctx.quant,
    )
    dgrad, wgrad, dbias = result
    dgrad = dgrad if needs_dgrad else None
    wgrad = wgrad if needs_wgrad else None
    cfg = QuantConfig.from_op_args(*ctx.quant)
    dbias = dbias if _returns_dbias(cfg, ctx.has_bias, needs_wgrad) else None
    return dgrad, wgrad, dbias if needs_dbias else None, *nones


linear_fwd.register_autograd(_backward, setup_context=_setup_context)
