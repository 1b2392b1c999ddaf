"""TE's cuDNN fused attention (FusedAttention's F16/BF16 path) as custom ops.

    fused_attn_fwd(qkv[], cu_seqlens_q, cu_seqlens_kv, cu_seqlens_padded[], max_seqlens[],
        config) -> (out, softmax_stats, rng_state)
    fused_attn_bwd(qkv[], out, d_out, softmax_stats, rng_state, <the same>) -> grads[]

`config` is `FusedAttnSpec.key`: the layout, mask, window, scale, dropout and backend options,
which always travel together from the module to both kernels. The sequence lengths are
tensors and sizes rather than options: `cu_seqlens_padded` = [q, kv] (each None unless given
or a padding mask), `max_seqlens` = [q, kv]. The plain cu_seqlens stay separate tensors: under
activation checkpointing AOTAutograd wraps this random op in RNG-state wrappers that find the
device from a tensor argument outside any list.

`qkv` holds the tensors as TE's layout string names them: one packed buffer for "sb3hd" /
"bsh3d"..., a query and a packed key-value buffer for "sbhd_sb2hd"..., three tensors for
"sbhd_sbhd_sbhd". The ops take the packed buffers themselves and slice q/k/v inside: TE's C++
reads q/k/v through the layout's strides from their data pointers, so the views must really
share one buffer, which only holds inside the op (a compiler may copy views of a graph
intermediate apart). Backward returns one gradient per `qkv` tensor (a packed gradient is
TE's own buffer of dq/dk/dv, or stacked from them where they are not its slices).

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
from torch import Tensor

from ..errors import UnsupportedUnderCompileError
from ..spec import Spec, spec
from .registry import op


@spec
class FusedAttnSpec(Spec):
    """The options of one fused attention call, as eager TE's FusedAttnFunc passes them."""

    qkv_layout: str  # TE's layout string, e.g. "sbhd_sbhd_sbhd", "sb3hd", "bshd_bsh2d"
    attn_mask_type: str
    window_size: tuple[int, ...]  # (left, right), -1: unbounded
    bottom_right_diagonal: bool
    attn_scale: float
    dropout: float
    fast_zero_fill: bool
    is_training: bool
    deterministic: bool
    backend: int  # TE's FusedAttnBackend value


@functools.cache
def _te_fused_attn():
    from transformer_engine.pytorch.cpp_extensions import fused_attn

    return fused_attn


@functools.cache
def layout_format(qkv_layout: str) -> str:
    """ "sbhd" or "bshd": the q format of a layout ("sb3hd" -> "sbhd")."""
    return qkv_layout.split("_")[0].replace("3", "").replace("2", "")


def _interleave_dim(part: str) -> int:
    """The (negative) dim of the 3 or 2 in a packed layout part: "sb3hd" -> -3, "bsh2d" -> -2."""
    pos = next(i for i, c in enumerate(part) if c.isdigit())
    return pos - len(part)


@functools.cache
def _packing(qkv_layout: str) -> tuple[int, int | None]:
    """(how many of q, k, v the last `qkv` tensor packs: 3, 2 or 1, its packing dim or None).
    Parsed once per layout: the ops run every step."""
    parts = qkv_layout.split("_")
    if len(parts) == 3:
        return 1, None
    return 4 - len(parts), _interleave_dim(parts[-1])


def split_qkv(qkv: list[torch.Tensor], qkv_layout: str):
    """(q, k, v) views of the tensors `qkv_layout` describes."""
    packed, dim = _packing(qkv_layout)
    if packed == 3:
        return qkv[0].unbind(dim)
    if packed == 2:  # q + packed kv
        return (qkv[0], *qkv[1].unbind(dim))
    return tuple(qkv)


def _join_grads(dq, dk, dv, qkv_layout: str) -> list[torch.Tensor]:
    """Gradients shaped as the `qkv` tensors of `qkv_layout`."""
    packed, dim = _packing(qkv_layout)
    if packed == 3:
        return [_packed((dq, dk, dv), dim)]
    if packed == 2:
        return [dq, _packed((dk, dv), dim)]
    return [dq, dk, dv]


def _packed(grads: tuple[torch.Tensor, ...], dim: int) -> torch.Tensor:
    """`torch.stack(grads, dim)`, contiguous. TE's backward writes a packed layout's gradients
    into one buffer and returns views of it; where they are exactly the slices of that stacked
    tensor, the buffer is returned as it is (as eager TE's SplitAlongDim backward does) instead
    of copied. (Pointer arithmetic, not view ops: this runs every step.)"""
    first = grads[0]
    shape, strides, slice_strides, d = _stacked_geometry(first.shape, len(grads), dim)
    size = first.element_size()
    gap, ptr = strides[d] * size, first.data_ptr()
    # `first`'s own allocation must hold every slice (adjacent tensors may be apart).
    end = (first.storage_offset() + first.numel() * len(grads)) * size
    if not first.is_meta and end <= first.untyped_storage().nbytes():
        if all(
            g.stride() == slice_strides and g.data_ptr() == ptr + i * gap
            for i, g in enumerate(grads)
        ):
            return first.as_strided(shape, strides, first.storage_offset())
    return torch.stack(grads, dim=dim)


@functools.lru_cache(maxsize=64)
def _stacked_geometry(slice_shape: torch.Size, n: int, dim: int):
    """(shape, contiguous strides, the strides each slice has, the stacked dim) of `n`
    tensors of `slice_shape` stacked along `dim`: one entry per shape seen, as tuples (the
    cache hands the same ones to every caller)."""
    d = dim % (len(slice_shape) + 1)
    shape = (*slice_shape[:d], n, *slice_shape[d:])
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    strides = tuple(reversed(strides))
    return shape, strides, (*strides[:d], *strides[d + 1 :]), d


def _stats_shape(q: torch.Tensor, qkv_layout: str) -> tuple[int, ...]:
    # cuDNN's softmax statistics for sbhd/bshd: float32 [b, h, s_q, 1].
    s, b = (q.shape[0], q.shape[1]) if layout_format(qkv_layout) == "sbhd" else q.shape[1::-1]
    return (b, q.shape[-2], s, 1)


# ---- forward -------------------------------------------------------------------------------------


def _call_te(kernel, cfg: FusedAttnSpec, *args, **kwargs):
    """`kernel` (TE's fused_attn_fwd/bwd) called with the options both kernels take alike from
    `cfg`, and with TE's own graph-capture flag, True exactly while a CUDA graph is being
    captured, as eager TE passes it inside its CUDA graphs. With it TE refuses configurations
    that cuDNN runs wrong inside a graph (TE 2.20: cuDNN <= 9.15, training, sbhd/bshd,
    max_seqlen_kv not a multiple of 128, no padding mask: wrong gradients or an illegal memory
    access, seen on an H100 under mode="reduce-overhead"); that refusal is re-raised with the
    ways out."""
    cuda_graph = torch.cuda.is_current_stream_capturing()
    try:
        return kernel(
            *args,
            cuda_graph=cuda_graph,
            s_quantizer=None,
            attn_scale=cfg.attn_scale,
            dropout=cfg.dropout,
            fast_zero_fill=cfg.fast_zero_fill,
            qkv_layout=cfg.qkv_layout,
            o_format=layout_format(cfg.qkv_layout),
            qkv_scale_inv_format=None,
            attn_bias_type="no_bias",
            attn_mask_type=cfg.attn_mask_type,
            softmax_type="vanilla",
            window_size=cfg.window_size,
            bottom_right_diagonal=cfg.bottom_right_diagonal,
            **kwargs,
        )
    except RuntimeError as e:
        if cuda_graph and "CUDA graph" in str(e):
            raise UnsupportedUnderCompileError(
                "TE's cuDNN fused attention refuses this configuration inside a CUDA graph "
                f"(mode='reduce-overhead' or a manual capture): {str(e).splitlines()[-1]} "
                "Ways out: a sequence length that is a multiple of 128, a padding mask, a cuDNN "
                "newer than 9.15, or torch.compile's default mode (no CUDA graphs)."
            ) from e
        raise


# Tagged nondeterministic_seeded: it draws from the CUDA generator, so compilers must neither
# merge two calls (CSE), drop one whose output is unused, nor recompute it in backward; with
# inductor's fallback_random it keeps its program order among the other random ops.
@op(tags=(torch.Tag.nondeterministic_seeded,))
def fused_attn_fwd(
    qkv: list[Tensor],
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_padded: list[Tensor | None],
    max_seqlens: list[int],
    config: str,
) -> tuple[Tensor, Tensor, Tensor]:
    cfg = FusedAttnSpec.from_key(config)
    fa = _te_fused_attn()
    q, k, v = split_qkv(qkv, cfg.qkv_layout)
    cu_seqlens_q_padded, cu_seqlens_kv_padded = cu_seqlens_padded
    sizes = (*max_seqlens, cu_seqlens_q, cu_seqlens_kv)  # both kernels take them in a row
    out, aux = _call_te(
        fa.fused_attn_fwd,
        cfg,
        cfg.is_training,
        *sizes,
        q,
        k,
        v,
        q.dtype,
        fa.FusedAttnBackend.cast(cfg.backend),
        attn_bias=None,
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        page_table_k=None,
        page_table_v=None,
        o_quantizer=None,
        rng_gen=None,  # the default CUDA generator, as eager TE
        softmax_offset=None,
        return_max_logit=False,
    )
    # Contiguous as the fake kernel declares it (TE's backward makes it contiguous anyway).
    stats, rng_state = aux[0].contiguous(), aux[1]
    return out, stats, rng_state


@fused_attn_fwd.fake
def _(a):
    qkv_layout = FusedAttnSpec.from_key(a.config).qkv_layout
    q, _, v = split_qkv(a.qkv, qkv_layout)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    stats = q.new_empty(_stats_shape(q, qkv_layout), dtype=torch.float32)
    rng_state = q.new_empty((2,), dtype=torch.int64)
    return out, stats, rng_state


# ---- backward ------------------------------------------------------------------------------------


@op()
def fused_attn_bwd(
    qkv: list[Tensor],
    out: Tensor,
    d_out: Tensor,
    softmax_stats: Tensor,
    rng_state: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_kv: Tensor,
    cu_seqlens_padded: list[Tensor | None],
    max_seqlens: list[int],
    config: str,
) -> list[Tensor]:
    cfg = FusedAttnSpec.from_key(config)
    fa = _te_fused_attn()
    q, k, v = split_qkv(qkv, cfg.qkv_layout)
    cu_seqlens_q_padded, cu_seqlens_kv_padded = cu_seqlens_padded
    sizes = (*max_seqlens, cu_seqlens_q, cu_seqlens_kv)  # both kernels take them in a row
    dq, dk, dv, *_ = _call_te(
        fa.fused_attn_bwd,
        cfg,
        *sizes,
        q,
        k,
        v,
        out,
        d_out.contiguous(),
        q.dtype,
        [softmax_stats, rng_state],
        fa.FusedAttnBackend.cast(cfg.backend),
        cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded,
        dp_quantizer=None,
        dqkv_quantizer=None,
        do_format=layout_format(cfg.qkv_layout),
        dqkv_layout=cfg.qkv_layout,
        do_scale_inv_format=None,
        deterministic=cfg.deterministic,
    )
    return _join_grads(dq, dk, dv, cfg.qkv_layout)


fused_attn_bwd.fake(lambda a: [t.new_empty(t.shape) for t in a.qkv])


# ---- autograd ------------------------------------------------------------------------------------


def _setup_context(ctx, a, output) -> None:
    out, stats, rng_state = output
    ctx.mark_non_differentiable(stats, rng_state)
    ctx.n_qkv = len(a.qkv)
    cu_seqlens = (a.cu_seqlens_q, a.cu_seqlens_kv, *a.cu_seqlens_padded)
    ctx.save_for_backward(*a.qkv, out, stats, rng_state, *cu_seqlens)
    ctx.max_seqlens = a.max_seqlens
    ctx.config = a.config


def _backward(ctx, d_out, _d_stats, _d_rng):
    qkv, saved = ctx.saved_tensors[: ctx.n_qkv], ctx.saved_tensors[ctx.n_qkv :]
    out, stats, rng_state, cu_q, cu_kv, *padded = saved
    grads = fused_attn_bwd(
        list(qkv), out, d_out, stats, rng_state, cu_q, cu_kv, padded, ctx.max_seqlens, ctx.config
    )
    return {"qkv": list(grads)}


fused_attn_fwd.autograd(_setup_context, _backward)
