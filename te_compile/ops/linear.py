"""te.Linear's forward and backward as custom ops running TE's own kernels.

    te_compile::linear_fwd(inp, weight, bias?, out_dtype, save_input, save_weight, *quant)
        -> [out, *input_parts, *weight_parts]
    te_compile::linear_bwd(grad_out, inp?, weight?, bias?, has_bias, input_parts, weight_parts,
                           out_dtype, in_features, needs_dgrad, needs_wgrad, *quant)
        -> [dgrad if needs_dgrad] + [wgrad if needs_wgrad] + [dbias if computed]

`*quant` is `QuantConfig.op_args()`. With FP8, forward also returns what backward needs as
plain tensors (the column-wise half of the quantized input, when wgrad is needed, and of the
quantized weight, when dgrad is needed; see fp8_operands.py), exactly the halves eager TE keeps.
Without FP8, the saved tensors are the op's own inputs. The GEMM calls pass the arguments
eager TE's `_linear_forward_impl`/`_linear_backward_impl` pass (TE 2.20.2).
"""

from __future__ import annotations

import torch

from ..recipes import QuantConfig
from .fp8_operands import (
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
    kind: str,
    dtypes: str,
    pow2: list[bool],
    amax_eps: list[float],
    block_dims: list[int],
    split_acc: list[bool],
    fp8_transpose: bool,
) -> list[torch.Tensor]:
    """y = inp @ weight.T + bias, with FP8 operands when `kind` is not "none"."""
    cfg = QuantConfig.from_op_args(
        kind, dtypes, pow2, amax_eps, block_dims, split_acc, fp8_transpose
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
    x = make_quantizer(cfg, "input", rowwise=True, columnwise=save_input)(inp)
    w = make_quantizer(cfg, "weight", rowwise=True, columnwise=save_weight)(weight)
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
        x.update_usage(rowwise_usage=False, columnwise_usage=True)  # row-wise is dead now
        saved += columnwise_parts(x, cfg)
    if save_weight:
        saved += columnwise_parts(w, cfg)
    return [out, *saved]


@linear_fwd.register_fake
def _(inp, weight, bias, out_dtype, save_input, save_weight, *quant):
    cfg = QuantConfig.from_op_args(*quant)
    out = inp.new_empty([*inp.shape[:-1], weight.shape[0]], dtype=out_dtype)
    saved = []
    if cfg.fp8 and save_input:
        saved += fake_columnwise_parts(inp.shape, cfg, "input", inp)
    if cfg.fp8 and save_weight:
        saved += fake_columnwise_parts(weight.shape, cfg, "weight", inp)
    return [out, *saved]


# ---- backward ----------------------------------------------------------------------------------


def _returns_dbias(cfg: QuantConfig, has_bias: bool, needs_wgrad: bool) -> bool:
    # Without FP8, eager TE gets dbias from the wgrad GEMM's epilogue only: no wgrad, no dbias.
    return has_bias and (cfg.fp8 or needs_wgrad)


@torch.library.custom_op("te_compile::linear_bwd", mutates_args=())
def linear_bwd(
    grad_out: torch.Tensor,
    inp: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    has_bias: bool,
    input_parts: list[torch.Tensor],
    weight_parts: list[torch.Tensor],
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
) -> list[torch.Tensor]:
    """Gradients of linear_fwd. Without FP8, `inp`/`weight`/`bias` are the forward inputs (the
    bias only flags the dbias fused into the wgrad GEMM); with FP8 they are None and the parts
    carry the operands."""
    cfg = QuantConfig.from_op_args(
        kind, dtypes, pow2, amax_eps, block_dims, split_acc, fp8_transpose
    )
    in_shape = [*grad_out.shape[:-1], in_features]
    g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
    if cfg.fp8:
        g, dbias = _quantize_grad_output(g, cfg, has_bias, needs_wgrad)
        w = columnwise_storage(weight_parts, cfg, "weight", out_dtype) if needs_dgrad else None
        x = columnwise_storage(input_parts, cfg, "input", out_dtype) if needs_wgrad else None
        wgrad_bias = None
    else:
        dbias = None
        w, x = _cast(weight, out_dtype), _cast(inp, out_dtype)
        wgrad_bias = _cast(bias, out_dtype)  # with grad=True only a flag: dbias comes back
    grads = []
    if needs_dgrad:
        dgrad, *_ = _gemm(
            w,
            g,
            layout="NN",
            grad=True,
            out_dtype=out_dtype,
            use_split_accumulator=cfg.split_acc[1],
        )
        grads.append(dgrad.view(in_shape))
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
        grads.append(wgrad)
        if dbias is None:
            dbias = gemm_dbias
    if _returns_dbias(cfg, has_bias, needs_wgrad):
        grads.append(dbias)
    return grads


def _quantize_grad_output(g, cfg: QuantConfig, has_bias: bool, needs_wgrad: bool):
    """grad_output quantization as TE's grad_output_preprocess does it: both halves (dgrad
    reads row-wise, wgrad column-wise), dbias fused into the cast where TE fuses it."""
    q = make_quantizer(cfg, "grad", rowwise=True, columnwise=has_bias or needs_wgrad)
    if not has_bias:
        return q(g), None
    if cfg.kind == "block":  # TE runs dbias unfused for block scaling
        return q(g), g.view(-1, g.shape[-1]).sum(dim=0)
    import transformer_engine_torch as tex

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
    out_dtype,
    in_features,
    needs_dgrad,
    needs_wgrad,
    *quant,
):
    cfg = QuantConfig.from_op_args(*quant)
    out_features = grad_out.shape[-1]
    grads = []
    if needs_dgrad:
        grads.append(grad_out.new_empty([*grad_out.shape[:-1], in_features], dtype=out_dtype))
    if needs_wgrad:
        grads.append(grad_out.new_empty([out_features, in_features], dtype=out_dtype))
    if _returns_dbias(cfg, has_bias, needs_wgrad):
        grads.append(grad_out.new_empty([out_features], dtype=out_dtype))
    return grads


# ---- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, weight, bias, out_dtype, save_input, save_weight, *quant = inputs
    cfg = QuantConfig.from_op_args(*quant)
    ctx.quant = quant
    ctx.out_dtype = out_dtype
    ctx.in_features = weight.shape[1]
    ctx.has_bias = bias is not None
    ctx.n_input_parts = columnwise_count(cfg) if save_input else 0
    saved = output[1:]
    ctx.mark_non_differentiable(*saved)
    if cfg.fp8:
        ctx.save_for_backward(None, None, None, *saved)
    else:
        # The op's own inputs; the dtype cast is redone in backward (same bits, no copy kept).
        ctx.save_for_backward(
            inp if save_input else None,
            weight if save_weight else None,
            bias,
        )


def _backward(ctx, grads):
    needs_dgrad, needs_wgrad, needs_dbias = ctx.needs_input_grad[:3]
    grad_out = grads[0]
    nones = [None] * (len(ctx.needs_input_grad) - 3)
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
        ctx.out_dtype,
        ctx.in_features,
        needs_dgrad,
        needs_wgrad,
        *ctx.quant,
    )
    it = iter(result)
    dgrad = next(it) if needs_dgrad else None
    wgrad = next(it) if needs_wgrad else None
    dbias = next(it, None) if ctx.has_bias else None
    return dgrad, wgrad, dbias if needs_dbias else None, *nones


linear_fwd.register_autograd(_backward, setup_context=_setup_context)
