"""FP8 written as graph operations: per-tensor quantization and the scaled GEMMs in aten ops, so
that inductor fuses the amax, scale and cast into the kernels around them and no call goes into
TE's C++ extension. The default for small per-tensor (Float8CurrentScaling, DelayedScaling)
GEMMs (`linear.wanted`; the option `graph_fp8`), where it is bit-identical to eager TE; otherwise
the compile path calls TE's own kernels through te_compile's ops. docs/graph_fp8.md states
where the two agree bit for bit and where they do not.

- `quantize.py`: TE's per-tensor FP8 arithmetic (amax, scale from amax, saturating cast).
- `linear.py`: te.Linear's forward and backward on those, with aten's scaled GEMM.
- `mlp.py`: LayerNormMLP's FC1 -> GELU -> FC2; `norm.py`: the float32 norm value DelayedScaling's
  fused norm casts; `delayed_update.py`: DelayedScaling's backward amax/scale update;
  `delayed.py`: DelayedScaling's scales, casts and backward state for linear.py and mlp.py;
  `te_dbias.py`: a bias gradient in the order of TE's fused cast kernel (opt-in, `graph_dbias`).
- `weight.py`: current-scaling weights quantized in the graph for the TE-kernel ops (opt-in).
"""
