"""TE's fused rotary position embedding kernels (FusedRoPEFunc) as custom ops.

    te_compile::fused_rope_fwd(t, freqs, start_positions?, cu_seqlens?, tensor_format,
                               interleaved, cp_size, cp_rank) -> out
    te_compile::fused_rope_bwd(grad, freqs, start_positions?, cu_seqlens?, <same>) -> grad_in

The kernels are tex.fused_rope_forward / fused_rope_backward with the arguments eager TE's
FusedRoPEFunc passes (freqs in float32, as FusedRoPEFunc casts them). Both return a new
contiguous tensor of the input's shape (TE's C++ allocates `at::empty(input.sizes())`).
"""

from __future__ import annotations

import torch

from . import core, registry

FORMATS = ("sbhd", "bshd", "thd")


def _qkv_format(tensor_format: str):
    from transformer_engine.pytorch.cpp_extensions.fused_attn import QKVFormat

    return QKVFormat[tensor_format]


def _rope_kernel(fn_name: str):
    def kernel(t, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size, rank):
        fn = getattr(core.tex(), fn_name)
        return fn(
            t,
            freqs,
            start_positions,
            _qkv_format(tensor_format),
            interleaved,
            cu_seqlens,
            cp_size,
            rank,
        )

    return kernel


def _rope_fake(t, *_args):
    return t.new_empty(t.shape)


_ARGS = (
    "Tensor freqs, Tensor? start_positions, Tensor? cu_seqlens, str tensor_format, "
    "bool interleaved, int cp_size, int cp_rank"
)
FUSED_ROPE_FWD = registry.define(
    f"fused_rope_fwd(Tensor t, {_ARGS}) -> Tensor", _rope_kernel("fused_rope_forward"), _rope_fake
)
FUSED_ROPE_BWD = registry.define(
    f"fused_rope_bwd(Tensor grad, {_ARGS}) -> Tensor",
    _rope_kernel("fused_rope_backward"),
    _rope_fake,
)


def _setup_context(ctx, inputs, output) -> None:
    t, freqs, start_positions, cu_seqlens, *config = inputs
    ctx.save_for_backward(freqs, start_positions, cu_seqlens)
    ctx.config = config


def _backward(ctx, grad):
    freqs, start_positions, cu_seqlens = ctx.saved_tensors
    grad_in = torch.ops.te_compile.fused_rope_bwd(
        grad, freqs, start_positions, cu_seqlens, *ctx.config
    )
    return (grad_in,) + (None,) * 7


registry.register_autograd(FUSED_ROPE_FWD, _backward, _setup_context)
