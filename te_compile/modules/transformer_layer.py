"""te.TransformerLayer under compile: its residual stream rounded where eager TE stores it.

Eager TE stores each bias-dropout-add's output in the layer's dtype (TE's `jit_fuser` compiles
the add on its own), and autograd stores the sum of the gradients that reach that output (the
next residual add's and the next block's) before TE's compiled add reads it in backward.
Compiled whole, inductor fuses that sum into its consumers (the bias gradient's reduction, the
gradient of the layer's input) and, under its default settings, keeps it in float32: a GPT
parted from eager TE at its first backward on either path, bf16 too (session 20,
docs/graph_fp8.md). Here both the value and its gradient are rounded as a store would round
them (graph_fp8.quantize.stored_bf16's bit arithmetic, which inductor keeps), so they hold under
inductor's defaults; under `emulate_precision_casts` they change nothing. bf16 layers only: an
fp16 or fp32 layer's adds pass as they are.

The dropout's gradient too (session 50): eager TE's compiled add returns it stored in bf16 and
sums that for the bias gradient. Compiled whole, it has two readers (the bias gradient's sum and
the module's backward op), and a process's first inductor compile recomputes it in float32
inside the sum while later compiles store it first (docs/graph_fp8.md, "Why the first compile in
a process differs"), so the first compile's bias gradient was 1 ulp off eager TE's. The bias is
added here, before TE's unfused add (the same arithmetic as its fused one), through an identity
that rounds the gradient as stored, where a dropout or drop path changes it (otherwise it is the
output's gradient, rounded already).
"""

from __future__ import annotations

import torch

from ..graph_fp8.quantize import stored_bf16
from ..patching import Swap


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    return stored_bf16(t).to(torch.bfloat16)


class StoredAsEager(torch.autograd.Function):
    """Identity that rounds its bf16 value in forward and its gradient in backward, where eager
    TE's tensors are stored."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _as_stored(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _as_stored(grad)


class GradientStoredAsEager(torch.autograd.Function):
    """Identity in value whose gradient is rounded as eager TE stores it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _as_stored(grad)


def make_bias_dropout_add(original):
    def _bias_dropout_add(self, hidden_state, bias, residual, drop_path=None):
        if not (torch.compiler.is_compiling() and hidden_state.dtype == torch.bfloat16):
            return original(self, hidden_state, bias, residual, drop_path)
        if bias is not None and bias.numel() != 0:
            biased = hidden_state + bias
            # not where a float32 bias promotes the sum, nor where the gradient is the
            # output's, rounded below already
            if biased.dtype == torch.bfloat16 and not _output_gradient(self, residual, drop_path):
                biased = GradientStoredAsEager.apply(biased)
            hidden_state, bias = biased, None  # TE's unfused path: dropout, drop_path, residual
        out = original(self, hidden_state, bias, residual, drop_path)
        return StoredAsEager.apply(out) if out.dtype == torch.bfloat16 else out

    _bias_dropout_add.__doc__ = original.__doc__
    return _bias_dropout_add


def _output_gradient(layer, residual, drop_path) -> bool:
    """Whether the gradient reaching the bias is the bf16 output's (rounded by StoredAsEager's
    backward): no dropout mask drawn, no drop path, a bf16 residual. Rounding it twice changes
    no bit, and the second rounding's longer chain made inductor store that gradient in float32
    for the bias gradient's reduction, which its peak-memory reordering then moved past the
    attention's backward: +256 MiB at TE's guide layer (session 54)."""
    drops = layer.training and layer.hidden_dropout > 0
    return drop_path is None and not drops and residual.dtype == torch.bfloat16


def swaps() -> list[Swap]:
    from transformer_engine.pytorch.transformer import TransformerLayer

    bda = make_bias_dropout_add(vars(TransformerLayer)["_bias_dropout_add"])
    return [Swap(TransformerLayer, "_bias_dropout_add", bda)]
