"""The traceable te.DotProductAttention.forward (`compiled_dpa_forward`): TE's argument handling
(mask type, window, diagonal alignment, sequence lengths, packed `qkv_layer`/`kv_layer`), then
the backend eager TE would pick (attention_backends.py): FusedAttention as one
`te_compile::fused_attn_fwd` op, or TE's own FlashAttention / UnfusedDotProductAttention
module, traced. What it does not implement is refused first (attention_refusals.py).
"""

from __future__ import annotations

import torch

from .. import ops  # noqa: F401  (registers the te_compile ops)
from ..ops.attention import FusedAttnSpec
from ..spec import constant_number
from . import attention_backends as backends
from . import attention_refusals as refusals
from . import checkpointing, gemm_common


def _inputs(call: dict, qkv_format: str):
    """(qkv tensors for the op, q, k, v views, qkv_layout), as eager TE resolves them."""
    from transformer_engine.pytorch.attention.dot_product_attention import (
        dot_product_attention as dpa_module,
    )

    q, k, v, declared = dpa_module._unpack_packed_qkv(
        call["qkv_layer"],
        call["kv_layer"],
        call["query_layer"],
        call["key_layer"],
        call["value_layer"],
        qkv_format,
        call["qkv_interleave_dim"],
        None,
    )
    if declared is None:
        # Separate tensors: eager TE reads data pointers to spot views of one buffer; it ends
        # at contiguous q/k/v in "<fmt>_<fmt>_<fmt>" for every tensor MultiheadAttention makes
        # (TE's own compile path does the same).
        q, k, v = (x.contiguous() for x in (q, k, v))
        return [q, k, v], q, k, v, "_".join([qkv_format] * 3)
    if call["qkv_layer"] is not None:
        return [call["qkv_layer"].contiguous()], q, k, v, declared
    return [q.contiguous(), call["kv_layer"].contiguous()], q, k, v, declared


def _check_shapes(m, q, k, v, qkv_format: str) -> None:
    gemm_common.check_device(q, k, v)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("Queries, keys and values must have the same data type!")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            "Keys and values must have the same batch size, sequence length and number of heads!"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError("Queries and keys must have the same head dimension!")
    if q.shape[-1] != m.hidden_size_per_attention_head_k:
        raise ValueError(
            f"Keys have head_dim = {q.shape[-1]}, but expected head_dim = "
            f"{m.hidden_size_per_attention_head_k}!"
        )
    if v.shape[-1] != m.hidden_size_per_attention_head_v:
        raise ValueError(
            f"Values have head_dim = {v.shape[-1]}, but expected head_dim = "
            f"{m.hidden_size_per_attention_head_v}!"
        )
    if k.shape[-2] != m.num_gqa_groups_per_partition:
        raise ValueError(
            f"Keys and values must have num_gqa_group = {m.num_gqa_groups_per_partition} "
            f"heads! Found {k.shape[-2]}."
        )
    if any(x.dim() != 4 for x in (q, k, v)):
        raise ValueError(f"Queries, keys and values must be 4D tensors when {qkv_format=}!")


def _mask_and_window(m, call: dict):
    """(attn_mask_type, window_size, bottom_right_diagonal) as eager TE resolves them."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    mask_type = call["attn_mask_type"]
    if mask_type is None:
        mask_type = m.attn_mask_type
    else:
        mask_type = mask_type.replace(",", "_")
        if mask_type == "causal_padding":
            mask_type = "padding_causal"
    refusals.check_mask_type(mask_type)
    window = call["window_size"] if call["window_size"] is not None else m.window_size
    window = tuple(dpa_utils.check_set_window_size(mask_type, window))
    diagonal = call["bottom_right_diagonal"]
    if diagonal is None:
        diagonal = m.bottom_right_diagonal
    if mask_type in ("causal", "padding_causal"):
        diagonal = False
    if diagonal is None or mask_type in ("causal_bottom_right", "padding_causal_bottom_right"):
        diagonal = True
    return mask_type, window, bool(diagonal)


def _cu_seqlens(m, call: dict, mask_type: str, batch: int, seqlen: int, which: int, device):
    """TE's cu_seqlens for one side (0: q, 1: kv): the given one, else from the padding mask,
    else every sequence full length."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    given = call["cu_seqlens_q" if which == 0 else "cu_seqlens_kv"]
    if given is not None:
        return given
    if "padding" in mask_type:
        mask = call["attention_mask"]
        if mask is None:
            raise ValueError("Please provide attention_mask for padding!")
        if m.attention_type != "self":
            mask = mask[which]
        return dpa_utils.get_cu_seqlens(mask)
    return torch.arange(0, (batch + 1) * seqlen, step=seqlen, dtype=torch.int32, device=device)


def _padded(given, cu_seqlens, batch: int, mask_type: str):
    """FusedAttention's padded cu_seqlens: the given ones, else for padding masks the plain
    ones (no padding between sequences), else none."""
    if given is not None:
        return given
    return cu_seqlens[: batch + 1] if "padding" in mask_type else None


def _backend_params(m, call, q, k, v, layout, batch, seqlens, mask, softcap) -> tuple:
    """TE's AttentionParams for this call as plain (name, value) pairs (backends.select_backend's
    argument). Sizes are specialized (spec.constant_number): eager TE picks a backend per call
    from the actual sizes, so a compiled graph holds for these sizes only (a dynamic batch or
    sequence length recompiles per value, not into a backend picked for another)."""
    max_q, max_kv = (constant_number(n) for n in seqlens)
    mask_type, window, diagonal = mask
    return (
        ("qkv_dtype", str(q.dtype).removeprefix("torch.")),
        ("qkv_layout", layout),
        ("batch_size", constant_number(batch)),
        ("num_heads", constant_number(q.shape[-2])),
        ("num_gqa_groups", constant_number(k.shape[-2])),
        ("max_seqlen_q", max_q),
        ("max_seqlen_kv", max_kv),
        ("head_dim_qk", constant_number(q.shape[-1])),
        ("head_dim_v", constant_number(v.shape[-1])),
        ("attn_mask_type", mask_type),
        ("window_size", tuple(constant_number(w) for w in window)),
        ("bottom_right_diagonal", diagonal),
        ("softcap", float(constant_number(softcap))),
        ("core_attention_bias_type", "no_bias"),
        ("core_attention_bias_requires_grad", False),
        ("pad_between_seqs", bool(call["pad_between_seqs"]) if call["pad_between_seqs"] else False),
        ("attention_dropout", float(constant_number(m.attention_dropout))),
        ("cp_comm_type", m.cp_comm_type),
        ("deterministic", bool(m.deterministic)),
        ("is_training", bool(m.training)),
        # Eager TE passes fp8=self.fp8 (FP8 autocast on); get_attention_backend reads it only
        # together with fp8_dpa/fp8_mha, which check_dpa_options refused.
        ("fp8", False),
        ("softmax_type", m.softmax_type),
        ("num_splits", constant_number(call["num_splits"] or 1)),
        ("softmax_scale", float(constant_number(m.softmax_scale))),
    )


def _fused_attention(m, call, tensors, layout, batch, seqlens, mask, fused_backend: int):
    """FusedAttention (cuDNN): one te_compile::fused_attn_fwd op."""
    cu_q, cu_kv, max_q, max_kv = seqlens
    mask_type, window, diagonal = mask
    config = FusedAttnSpec(
        qkv_layout=layout,
        attn_mask_type=mask_type,
        window_size=tuple(window),
        bottom_right_diagonal=diagonal,
        attn_scale=float(m.softmax_scale),
        dropout=float(m.attention_dropout) if m.training else 0.0,
        fast_zero_fill=bool(call["fast_zero_fill"]),
        is_training=bool(m.training),
        deterministic=bool(m.deterministic),
        backend=fused_backend,
    )
    padded = [
        _padded(call["cu_seqlens_q_padded"], cu_q, batch, mask_type),
        _padded(call["cu_seqlens_kv_padded"], cu_kv, batch, mask_type),
    ]
    out, _, _ = torch.ops.te_compile.fused_attn_fwd(
        tensors, cu_q[: batch + 1], cu_kv[: batch + 1], padded, [max_q, max_kv], config.key
    )
    return out.view(*out.shape[:-2], -1)


def compiled_dpa_forward(m, call: dict):
    """The traceable DotProductAttention.forward; `call` maps TE's parameter names to the
    arguments of this call. checkpoint_core_attention: the attention recomputed in backward,
    as eager TE's te.distributed.checkpoint around its core attention."""
    if call["checkpoint_core_attention"] and torch.is_grad_enabled():
        inner = dict(call, checkpoint_core_attention=False)
        return checkpointing.checkpoint(compiled_dpa_forward, m, inner)
    qkv_format = call["qkv_format"] or m.qkv_format
    refusals.check_dpa_options(m, call, qkv_format)
    tensors, q, k, v, layout = _inputs(call, qkv_format)
    _check_shapes(m, q, k, v, qkv_format)
    mask = _mask_and_window(m, call)
    softcap = call["softcap"] if call["softcap"] is not None else m.softcap
    if softcap < 0.0 or softcap != softcap or softcap == float("inf"):
        raise ValueError(f"softcap must be finite and non-negative, got {softcap}.")
    s_dim, b_dim = (0, 1) if qkv_format == "sbhd" else (1, 0)
    batch = int(q.shape[b_dim])
    max_q = int(q.shape[s_dim]) if call["max_seqlen_q"] is None else int(call["max_seqlen_q"])
    max_kv = int(k.shape[s_dim]) if call["max_seqlen_kv"] is None else int(call["max_seqlen_kv"])
    cu_q = _cu_seqlens(m, call, mask[0], batch, max_q, 0, q.device)
    cu_kv = _cu_seqlens(m, call, mask[0], batch, max_kv, 1, k.device)
    seqlens = (cu_q, cu_kv, max_q, max_kv)
    params = _backend_params(m, call, q, k, v, layout, batch, (max_q, max_kv), mask, softcap)
    use_flash, flash_version, flash_refusal, use_fused, fused_backend, use_unfused = (
        backends.select_backend(params)
    )
    if use_flash:
        refusals.check_flash(flash_version, flash_refusal)
        return backends.flash_attention(m, call, q, k, v, layout, seqlens, mask, softcap)
    if use_fused:
        return _fused_attention(m, call, tensors, layout, batch, seqlens, mask, fused_backend)
    if use_unfused:
        return backends.unfused_attention(m, call, q, k, v, layout, seqlens, mask, softcap)
    raise ValueError(
        "No dot product attention backend is available for the provided inputs. Please run "
        "with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 to find out the reasons for disabling all "
        "backends."
    )
