"""The custom ops: registrations only, each declared once (registry.py) from its typed
implementation. Arguments are plain values (tensors, numbers, strings, lists; configuration as
one `Spec.key` string per role, spec.py); TE objects (quantizers, FP8 storages) live inside the
op bodies, which call into TE through kernels/.

Importing this package registers, per TE module family: te_compile::linear_fwd, linear_bwd,
quantize_weight (linear.py); norm_fwd, norm_bwd (norm.py); layernorm_linear_fwd/_bwd
(layernorm_linear.py); layernorm_mlp_fwd/_bwd (layernorm_mlp.py; its saved-tensor layout in
layernorm_mlp_layout.py); fused_attn_fwd/_bwd (attention.py); fused_rope_fwd/_bwd (rope.py);
amax_and_scale_update, scale_snapshot, scale_in_backward (delayed_scaling.py); bias_grad,
fp8_transpose (graph_path.py, for graph_fp8/)."""

from . import (  # noqa: F401
    attention,
    delayed_scaling,
    graph_path,
    layernorm_linear,
    layernorm_mlp,
    linear,
    norm,
    rope,
)
