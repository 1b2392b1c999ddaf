"""TE's cuDNN fused attention (FusedAttention's F16/BF16 path) as custom ops.

    te_compile::fused_attn_fwd(qkv[], cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded?,
        cu_seqlens_kv_padded?, qkv_layout, attn_mask_type, window_size, bottom_right_diagonal,
        max_seqlen_q, max_seqlen_kv, attn_scale, dropout, fast_zero_fill, is_training,
        deterministic, backend) -> (out, softmax_stats, rng_state)
    te_compile::fused_attn_bwd(qkv[], out, d_out, softmax_stats, rng_state, <same>) -> grads[]

`qkv` holds the tensors as TE's layout string names them: one packed buffer for "sb3hd" /
"bsh3d"..., a query and a packed key-value buffer for "sbhd_sb2hd"..., three tensors for
"sbhd_sbhd_sbhd". The ops take the packed buffers themselves and slice q/k/v inside: TE's C++
reads q/k/v through the layout's strides from their data pointers, so the views must really
share one buffer, which only holds inside the op (a compiler may copy views of a graph
intermediate apart). Backward returns one gradient per `qkv` tensor (packed gradients are
stacked from dq/dk/dv: the same values, one copy).

Inside the kernels: TE's own `fused_attn_fwd` / `fused_attn_bwd` (cpp_extensions), with the
arguments eager TE's FusedAttnFunc passes for F16/BF16 inputs without bias, softmax offset,
FP8 or context parallelism. Dropout draws its Philox seed and offset from the default CUDA
generator inside the forward kernel call, where eager TE draws it; the backward replays the
forward's mask from the saved rng_state. TE's `cuda_graph` flag is True exactly while a CUDA
graph is being captured, as eager TE passes it in its own graphs (see `_call_te`).
"""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedUnderCompileError
from . import registry


@functools.cache
def _te_fused_attn():
    from transformer_engine.pytorch.cpp_extensions import fused_attn

    return fused_attn


def layout_format(qkv_layout: str) -> str:
    """ "sbhd" or "bshd": the q format of a layout ("sb3hd" -> "sbhd")."""
    return qkv_layout.split("_")[0].replace("3", "").replace("2", "")


def _interleave_dim(part: str) -> int:
    """The (negative) dim of the 3 or 2 in a packed layout part: "sb3hd" -> -3, "bsh2d" -> -2."""
    pos = next(i for i, c in enumerate(part) if c.isdigit())
    return pos - len(part)


def split_qkv(qkv: list[torch.Tensor], qkv_layout: str):
    """(q, k, v) views of the tensors `qkv_layout` describes."""
    parts = qkv_layout.split("_")
    if len(parts) == 1:  # one packed buffer
        dim = _interleave_dim(parts[0])
        return tuple(qkv[0].select(dim, i) for i in range(3))
    if len(parts) == 2:  # q + packed kv
        dim = _interleave_dim(parts[1])
        return (qkv[0], qkv[1].select(dim, 0), qkv[1].select(dim, 1))
    return tuple(qkv)


def _join_grads(dq, dk, dv, qkv_layout: str) -> list[torch.Tensor]:
    """Gradients shaped as the `qkv` tensors of `qkv_layout`."""
    parts = qkv_layout.split("_")
    if len(parts) == 1:
        return [torch.stack((dq, dk, dv), dim=_interleave_dim(parts[0]))]
    if len(parts) == 2:
        return [dq, torch.stack((dk, dv), dim=_interleave_dim(parts[1]))]
    return [dq, dk, dv]


def _stats_shape(q: torch.Tensor, qkv_layout: str) -> tuple[int, ...]:
    # cuDNN's softmax statistics for sbhd/bshd: float32 [b, h, s_q, 1].
    s, b = (q.shape[0], q.shape[1]) if layout_format(qkv_layout) == "sbhd" else q.shape[1::-1]
    return (b, q.shape[-2], s, 1)


# ---- forward -------------------------------------------------------------------------------------


def _call_te(kernel, *args, **kwargs):
    """`kernel` (TE's fused_attn_fwd/bwd) called with TE's own graph-capture flag, True exactly
    while a CUDA graph is being captured, as eager TE passes it inside its CUDA graphs. With it
    TE refuses configurations that cuDNN runs wrong inside a graph (TE 2.20: cuDNN <= 9.15,
    training, sbhd/bshd, max_seqlen_kv not a multiple of 128, no padding mask: wrong gradients
    or an illegal memory access, seen on an H100 under mode="reduce-overhead"); that refusal is
    re-raised with the ways out."""
    cuda_graph = torch.cuda.is_current_stream_capturing()
    try:
        return kernel(*args, cuda_graph=cuda_graph, **kwargs)
    except RuntimeError as e:
        if cuda_graph and "CUDA graph" in str(e):
            raise UnsupportedUnderCompileError(
                "TE's cuDNN fused attention refuses this configuration inside a CUDA graph "
                f"(mode='reduce-overhead' or a manual capture): {str(e).splitlines()[-1]} "
                "Ways out: a sequence length that is a multiple of 128, a padding mask, a cuDNN "
                "newer than 9.15, or torch.compile's default mode (no CUDA graphs)."
            ) from e
        raise


def _fwd_kernel(
    qkv,
    cu_seqlens_q,
    cu_seqlens_kv,
    cu_seqlens_q_padded,
    cu_seqlens_kv_padded,
    qkv_layout,
    attn_mask_type,
    window_size,
    bottom_right_diagonal,
    max_seqlen_q,
    max_seqlen_kv,
    attn_scale,
    dropout,
    fast_zero_fill,
    is_training,
    deterministic,
    backend,
):
    fa = _te_fused_attn()
    q, k, v = split_qkv(qkv, qkv_layout)
    o_format = layout_format(qkv_layout)
    out, aux = _call_te(
        fa.fused_attn_fwd,
        is_training,
        max_seqlen_q,
        max_seqlen_kv,
        cu_seqlens_q,
        cu_seqlens_kv,
        q,
        k,
        v,
        q.dtype,
        fa.FusedAttnBackend.cast(backend),
        attn_bias=None,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        page_table_k=None,
        page_table_v=None,
        s_quantizer=None,
        o_quantizer=None,
        attn_scale=attn_scale,
        dropout=dropout,
        fast_zero_fill=fast_zero_fill,
        qkv_layout=qkv_layout,
        o_format=o_format,
        qkv_scale_inv_format=None,
        attn_bias_type="no_bias",
        attn_mask_type=attn_mask_type,
        softmax_type="vanilla",
        window_size=tuple(window_size),
        bottom_right_diagonal=bottom_right_diagonal,
        rng_gen=None,  # the default CUDA generator, as eager TE
        softmax_offset=None,
        return_max_logit=False,
    )
    # Contiguous as the fake kernel declares it (TE's backward makes it contiguous anyway).
    stats, rng_state = aux[0].contiguous(), aux[1]
    return out, stats, rng_state


def _fwd_fake(qkv, cu_seqlens_q, cu_seqlens_kv, cu_q_padded, cu_kv_padded, qkv_layout, *_args):
    q, _, v = split_qkv(qkv, qkv_layout)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    stats = q.new_empty(_stats_shape(q, qkv_layout), dtype=torch.float32)
    rng_state = q.new_empty((2,), dtype=torch.int64)
    return out, stats, rng_state


_CONFIG_SCHEMA = (
    "str qkv_layout, str attn_mask_type, int[] window_size, bool bottom_right_diagonal, "
    "int max_seqlen_q, int max_seqlen_kv, float attn_scale, float dropout, bool fast_zero_fill, "
    "bool is_training, bool deterministic, int backend"
)
_CU_SCHEMA = (
    "Tensor cu_seqlens_q, Tensor cu_seqlens_kv, Tensor? cu_seqlens_q_padded, "
    "Tensor? cu_seqlens_kv_padded"
)
# Tagged nondeterministic_seeded: it draws from the CUDA generator, so compilers must neither
# merge two calls (CSE), drop one whose output is unused, nor recompute it in backward; with
# inductor's fallback_random it keeps its program order among the other random ops.
_SEEDED = torch.library.Library(registry.NAMESPACE, "FRAGMENT")
_SEEDED.define(
    f"fused_attn_fwd(Tensor[] qkv, {_CU_SCHEMA}, {_CONFIG_SCHEMA}) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.nondeterministic_seeded,),
)
_SEEDED.impl("fused_attn_fwd", _fwd_kernel, "CUDA")
torch.library.register_fake(f"{registry.NAMESPACE}::fused_attn_fwd", _fwd_fake, lib=_SEEDED)
FUSED_ATTN_FWD = torch.ops.te_compile.fused_attn_fwd


# ---- backward ------------------------------------------------------------------------------------


def _bwd_kernel(
    qkv,
    out,
    d_out,
    softmax_stats,
    rng_state,
    cu_seqlens_q,
    cu_seqlens_kv,
    cu_seqlens_q_padded,
    cu_seqlens_kv_padded,
    qkv_layout,
    attn_mask_type,
    window_size,
    bottom_right_diagonal,
    max_seqlen_q,
    max_seqlen_kv,
    attn_scale,
    dropout,
    fast_zero_fill,
    is_training,
    deterministic,
    backend,
):
    fa = _te_fused_attn()
    q, k, v = split_qkv(qkv, qkv_layout)
    o_format = layout_format(qkv_layout)
    dq, dk, dv, *_ = _call_te(
        fa.fused_attn_bwd,
        max_seqlen_q,
        max_seqlen_kv,
        cu_seqlens_q,
        cu_seqlens_kv,
        q,
        k,
        v,
        out,
        d_out.contiguous(),
        q.dtype,
        [softmax_stats, rng_state],
        fa.FusedAttnBackend.cast(backend),
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        s_quantizer=None,
        dp_quantizer=None,
        dqkv_quantizer=None,
        attn_scale=attn_scale,
        dropout=dropout,
        fast_zero_fill=fast_zero_fill,
        qkv_layout=qkv_layout,
        o_format=o_format,
        do_format=o_format,
        dqkv_layout=qkv_layout,
        qkv_scale_inv_format=None,
        do_scale_inv_format=None,
        attn_bias_type="no_bias",
        attn_mask_type=attn_mask_type,
        softmax_type="vanilla",
        window_size=tuple(window_size),
        bottom_right_diagonal=bottom_right_diagonal,
        deterministic=deterministic,
    )
    return _join_grads(dq, dk, dv, qkv_layout)


def _bwd_fake(qkv, *_args):
    return [t.new_empty(t.shape) for t in qkv]


FUSED_ATTN_BWD = registry.define(
    "fused_attn_bwd(Tensor[] qkv, Tensor out, Tensor d_out, Tensor softmax_stats, "
    f"Tensor rng_state, {_CU_SCHEMA}, {_CONFIG_SCHEMA}) -> Tensor[]",
    _bwd_kernel,
    _bwd_fake,
)


# ---- autograd ------------------------------------------------------------------------------------

_N_TENSOR_INPUTS = 5  # qkv, cu_seqlens_q, cu_seqlens_kv, and the two padded ones


def _setup_context(ctx, inputs, output) -> None:
    qkv, cu_q, cu_kv, cu_q_pad, cu_kv_pad = inputs[:_N_TENSOR_INPUTS]
    out, stats, rng_state = output
    ctx.mark_non_differentiable(stats, rng_state)
    ctx.n_qkv = len(qkv)
    ctx.has_padded = (cu_q_pad is not None, cu_kv_pad is not None)
    padded = [t for t in (cu_q_pad, cu_kv_pad) if t is not None]
    ctx.save_for_backward(*qkv, out, stats, rng_state, cu_q, cu_kv, *padded)
    ctx.config = inputs[_N_TENSOR_INPUTS:]


def _backward(ctx, d_out, _d_stats, _d_rng):
    saved = list(ctx.saved_tensors)
    n = ctx.n_qkv
    qkv, (out, stats, rng_state, cu_q, cu_kv), rest = saved[:n], saved[n : n + 5], saved[n + 5 :]
    cu_q_pad = rest.pop(0) if ctx.has_padded[0] else None
    cu_kv_pad = rest.pop(0) if ctx.has_padded[1] else None
    grads = torch.ops.te_compile.fused_attn_bwd(
        qkv, out, d_out, stats, rng_state, cu_q, cu_kv, cu_q_pad, cu_kv_pad, *ctx.config
    )
    return (list(grads), None, None, None, None) + (None,) * len(ctx.config)


torch.library.register_autograd(
    FUSED_ATTN_FWD.default, _backward, setup_context=_setup_context, lib=_SEEDED
)
