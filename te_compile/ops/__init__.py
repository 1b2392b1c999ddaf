"""Custom ops, one file per TE kernel family, on a shared core (core.py: TE's GEMM and cached
quantizers). Arguments are plain values (tensors, numbers, strings, lists; the recipe config is
one string, `QuantConfig.key`); TE objects (quantizers, FP8 storages) live inside the ops.

Importing this package registers: te_compile::amax_and_scale_update (delayed_scaling.py),
te_compile::linear_fwd, te_compile::linear_bwd and te_compile::quantize_weight (linear.py),
te_compile::norm_fwd and te_compile::norm_bwd (norm.py), te_compile::layernorm_linear_fwd and
te_compile::layernorm_linear_bwd (layernorm_linear.py), te_compile::layernorm_mlp_fwd and
te_compile::layernorm_mlp_bwd (layernorm_mlp.py), te_compile::fused_attn_fwd and
te_compile::fused_attn_bwd (attention.py), te_compile::fused_rope_fwd and te_compile::fused_rope_bwd
(rope.py)."""

from . import (  # noqa: F401
    attention,
    delayed_scaling,
    layernorm_linear,
    layernorm_mlp,
    linear,
    norm,
    rope,
)
