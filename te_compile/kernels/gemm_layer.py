"""One GEMM layer, y = x @ W.T + b, forward and backward on TE's kernels: the code every
GEMM module's ops share (te.Linear, LayerNormLinear, LayerNormMLP's two GEMMs). One GEMM path
and one quantization core; module ops only add what runs around the GEMMs (norms,
activations).

- `quantize` / `bound_quantizer`: the cached TE quantizer of a role, bound to a module's
  DelayedScaling state for the call. `bound_quantizer` hands the quantizer to a fused TE kernel
  (norm + quantize, activation + quantize) that quantizes while it computes.
- `forward`: quantize input and weight (or take them already quantized: a fused kernel's
  output, an FP8 weight cache), run the forward GEMM, and return the column-wise halves
  backward will read as plain tensors (fp8_operands.py).
- `backward`: grad_output quantization with dbias, dgrad and wgrad GEMMs (into main_grad under
  fuse_wgrad_accumulation), from the saved parts; `update_backward_state` is DelayedScaling's
  backward amax/scale update of one module's state (deferred to the exit of an eager autocast).

Everything here runs inside real op kernels only; `fake_saved_parts` is the fake-kernel twin
of what `forward` saves. Arguments are those eager TE's `_linear_forward_impl` /
`_linear_backward_impl` pass to `general_gemm` (TE 2.20.2).
"""

from __future__ import annotations

import contextlib

import torch

from ..recipes import QuantConfig
from ..spec import GemmGrads
from . import extension, tensor_parallel
from .delayed_update import amax_and_scale_update
from .fp8_operands import (
    check_scale_layout,
    columnwise_parts,
    columnwise_storage,
    delayed_slot,
    fake_columnwise_parts,
    quantizer,
    weight_cache_storage,
)


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def fresh_amax_state(fwd_state: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """DelayedScaling's [scale, amax accumulator] for a forward op given `fwd_state` = [scale]:
    the quantizers max-accumulate this call's amaxes into zeros (amaxes are >= 0), and the
    caller merges them into TE's history. The op never reads the history, so a recompute of it
    (activation checkpointing) needs no tensor that the step later mutates."""
    if not fwd_state:
        return None
    return [fwd_state[0], torch.zeros_like(fwd_state[0])]


def is_te_storage(t) -> bool:
    """A bare TE storage (what internal quantizers return), not a torch.Tensor: an operand
    already quantized. (modules/gemm_common.is_quantized asks a different question: is a
    user-visible tensor a QuantizedTensor.)"""
    return not isinstance(t, torch.Tensor)


@contextlib.contextmanager
def bound_quantizer(
    cfg: QuantConfig,
    role: str,
    *,
    rowwise: bool,
    columnwise: bool,
    state,
    gemm: int = 0,
    weight_shape: tuple[int, ...] | None = None,
):
    """The cached TE quantizer for `role` (te.Linear's configuration), within the block bound to
    a module's DelayedScaling `state` = [scale, amax] (1-D over the role's direction's slots;
    None for other recipes). For fused TE kernels that take a quantizer (tex.layernorm_fwd,
    tex.gelu, ...): they quantize with exactly what `quantize` would use."""
    q = quantizer(cfg, role, rowwise=rowwise, columnwise=columnwise, weight_shape=weight_shape)
    if state is None:
        yield q
        return
    slot = delayed_slot(role, gemm)
    with extension.with_state(q, state[0][slot], state[1][slot : slot + 1]):
        yield q


def quantize(
    tensor,
    cfg: QuantConfig,
    role: str,
    rowwise: bool,
    columnwise: bool,
    state,
    *,
    gemm: int = 0,
    into=None,
    noop=None,
    bgrad=False,
):
    """Quantize `tensor` with the cached TE quantizer for `role` (into the storage `into`, or
    as (dbias, quantized) with `bgrad`). DelayedScaling passes `state` = [scale, amax] (see
    `bound_quantizer`); `gemm` picks the GEMM's slots in a module of several GEMMs."""
    shape = tuple(tensor.shape) if role == "weight" else None
    q = quantizer(cfg, role, rowwise=rowwise, columnwise=columnwise, weight_shape=shape)
    if state is None:
        return _run_quantize(tensor, q, into, noop, bgrad)
    slot = delayed_slot(role, gemm)
    with extension.with_state(q, state[0][slot], state[1][slot : slot + 1]):
        return _run_quantize(tensor, q, into, noop, bgrad)


def _run_quantize(tensor, q, into, noop, bgrad):
    if bgrad:
        return extension.bgrad_quantize(tensor, q)
    if into is not None:
        return extension.quantize_into(tensor, q, into, noop)
    return extension.quantize(tensor, q)


# ---- forward -----------------------------------------------------------------------------------


def forward(
    x,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: QuantConfig,
    *,
    state,
    weight_cache: list[torch.Tensor],
    save_input: bool,
    save_weight: bool,
    out_dtype: torch.dtype,
    x_shape,
    device_index: int,
    gemm: int = 0,
    tp=None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(y, saved parts). `x` is a high-precision tensor, or (FP8 configs) a TE storage already
    quantized for the input role, row-wise plus column-wise when `save_input` (the output of a
    fused norm or activation kernel run through `bound_quantizer`). `x_shape` is x's shape.

    FP8: `state` = [scale, amaxes] of the forward slots (DelayedScaling, else None; the caller
    returns the amaxes), `weight_cache` a filled FP8 weight cache or []. Saved: the column-wise
    half of x when `save_input` (wgrad), of the weight when `save_weight` and the weight is
    not cached (dgrad; a cached weight is saved from the cache). Without FP8 nothing is saved
    here: backward reads the high-precision operands. `tp`: the GEMM's ParallelSpec (or None);
    a gathered input saves its local shard's parts (tensor_parallel.local_parts)."""
    gathers = tp is not None and tp.gathers_input
    if not cfg.fp8:
        x = cast(x, out_dtype)
        out, _ = extension.gemm(
            cast(weight, out_dtype),
            tensor_parallel.gather(x, tp) if gathers else x,
            layout="TN",
            out_dtype=out_dtype,
            bias=cast(bias, out_dtype),
            split_accumulator=cfg.split_acc[0],
            device_index=device_index,
        )
        return tensor_parallel.reduce_output(out, tp), []
    saved = []
    if gathers:
        x, saved = _gathered_input(x, cfg, state, save_input, tp, gemm)
    elif not is_te_storage(x):
        # Column-wise halves are produced only when backward will read them, as in eager TE.
        x = quantize(x, cfg, "input", True, save_input, state, gemm=gemm)
    if weight_cache:
        w = weight_cache_storage(weight_cache, cfg, out_dtype)
    else:
        w = quantize(weight, cfg, "weight", True, save_weight, state, gemm=gemm)
    # cuBLAS has no FP8 GEMM with an FP32 bias: TE casts the bias to BF16 then.
    bias_dtype = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
    out, _ = extension.gemm(
        w,
        x,
        layout="TN",
        out_dtype=out_dtype,
        bias=cast(bias, bias_dtype),
        split_accumulator=cfg.split_acc[0],
        device_index=device_index,
    )
    if save_input and not gathers:
        check_scale_layout(x, cfg, "input", x_shape)
        saved += columnwise_parts(x, cfg)
    if save_weight and not weight_cache:
        check_scale_layout(w, cfg, "weight", weight.shape)
        saved += columnwise_parts(w, cfg)
    return tensor_parallel.reduce_output(out, tp), saved


def _gathered_input(x, cfg: QuantConfig, state, save_input: bool, tp, gemm: int):
    """Column-parallel sequence parallelism: x quantized on this rank (per-tensor: row-wise
    only, TE gathers no FP8 transpose; a TE storage is already quantized so, by a fused norm)
    and all-gathered in FP8; (whole x, the shard's saved parts)."""
    local = x
    if not is_te_storage(x):
        columnwise = save_input and not cfg.per_tensor
        with (
            bound_quantizer(
                cfg, "input", rowwise=True, columnwise=columnwise, state=state, gemm=gemm
            ) as q,
            tensor_parallel.amax_reduced(q, tp),
        ):
            local = extension.quantize(x, q)
    with bound_quantizer(cfg, "input", rowwise=True, columnwise=False, state=state, gemm=gemm) as q:
        total = tensor_parallel.gather(local, tp, q)
    return total, (tensor_parallel.local_parts(local, cfg) if save_input else [])


def fake_saved_parts(
    x_shape, weight_shape, cfg: QuantConfig, *, save_input, save_weight, weight_cache, like, tp=None
) -> list[torch.Tensor]:
    """Empty tensors shaped like `forward`'s saved parts (fake kernels)."""
    saved = []
    if cfg.fp8 and save_input and tp is not None and tp.gathers_input:
        saved += tensor_parallel.fake_local_parts(x_shape, cfg, like)
    elif cfg.fp8 and save_input:
        saved += fake_columnwise_parts(x_shape, cfg, "input", like)
    if cfg.fp8 and save_weight and not weight_cache:
        saved += fake_columnwise_parts(weight_shape, cfg, "weight", like)
    return saved


# ---- backward ----------------------------------------------------------------------------------


def returns_dbias(cfg: QuantConfig, has_bias: bool, needs_wgrad: bool) -> bool:
    """Whether backward computes a dbias. Without FP8, eager TE gets dbias from the wgrad
    GEMM's epilogue only: no wgrad, no dbias."""
    return has_bias and (cfg.fp8 or needs_wgrad)


def backward(
    grad,
    cfg: QuantConfig,
    grads: GemmGrads,
    *,
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    input_parts: list[torch.Tensor],
    weight_parts: list[torch.Tensor],
    state,
    main_grad: torch.Tensor | None,
    out_dtype: torch.dtype,
    gemm: int = 0,
    dbias: torch.Tensor | None = None,
    grad_columnwise: bool | None = None,
    tp=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dgrad [M, in], wgrad, dbias) of `forward`; None for what is not computed (`grads`:
    whether there is a bias, dgrad and wgrad wanted, wgrad accumulated into main_grad).

    `grad` is grad_output as a 2-D contiguous high-precision tensor, or (FP8) a TE storage
    already quantized for the grad role, both halves, with its `dbias` (a fused dact+quantize
    kernel's output). Without FP8, `x`/`weight`/`bias` are the forward's high-precision
    operands (the bias only flags the dbias fused into the wgrad GEMM); with FP8 the saved
    parts carry the operands. DelayedScaling: `state` = [scale, latest amaxes] of the backward
    slots. With `main_grad` (fuse_wgrad_accumulation) the wgrad GEMM writes into it, adding
    to its contents when `accumulate`, and the returned wgrad is None. `grad_columnwise`
    overrides te.Linear's rule for quantizing grad_output's column-wise half (only with a
    bias or wgrad); LayerNormLinear always asks for both halves. `tp`: the forward's
    ParallelSpec; dgrad comes back reduced over its group (local rows under sequence
    parallelism)."""
    has_bias, needs_dgrad, needs_wgrad = grads.has_bias, grads.dgrad, grads.wgrad
    device_index = grad.device.index
    gathers_input = tp is not None and tp.gathers_input and needs_wgrad
    if cfg.fp8:
        if tp is not None and tp.gathers_grad:
            columnwise = has_bias or needs_wgrad if grad_columnwise is None else grad_columnwise
            grad, dbias = _gathered_grad(grad, cfg, has_bias, columnwise, state, tp, gemm)
        elif not is_te_storage(grad):
            grad, dbias = quantize_grad_output(
                grad, cfg, has_bias, needs_wgrad, state, gemm=gemm, columnwise=grad_columnwise
            )
        w = columnwise_storage(weight_parts, cfg, "weight", out_dtype) if needs_dgrad else None
        if gathers_input:
            x = tensor_parallel.gathered_wgrad_input(input_parts, cfg, tp, out_dtype)
        elif needs_wgrad:
            x = columnwise_storage(input_parts, cfg, "input", out_dtype)
        wgrad_bias = None
    else:
        w, x = cast(weight, out_dtype), cast(x, out_dtype)
        if tp is not None and tp.gathers_grad:
            grad = tensor_parallel.gather(grad, tp)
        x = tensor_parallel.gather(x, tp) if gathers_input else x
        wgrad_bias = cast(bias, out_dtype)  # with grad=True only a flag: dbias comes back
    dgrad = wgrad = None
    if needs_dgrad:
        dgrad, _ = extension.gemm(
            w,
            grad,
            layout="NN",
            grad=True,
            out_dtype=out_dtype,
            split_accumulator=cfg.split_acc[1],
            device_index=device_index,
        )
    if needs_wgrad:
        into_main_grad = main_grad is not None
        result, gemm_dbias = extension.gemm(
            x,
            grad,
            layout="NT",
            grad=True,
            out_dtype=main_grad.dtype if into_main_grad else out_dtype,
            bias=wgrad_bias,
            split_accumulator=cfg.split_acc[2],
            out=main_grad,
            accumulate=into_main_grad and grads.accumulate,
            device_index=device_index,
        )
        if not into_main_grad:
            wgrad = result
        if dbias is None:
            dbias = gemm_dbias
    if not returns_dbias(cfg, has_bias, needs_wgrad):
        dbias = None
    return tensor_parallel.reduce_dgrad(dgrad, tp), wgrad, dbias


def _gathered_grad(g, cfg: QuantConfig, has_bias: bool, columnwise: bool, state, tp, gemm):
    """Row-parallel sequence parallelism: grad_output quantized on this rank (current
    scaling: amax reduced over the group) and all-gathered in FP8, dbias summed unfused over
    the local rows first (TE's grad_output_preprocess)."""
    dbias = g.sum(dim=0) if has_bias else None
    with (
        bound_quantizer(
            cfg, "grad", rowwise=True, columnwise=columnwise, state=state, gemm=gemm
        ) as q,
        tensor_parallel.amax_reduced(q, tp),
    ):
        return tensor_parallel.gather(g, tp, q), dbias


def quantize_grad_output(
    g, cfg: QuantConfig, has_bias: bool, needs_wgrad: bool, state, gemm=0, columnwise=None
):
    """(quantized grad_output, dbias or None) as TE's grad_output_preprocess: both halves
    (dgrad reads row-wise, wgrad column-wise), dbias fused into the cast where TE fuses it.
    `columnwise` None: te.Linear's rule (column-wise only with a bias or wgrad)."""
    if columnwise is None:
        columnwise = has_bias or needs_wgrad
    if not has_bias:
        return quantize(g, cfg, "grad", True, columnwise, state, gemm=gemm), None
    if cfg.kind == "block":
        # TE sums dbias unfused for block scaling, before the cast: the sum's scratch (132 MiB
        # for a [8192, 8192] gradient on an H100) is gone before the two FP8 halves exist.
        dbias = g.sum(dim=0)
        return quantize(g, cfg, "grad", True, columnwise, state, gemm=gemm), dbias
    # As grad_output_preprocess: bgrad_quantize fuses dbias into the cast for per-tensor FP8
    # (SM >= 10.0 or both usages) and MXFP8 (nvte_quantize_dbias); for NVFP4 it sums in high
    # precision, then quantizes (TE's bias.cpp).
    dbias, g_fp8 = quantize(g, cfg, "grad", True, columnwise, state, gemm=gemm, bgrad=True)
    return g_fp8, dbias


def backward_state(cfg: QuantConfig, bwd_state: list):
    """DelayedScaling's [scale, latest amaxes] of the backward slots (row 0 of the history),
    from a backward op's `bwd_state` = [scale, amax_history] (empty for other recipes)."""
    return [bwd_state[0], bwd_state[1][0]] if cfg.fp8 and bwd_state else None


def update_backward_state(cfg: QuantConfig, bwd_state: list) -> None:
    """DelayedScaling's backward amax/scale update of one module's state, at the end of its
    backward op. Under an eager autocast the grad_output cast's amax merge into history row 0
    is all, and the autocast's next exit updates every state at once
    (QuantConfig.defers_backward_update)."""
    if not bwd_state or cfg.defers_backward_update:
        return
    amax_and_scale_update(
        [bwd_state[1]],
        [bwd_state[0]],
        cfg.amax_algo,
        cfg.dtypes[2],
        cfg.margin,
        cfg.fused_update,
        reduce_group=cfg.amax_group,
    )
