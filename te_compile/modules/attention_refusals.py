"""What the compiled attention paths refuse by name (UnsupportedUnderCompileError), checked while
dynamo traces, before any of TE's work: FP8 attention (recipe fp8_dpa / fp8_mha,
NVTE_DPA_FP8_RECIPE, FP8 QKV projection outputs), context parallelism, KV caching
(inference_params), THD format and THD policies, attention bias and ALiBi, non-vanilla softmax,
return_max_logit, score_mod, attention dropout under a CUDA RNG states tracker, the 'arbitrary'
mask, and flash-attn < 2.7, FlashAttention 3 / 4 or FlashAttention under CPU offloading.
"""

from __future__ import annotations

import os

from .gemm_common import is_quantized, unsupported

DPA = "te.DotProductAttention"
MHA = "te.MultiheadAttention"


def _refuse_fp8_attention(name: str) -> None:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

    recipe = state.get_fp8_recipe() if state.is_fp8_enabled() else None
    if recipe is not None and bool(recipe.fp8_dpa or recipe.fp8_mha):
        raise unsupported(
            name,
            "FP8 attention (recipe fp8_dpa=True or fp8_mha=True)",
            "set fp8_dpa=False and fp8_mha=False in the recipe (FP8 GEMMs stay on)",
        )


def check_dpa_options(m, call: dict, qkv_format: str) -> None:
    """DotProductAttention `m` called with `call` (TE's parameter names)."""
    _refuse_fp8_attention(DPA)
    if m.cp_group is not None:
        raise unsupported(DPA, "context parallelism (cp_group)", "leave cp_group unset")
    if call["inference_params"] is not None:
        raise unsupported(DPA, "KV caching (inference_params)", "run inference eagerly")
    if call["thd_attention_policies"] is not None:
        raise unsupported(DPA, "thd_attention_policies", "use qkv_format sbhd or bshd")
    if call["core_attention_bias_type"] != "no_bias" or call["alibi_slopes"] is not None:
        raise unsupported(
            DPA,
            f"core_attention_bias_type={call['core_attention_bias_type']!r} / alibi_slopes",
            "use core_attention_bias_type='no_bias'",
        )
    if any(call[n] is not None for n in ("score_mod", "score_mod_bprop")):
        raise unsupported(DPA, "score_mod", "drop score_mod")
    if m.softmax_type != "vanilla":
        raise unsupported(DPA, f"softmax_type={m.softmax_type!r}", "use softmax_type='vanilla'")
    if m.return_max_logit:
        raise unsupported(DPA, "return_max_logit=True", "set return_max_logit=False")
    if m.rng_states_tracker is not None and m.attention_dropout > 0:
        raise unsupported(
            DPA,
            "attention dropout under a CUDA RNG states tracker (get_rng_state_tracker)",
            "drop the tracker or set attention_dropout=0",
        )
    if qkv_format not in ("sbhd", "bshd"):  # a literal: a global table read here is guarded
        raise unsupported(DPA, f"qkv_format={qkv_format!r}", "use 'sbhd' or 'bshd'")


def check_mask_type(mask_type: str) -> None:
    if mask_type == "arbitrary":
        raise unsupported(DPA, "attn_mask_type='arbitrary'", "use a padding or causal mask")


def check_flash(flash_version: str, flash_refusal: str) -> None:
    """The FlashAttention backend TE picked (attention_backends.flash_refusal says why a
    flash-attn version cannot trace)."""
    from transformer_engine.pytorch import cpu_offload

    if flash_refusal:
        raise unsupported(
            DPA,
            f"the FlashAttention backend with flash-attn {flash_version} ({flash_refusal}; "
            "picked by TE for these inputs)",
            "install flash-attn >= 2.7, or set NVTE_FLASH_ATTN=0 to let TE pick cuDNN fused "
            "or unfused attention",
        )
    if cpu_offload.is_cpu_offload_enabled():
        raise unsupported(DPA, "CPU activation offloading", "disable CPU offload")


def check_mha_options(inference_params) -> None:
    _refuse_fp8_attention(MHA)
    if os.environ.get("NVTE_DPA_FP8_RECIPE", ""):
        raise unsupported(MHA, "NVTE_DPA_FP8_RECIPE (FP8 attention)", "unset it")
    if inference_params is not None:
        raise unsupported(MHA, "KV caching (inference_params)", "run inference eagerly")


def check_split_input(tensor) -> None:
    if is_quantized(tensor):
        raise unsupported(MHA, "FP8 QKV projection outputs", "use fp8_mha=False")
