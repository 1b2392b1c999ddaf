"""Which attention backend the compiled DotProductAttention runs, and the calls of TE's modules.

`select_backend` is TE's own `get_attention_backend`, run eagerly while dynamo traces (an
`assume_constant_result` function: device capability, cuDNN version, flash-attn install and the
NVTE_* switches are read as eager TE reads them; no device query is traced). With it comes
whether the flash-attn TE picked can trace at all (`flash_refusal`). `flash_attention` and
`unfused_attention` call TE's own FlashAttention and UnfusedDotProductAttention modules as eager
DotProductAttention does; attention_refusals.py refuses what this path does not cover first.
"""

from __future__ import annotations

import torch


@torch.compiler.assume_constant_result
def select_backend(params: tuple) -> tuple:
    """(use_flash, flash_version, flash_refusal, use_fused, fused_backend, use_unfused): TE's
    get_attention_backend on AttentionParams(**dict(params)), run eagerly at trace time
    (device capability, cuDNN version, flash-attn install and NVTE_* switches are read as
    eager TE reads them). `params` holds plain values; "qkv_dtype" is a dtype's name.
    `flash_refusal` is "" when the picked flash-attn traces into the graph, else why not."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    kwargs = dict(params)
    kwargs["qkv_dtype"] = getattr(torch, kwargs["qkv_dtype"])
    use_flash, flash_version, use_fused, fused_backend, use_unfused, _ = (
        dpa_utils.get_attention_backend(dpa_utils.AttentionParams(**kwargs))
    )
    return (
        bool(use_flash),
        str(flash_version) if use_flash else "",
        flash_refusal(int(flash_version.major)) if use_flash else "",
        bool(use_fused),
        int(fused_backend) if use_fused else -1,
        bool(use_unfused),
    )


_FLASH2_OPS = ("_flash_attn_forward", "_flash_attn_varlen_forward", "_flash_attn_backward")


def flash_refusal(major: int) -> str:
    """Why flash-attn of this major version cannot run inside the graph ("" when it can).
    FlashAttention 2 registers its kernels as torch custom ops (with fake kernels) from 2.7
    on, so TE's FlashAttention module traces; before 2.7 they are pybind calls dynamo cannot
    trace. TE runs FlashAttention 4 outside the graph (no custom ops), and FlashAttention 3
    is not covered by te-compile's GPU tests."""
    from transformer_engine.pytorch.attention.dot_product_attention.utils import (
        FlashAttentionUtils,
    )

    if major == 2:
        ops_there = all(hasattr(torch.ops.flash_attn, name) for name in _FLASH2_OPS)
        if FlashAttentionUtils.v2_7_0_plus and ops_there:
            return ""
        return "its kernels are torch custom ops only from flash-attn 2.7 on"
    if major == 3:
        return "FlashAttention 3 is not covered by te-compile's tests"
    return "TE runs FlashAttention 4 outside torch.compile's graph"


def _te_module_kwargs(m, call: dict, layout, seqlens: tuple, mask_type, window, softcap) -> dict:
    """What eager DotProductAttention passes both TE's FlashAttention and its
    UnfusedDotProductAttention module (no FP8, bias, ALiBi or KV cache: refused before)."""
    cu_q, cu_kv, max_q, max_kv = seqlens
    return dict(
        attention_mask=call["attention_mask"],
        qkv_layout=layout,
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        attn_mask_type=mask_type,
        window_size=window,
        softcap=softcap,
        alibi_slopes=None,
        inference_params=None,
        fp8=False,
        fp8_meta=m.fp8_meta,
        quantizers=m.quantizers,
        fp8_output=False,
    )


def flash_attention(m, call: dict, q, k, v, layout, seqlens: tuple, mask: tuple, softcap):
    """TE's own FlashAttention module with the arguments eager DotProductAttention passes it
    (flash-attn >= 2.7 only: its kernels are custom ops with fake kernels, so dynamo traces
    TE's layout changes, packing for padding masks and flash-attn's autograd.Functions).
    `seqlens`: (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv); `mask`:
    (attn_mask_type, window_size, bottom_right_diagonal)."""
    from transformer_engine.pytorch.attention.dot_product_attention import (
        dot_product_attention as dpa_module,
    )
    from transformer_engine.pytorch.attention.dot_product_attention.utils import (
        FlashAttentionUtils,
    )

    mask_type, window, _ = mask
    heads = int(q.shape[-2])
    trim = None
    if q.shape[-1] != v.shape[-1]:
        # FlashAttention 2 takes one head size: eager TE pads q/k/v to the larger, trims after.
        q, k, v, qk_dim, v_dim = dpa_module._pad_qkv_head_dim(q, k, v)
        trim = (qk_dim, v_dim) if qk_dim > v_dim else None
    out = m.flash_attention(
        q,
        k,
        v,
        cp_group=None,
        pad_between_seqs=bool(call["pad_between_seqs"]),
        flash_attention_backend=FlashAttentionUtils.version,
        num_splits=int(call["num_splits"] or 1),
        cu_seqlens_q_padded=call["cu_seqlens_q_padded"],
        cu_seqlens_kv_padded=call["cu_seqlens_kv_padded"],
        **_te_module_kwargs(m, call, layout, seqlens, mask_type, window, softcap),
    )
    if trim is not None:
        out = dpa_module._trim_output(out, heads, *trim)
    return out


def unfused_attention(m, call: dict, q, k, v, layout, seqlens: tuple, mask: tuple, softcap):
    """TE's own UnfusedDotProductAttention module (TE 2.20 wrote it traceable: its softmax
    kernels are TE custom ops), called as eager DotProductAttention calls it."""
    from transformer_engine.pytorch.attention.dot_product_attention import (
        dot_product_attention as dpa_module,
    )

    mask_type, window, diagonal = mask
    return m.unfused_attention(
        dpa_module._alibi_cache,
        q,
        k,
        v,
        bottom_right_diagonal=diagonal,
        core_attention_bias_type="no_bias",
        core_attention_bias=None,
        softmax_offset=None,
        **_te_module_kwargs(m, call, layout, seqlens, mask_type, window, softcap),
    )
