"""TE's fused rotary position embedding kernels (FusedRoPEFunc) as custom ops.

    fused_rope_fwd(t, freqs, start_positions?, cu_seqlens?, tensor_format, interleaved,
                   cp_size, cp_rank) -> out
    fused_rope_bwd(grad, <the same>) -> grad_in

The kernels are tex.fused_rope_forward / fused_rope_backward with the arguments eager TE's
FusedRoPEFunc passes (freqs in float32, as FusedRoPEFunc casts them). Both return a new
contiguous tensor of the input's shape (TE's C++ allocates `at::empty(input.sizes())`).
"""

from __future__ import annotations

import inspect

from torch import Tensor

from ..kernels import extension
from .registry import Op, op


def _qkv_format(tensor_format: str):
    from transformer_engine.pytorch.cpp_extensions.fused_attn import QKVFormat

    return QKVFormat[tensor_format]


def _rope_op(name: str, kernel: str, first: str) -> Op:
    """The op `name` running tex.<kernel>: forward and backward take the same options, after
    the tensor named `first` (the input, or the output's gradient)."""

    def impl(
        t: Tensor,
        freqs: Tensor,
        start_positions: Tensor | None,
        cu_seqlens: Tensor | None,
        tensor_format: str,
        interleaved: bool,
        cp_size: int,
        cp_rank: int,
    ) -> Tensor:
        return getattr(extension.tex(), kernel)(
            t,
            freqs,
            start_positions,
            _qkv_format(tensor_format),
            interleaved,
            cu_seqlens,
            cp_size,
            cp_rank,
        )

    signature = inspect.signature(impl)
    t, *options = signature.parameters.values()
    impl.__signature__ = signature.replace(parameters=[t.replace(name=first), *options])
    impl.__name__ = name
    return op()(impl)


fused_rope_fwd = _rope_op("fused_rope_fwd", "fused_rope_forward", first="t")
fused_rope_bwd = _rope_op("fused_rope_bwd", "fused_rope_backward", first="grad")

fused_rope_fwd.fake(lambda a: a.t.new_empty(a.t.shape))
fused_rope_bwd.fake(lambda a: a.grad.new_empty(a.grad.shape))


def _setup_context(ctx, a, output) -> None:
    ctx.save_for_backward(a.freqs, a.start_positions, a.cu_seqlens)
    ctx.options = (a.tensor_format, a.interleaved, a.cp_size, a.cp_rank)


def _backward(ctx, grad):
    freqs, start_positions, cu_seqlens = ctx.saved_tensors
    return {"t": fused_rope_bwd(grad, freqs, start_positions, cu_seqlens, *ctx.options)}


fused_rope_fwd.autograd(_setup_context, _backward)
