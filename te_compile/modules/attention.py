"""te.DotProductAttention, te.MultiheadAttention and te.TransformerLayer under torch.compile.

Not compiling: TE's own code, unchanged. While dynamo traces:

- `DotProductAttention.forward` is swapped for `compiled_dpa_forward`: TE's argument handling
  (mask type, window, diagonal alignment, sequence lengths, packed `qkv_layer`/`kv_layer`),
  then the backend eager TE would pick, chosen at trace time by TE's own
  `get_attention_backend` run on the same parameters (attention_backends.py), then
  - FusedAttention (cuDNN, TE's default on Hopper): one `te_compile::fused_attn_fwd` op,
  - UnfusedDotProductAttention (when forced, e.g. NVTE_FUSED_ATTN=0 without flash-attn):
    TE's own module, which TE 2.20 wrote traceable (its softmax kernels are TE custom ops),
  - FlashAttention (when forced, e.g. NVTE_FUSED_ATTN=0 with flash-attn installed): TE's own
    module, traced: flash-attn >= 2.7 registers its kernels as torch custom ops; older
    flash-attn, FlashAttention 3 and 4 are refused by name.
- `MultiheadAttention.forward`: TE's forward, traced, after refusing what the compiled path
  does not cover (FP8 attention, KV caching). Its pieces that dynamo cannot trace are swapped:
  `SplitAlongDim.apply` (a data-pointer test in backward) becomes `torch.split`, and
  `apply_rotary_pos_emb(fused=True)` becomes `te_compile::fused_rope_fwd` (TE's kernel).
- `TransformerLayer.forward` is TE's, traced (its LayerNormMLP, norms and linears are the
  te_compile compiled paths).

Refused by name (UnsupportedUnderCompileError): FP8 attention (recipe fp8_dpa / fp8_mha),
context parallelism, KV caching (inference_params), THD format and
THD policies, attention bias and ALiBi, non-vanilla softmax, return_max_logit, score_mod,
attention dropout under a CUDA RNG states tracker, and flash-attn < 2.7, FlashAttention 3 / 4.
"""

from __future__ import annotations

import torch

from .. import ops  # noqa: F401  (registers the te_compile ops)
from ..ops.attention import FusedAttnSpec
from ..patching import Swap
from . import attention_backends as backends
from . import checkpointing, gemm_common
from . import linear as _linear  # DEVICE_TYPES: the devices every compiled path accepts

DPA = "te.DotProductAttention"
MHA = "te.MultiheadAttention"
FORMATS = ("sbhd", "bshd")


def _unsupported(name: str, option: str, fix: str = ""):
    return gemm_common.unsupported(name, option, fix)


# ---- DotProductAttention -----------------------------------------------------------------------


def _recipe_fp8_attention() -> bool:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

    recipe = state.get_fp8_recipe() if state.is_fp8_enabled() else None
    return recipe is not None and bool(recipe.fp8_dpa or recipe.fp8_mha)


def _check_dpa_options(m, call: dict) -> None:
    """Refuse what this compiled path does not implement (see the module docstring)."""
    fix_fp8 = "set fp8_dpa=False and fp8_mha=False in the recipe (FP8 GEMMs stay on)"
    if _recipe_fp8_attention():
        raise _unsupported(DPA, "FP8 attention (recipe fp8_dpa=True or fp8_mha=True)", fix_fp8)
    if m.cp_group is not None:
        raise _unsupported(DPA, "context parallelism (cp_group)", "leave cp_group unset")
    if call["inference_params"] is not None:
        raise _unsupported(DPA, "KV caching (inference_params)", "run inference eagerly")
    if call["thd_attention_policies"] is not None:
        raise _unsupported(DPA, "thd_attention_policies", "use qkv_format sbhd or bshd")
    if call["core_attention_bias_type"] != "no_bias" or call["alibi_slopes"] is not None:
        raise _unsupported(
            DPA,
            f"core_attention_bias_type={call['core_attention_bias_type']!r} / alibi_slopes",
            "use core_attention_bias_type='no_bias'",
        )
    if any(call[n] is not None for n in ("score_mod", "score_mod_bprop")):
        raise _unsupported(DPA, "score_mod", "drop score_mod")
    if m.softmax_type != "vanilla":
        raise _unsupported(DPA, f"softmax_type={m.softmax_type!r}", "use softmax_type='vanilla'")
    if m.return_max_logit:
        raise _unsupported(DPA, "return_max_logit=True", "set return_max_logit=False")
    if m.rng_states_tracker is not None and m.attention_dropout > 0:
        raise _unsupported(
            DPA,
            "attention dropout under a CUDA RNG states tracker (get_rng_state_tracker)",
            "drop the tracker or set attention_dropout=0",
        )


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
    gemm_common.check_device(_linear.DEVICE_TYPES, q, k, v)
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
    if mask_type == "arbitrary":
        raise _unsupported(DPA, "attn_mask_type='arbitrary'", "use a padding or causal mask")
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


def compiled_dpa_forward(m, call: dict):
    """The traceable DotProductAttention.forward; `call` maps TE's parameter names to the
    arguments of this call. checkpoint_core_attention: the attention recomputed in backward,
    as eager TE's te.distributed.checkpoint around its core attention."""
    if call["checkpoint_core_attention"] and torch.is_grad_enabled():
        inner = dict(call, checkpoint_core_attention=False)
        return checkpointing.checkpoint(compiled_dpa_forward, m, inner)
    _check_dpa_options(m, call)
    qkv_format = call["qkv_format"] or m.qkv_format
    if qkv_format not in FORMATS:
        raise _unsupported(DPA, f"qkv_format={qkv_format!r}", "use 'sbhd' or 'bshd'")
    tensors, q, k, v, layout = _inputs(call, qkv_format)
    _check_shapes(m, q, k, v, qkv_format)
    mask_type, window, diagonal = _mask_and_window(m, call)
    softcap = call["softcap"] if call["softcap"] is not None else m.softcap
    if softcap < 0.0 or softcap != softcap or softcap == float("inf"):
        raise ValueError(f"softcap must be finite and non-negative, got {softcap}.")
    s_dim, b_dim = (0, 1) if qkv_format == "sbhd" else (1, 0)
    batch = int(q.shape[b_dim])
    max_q = int(q.shape[s_dim]) if call["max_seqlen_q"] is None else int(call["max_seqlen_q"])
    max_kv = int(k.shape[s_dim]) if call["max_seqlen_kv"] is None else int(call["max_seqlen_kv"])
    cu_q = _cu_seqlens(m, call, mask_type, batch, max_q, 0, q.device)
    cu_kv = _cu_seqlens(m, call, mask_type, batch, max_kv, 1, k.device)
    pad_between_seqs = bool(call["pad_between_seqs"]) if call["pad_between_seqs"] else False
    dropout = float(m.attention_dropout)
    params = (
        ("qkv_dtype", str(q.dtype).removeprefix("torch.")),
        ("qkv_layout", layout),
        ("batch_size", batch),
        ("num_heads", int(q.shape[-2])),
        ("num_gqa_groups", int(k.shape[-2])),
        ("max_seqlen_q", max_q),
        ("max_seqlen_kv", max_kv),
        ("head_dim_qk", int(q.shape[-1])),
        ("head_dim_v", int(v.shape[-1])),
        ("attn_mask_type", mask_type),
        ("window_size", window),
        ("bottom_right_diagonal", diagonal),
        ("softcap", float(softcap)),
        ("core_attention_bias_type", "no_bias"),
        ("core_attention_bias_requires_grad", False),
        ("pad_between_seqs", pad_between_seqs),
        ("attention_dropout", dropout),
        ("cp_comm_type", m.cp_comm_type),
        ("deterministic", bool(m.deterministic)),
        ("is_training", bool(m.training)),
        # Eager TE passes fp8=self.fp8 (FP8 autocast on); get_attention_backend reads it only
        # together with fp8_dpa/fp8_mha, which _check_dpa_options refused.
        ("fp8", False),
        ("softmax_type", m.softmax_type),
        ("num_splits", int(call["num_splits"] or 1)),
        ("softmax_scale", float(m.softmax_scale)),
    )
    use_flash, flash_version, flash_refusal, use_fused, fused_backend, use_unfused = (
        backends.select_backend(params)
    )
    if use_flash:
        from transformer_engine.pytorch import cpu_offload

        if flash_refusal:
            raise _unsupported(
                DPA,
                f"the FlashAttention backend with flash-attn {flash_version} ({flash_refusal}; "
                "picked by TE for these inputs)",
                "install flash-attn >= 2.7, or set NVTE_FLASH_ATTN=0 to let TE pick cuDNN fused "
                "or unfused attention",
            )
        if cpu_offload.is_cpu_offload_enabled():
            raise _unsupported(DPA, "CPU activation offloading", "disable CPU offload")
        seqlens = (cu_q, cu_kv, max_q, max_kv)
        return backends.flash_attention(
            m, call, q, k, v, layout, seqlens, mask_type, window, softcap
        )
    if use_fused:
        config = FusedAttnSpec(
            qkv_layout=layout,
            attn_mask_type=mask_type,
            window_size=tuple(window),
            bottom_right_diagonal=diagonal,
            attn_scale=float(m.softmax_scale),
            dropout=dropout if m.training else 0.0,
            fast_zero_fill=bool(call["fast_zero_fill"]),
            is_training=bool(m.training),
            deterministic=bool(m.deterministic),
            backend=fused_backend,
        )
        out, _, _ = torch.ops.te_compile.fused_attn_fwd(
            tensors,
            cu_q[: batch + 1],
            cu_kv[: batch + 1],
            _padded(call["cu_seqlens_q_padded"], cu_q, batch, mask_type),
            _padded(call["cu_seqlens_kv_padded"], cu_kv, batch, mask_type),
            max_q,
            max_kv,
            config.key,
        )
        return out.view(*out.shape[:-2], -1)
    if use_unfused:
        from transformer_engine.pytorch.attention.dot_product_attention import (
            dot_product_attention as dpa_module,
        )

        return m.unfused_attention(
            dpa_module._alibi_cache,
            q,
            k,
            v,
            qkv_layout=layout,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_kv,
            max_seqlen_q=max_q,
            max_seqlen_kv=max_kv,
            attn_mask_type=mask_type,
            attention_mask=call["attention_mask"],
            window_size=window,
            bottom_right_diagonal=diagonal,
            softcap=softcap,
            core_attention_bias_type="no_bias",
            core_attention_bias=None,
            alibi_slopes=None,
            inference_params=None,
            softmax_offset=None,
            fp8=False,
            fp8_meta=m.fp8_meta,
            quantizers=m.quantizers,
            fp8_output=False,
        )
    raise ValueError(
        "No dot product attention backend is available for the provided inputs. Please run "
        "with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 to find out the reasons for disabling all "
        "backends."
    )


def _binder(original, method: bool = True):
    """A function mapping (args, kwargs) of a call of `original` (a method: `self` excluded) to
    a dict of every parameter (defaults filled in): plain dict work, which dynamo traces
    cheaply."""
    import inspect

    params = list(inspect.signature(original).parameters.values())[1 if method else 0 :]
    names = [p.name for p in params]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def bind(args, kwargs) -> dict:
        call = dict(defaults)
        call.update(zip(names, args, strict=False))
        call.update(kwargs)
        return call

    return bind


def make_dpa_forward(original):
    bind = _binder(original)

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return original(self, *args, **kwargs)
        return compiled_dpa_forward(self, bind(args, kwargs))

    forward.__doc__ = original.__doc__
    return forward


# ---- MultiheadAttention ------------------------------------------------------------------------


def _check_mha_options(m, inference_params) -> None:
    import os

    if _recipe_fp8_attention():
        raise _unsupported(
            MHA,
            "FP8 attention (recipe fp8_dpa=True or fp8_mha=True)",
            "set fp8_dpa=False and fp8_mha=False in the recipe (FP8 GEMMs stay on)",
        )
    if os.environ.get("NVTE_DPA_FP8_RECIPE", ""):
        raise _unsupported(MHA, "NVTE_DPA_FP8_RECIPE (FP8 attention)", "unset it")
    if inference_params is not None:
        raise _unsupported(MHA, "KV caching (inference_params)", "run inference eagerly")


def make_mha_forward(original):
    bind = _binder(original)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            _check_mha_options(self, bind(args, kwargs)["inference_params"])
        return original(self, *args, **kwargs)

    forward.__doc__ = original.__doc__
    return forward


def make_update_roles(original):
    """MultiheadAttention._update_output_quantizer_roles: with no FP8 boundary (what the
    compiled path allows, FP8 attention refused) every role is None; setting them without
    reading the submodules' names keeps the traced code free of per-layer guards (each
    layer's names differ: one recompile per block under regional compilation)."""
    bind = _binder(original)

    def _update_output_quantizer_roles(self, *args, **kwargs):
        flags = bind(args, kwargs)
        if not torch.compiler.is_compiling() or any(flags.values()):
            return original(self, *args, **kwargs)
        if self.attention_type == "self":
            qkv_linears = [self.layernorm_qkv if self.input_layernorm else self.qkv]
        else:
            query = self.layernorm_query if self.input_layernorm else self.query_layer
            qkv_linears = [query, self.key_value]
        roles = [(linear, "output_quantizer_role") for linear in qkv_linears] + [
            (self.proj, "grad_input_quantizer_role"),
            (self.core_attention, "output_quantizer_role"),
            (self.core_attention, "grad_input_quantizer_role"),
        ]
        for module, attr in roles:
            # Written only when not None already: a module attribute write inside
            # torch.utils.checkpoint is a side effect dynamo refuses (torch 2.11).
            if getattr(module, attr, None) is not None:
                setattr(module, attr, None)

    _update_output_quantizer_roles.__doc__ = original.__doc__
    return _update_output_quantizer_roles


# ---- pieces of MultiheadAttention's forward ----------------------------------------------------


def make_split_along_dim(original):
    """TE's SplitAlongDim (an autograd.Function) when not compiling; torch.split while tracing:
    the same views, and a backward that concatenates, as TE's does unless the gradients
    already share one buffer (a data-pointer test dynamo cannot trace). A plain class: dynamo
    traces `Function.apply` of a Function subclass itself, bypassing an overridden apply."""

    class SplitAlongDim:
        __doc__ = original.__doc__

        @staticmethod
        def apply(*args):
            if not torch.compiler.is_compiling():
                # TE's backward returns one gradient per argument its callers pass (3 without
                # `squeeze`): pass exactly the caller's arguments.
                return original.apply(*args)
            tensor, split_dim, split_size_or_sections, *rest = args
            squeeze = bool(rest[0]) if rest else False
            if gemm_common.is_quantized(tensor):
                raise _unsupported(MHA, "FP8 QKV projection outputs", "use fp8_mha=False")
            parts = torch.split(tensor, split_size_or_sections, dim=split_dim)
            return tuple(p.squeeze(split_dim) for p in parts) if squeeze else parts

    return SplitAlongDim


def make_apply_rotary_pos_emb(original):
    bind = _binder(original, method=False)

    def apply_rotary_pos_emb(*args, **kwargs):
        call = bind(args, kwargs)
        if not (torch.compiler.is_compiling() and call["fused"]):
            # Not compiling (exactly the caller's arguments), or TE's unfused RoPE (plain
            # PyTorch, traceable).
            return original(*args, **kwargs)
        tensor_format, cu_seqlens, freqs = call["tensor_format"], call["cu_seqlens"], call["freqs"]
        if tensor_format == "thd" and cu_seqlens is None:
            raise ValueError("cu_seqlens must not be None when tensor_format is 'thd'.")
        if tensor_format not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"Unsupported tensor_format: {tensor_format}.")
        if freqs.dtype != torch.float32:  # as TE's FusedRoPEFunc
            freqs = freqs.float()
        return torch.ops.te_compile.fused_rope_fwd(
            call["t"],
            freqs,
            call["start_positions"],
            cu_seqlens,
            tensor_format,
            bool(call["interleaved"]),
            int(call["cp_size"]),
            int(call["cp_rank"]),
        )

    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def swaps() -> list[Swap]:
    from transformer_engine.pytorch import utils
    from transformer_engine.pytorch.attention import multi_head_attention as mha_module
    from transformer_engine.pytorch.attention import rope
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention,
    )

    mha = mha_module.MultiheadAttention
    return [
        Swap(
            DotProductAttention, "forward", make_dpa_forward(vars(DotProductAttention)["forward"])
        ),
        Swap(mha, "forward", make_mha_forward(vars(mha)["forward"])),
        Swap(
            mha,
            "_update_output_quantizer_roles",
            make_update_roles(vars(mha)["_update_output_quantizer_roles"]),
        ),
        Swap(utils, "SplitAlongDim", make_split_along_dim(utils.SplitAlongDim)),
        Swap(rope, "apply_rotary_pos_emb", make_apply_rotary_pos_emb(rope.apply_rotary_pos_emb)),
    ]
