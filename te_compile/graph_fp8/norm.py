"""The float32 value TE's fused norm + DelayedScaling cast quantizes, recomputed in the graph.

With a delayed-scaling quantizer TE's norm kernel casts its float32 result straight to FP8 (and
records its amax); it never rounds it to bfloat16, and TE has no norm kernel with a float32
output for bfloat16 input. The graph path therefore takes `mu` and `rsigma` from TE's own norm
kernel (te_compile::norm_fwd: the same statistics, the bf16- and FP8-output kernels share their
launch configurations) and recomputes the value as TE's `ln_fwd_kernels.cuh` and
`rmsnorm_fwd_kernels.cuh` do: LayerNorm `rs * (x - mu)`, then `g * y + b`, which nvcc contracts
into one fused multiply-add (rounded once); RMSNorm `rs * x`, then `g * y`; with zero-centered
gamma `g + 1` first. Inductor fuses it into the amax and the cast.

The multiply-add goes through quantize.fused_multiply_add (float64, rounded once), so that it
does not depend on whether the compiler contracts: eager PyTorch does not, nor did inductor's
kernel in a TransformerLayer's graph (session 29), and a value a float32 step from an FP8 tie
then cast to the neighbouring FP8 value (scaled -15.500001, to -16, where TE's kernel cast -15:
a DelayedScaling layer one bf16 step off eager TE). tests/cpu/test_graph_fp8_fma.py.
"""

from __future__ import annotations

import torch

from ..spec import NormSpec
from .quantize import fused_multiply_add


def unrounded(x, gamma, beta, mu, rsigma, spec: NormSpec) -> torch.Tensor:
    """float32 [tokens, hidden]: the norm of 2-D `x` before its output is rounded. Detached: it
    only feeds the quantization; gradients flow through TE's norm op."""
    x, gamma, mu, rsigma = (t.detach() for t in (x, gamma, mu, rsigma))
    g = gamma.float()
    if spec.zero_centered_gamma:
        g = g + 1
    rs = rsigma.view(-1, 1)
    if spec.normalization == "RMSNorm":
        return (x.float() * rs) * g
    y = (x.float() - mu.view(-1, 1)) * rs
    return fused_multiply_add(y, g, beta.detach().float())
