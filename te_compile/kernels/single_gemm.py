"""What the ops of the one-GEMM modules (te.Linear, LayerNormLinear) share around the GEMM
layer (gemm_layer.py): the forward op's outputs and their fake twin, the backward op's GEMMs
with DelayedScaling's update, the weight gradients."""

from __future__ import annotations

import torch

from ..recipes import QuantConfig
from ..spec import GemmGrads
from .gemm_layer import (
    backward,
    backward_state,
    fake_saved_parts,
    forward,
    returns_dbias,
    update_backward_state,
)


def single_forward(
    x,
    weight,
    bias,
    cfg: QuantConfig,
    state,
    weight_cache,
    save_input,
    save_weight,
    *,
    out_dtype,
    like,
    head=(),
    tp=None,
) -> list[torch.Tensor]:
    """The forward op's outputs [out, *head, *saved parts, (amaxes)] around `forward`; `like`
    is the op's input (x's shape and device)."""
    out, saved = forward(
        x,
        weight,
        bias,
        cfg,
        state=state,
        weight_cache=weight_cache,
        save_input=save_input,
        save_weight=save_weight,
        out_dtype=out_dtype,
        x_shape=like.shape,
        device_index=like.device.index,
        tp=tp,
    )
    return [out, *head, *saved, *([state[1]] if state else [])]


def fake_single_forward(a, cfg: QuantConfig, out_dtype, *head, tp=None) -> list[torch.Tensor]:
    """`single_forward`'s fake twin from the op's arguments `a` (inp, weight, weight_cache,
    save_input, save_weight, delayed_state); `tp` the ParallelSpec or None."""
    leading = list(a.inp.shape[:-1])
    if tp is not None:
        leading[0] = tp.leading(leading[0], forward=True)
    out = a.inp.new_empty([*leading, a.weight.shape[0]], dtype=out_dtype)
    saved = fake_saved_parts(
        a.inp.shape,
        a.weight.shape,
        cfg,
        save_input=a.save_input,
        save_weight=a.save_weight,
        weight_cache=a.weight_cache,
        like=a.inp,
        tp=tp,
    )
    return [out, *head, *saved, *[torch.empty_like(s) for s in a.delayed_state[:1]]]


def single_backward(
    grad,
    cfg: QuantConfig,
    parts,
    bwd_state,
    grads: GemmGrads,
    *,
    hp_operands=(None, None, None),
    main_grad,
    out_dtype,
    grad_columnwise=None,
    tp=None,
):
    """`backward` of a one-GEMM op from its `parts` (the input's column-wise half first, then the
    weight's) and `bwd_state` ([scale, amax_history] or []), computing what `grads` asks, then
    DelayedScaling's backward update of that state (gemm_layer.update_backward_state). `hp_operands`: the forward's
    high-precision (x, weight, bias), read without FP8 only."""
    x, weight, bias = hp_operands
    result = backward(
        grad,
        cfg,
        grads,
        x=x,
        weight=weight,
        bias=bias,
        input_parts=parts[: grads.input_parts],
        weight_parts=parts[grads.input_parts :],
        state=backward_state(cfg, bwd_state),
        main_grad=main_grad,
        out_dtype=out_dtype,
        grad_columnwise=grad_columnwise,
        tp=tp,
    )
    update_backward_state(cfg, bwd_state)
    return result


def weight_grads(a, has_bias, needs_wgrad, needs_dbias, wgrad, dbias) -> dict:
    """Autograd's gradients of a one-GEMM op's `weight` and `bias` (`a`: what rode along)."""
    cfg = QuantConfig.from_key(a.config)
    return {
        # fuse_wgrad_accumulation: the gradient went into main_grad; the weight gets none.
        "weight": wgrad if needs_wgrad and a.main_grad is None else None,
        "bias": dbias if needs_dbias and returns_dbias(cfg, has_bias, needs_wgrad) else None,
    }
