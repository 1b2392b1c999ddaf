"""A GEMM weight's Float8CurrentScaling quantization as graph operations, for the TE-kernel ops.

The ops quantize every GEMM weight with TE's `quantize` each step (eager TE does the same): one
call into TE's extension per weight and step, about as much CPU as the GEMM itself. A weight's
current-scaling FP8 depends on the weight alone, so it can be computed in the graph instead,
with quantize.py's arithmetic (bit-identical to TE's kernels: tests/gpu/test_graph_fp8_gpu.py),
and handed to the op as an FP8 weight's parts, the layout of an FP8 weight cache
([data, transpose, scale_inv]): inductor issues it as a few Triton kernels and the op skips its
weight quantization. Opt-in (`te_compile.configure(graph_weight_quantize=True)`): on an H100
it issued 16 fewer kernels per step of a 4-layer TransformerLayer stack but took more GPU time
(inductor reads the weight once more than TE's fused cast-transpose) and no measurable CPU time
off (docs/perf/history.md, session 11). DelayedScaling and the block-scaled recipes keep TE's
kernels.
"""

from __future__ import annotations

import torch

from .. import options
from ..recipes import ROLES, QuantConfig
from . import quantize

_WEIGHT = ROLES.index("weight")


def applies(m, weight: torch.Tensor, cfg: QuantConfig) -> bool:
    """Whether a module's GEMM weight is quantized in the graph (read at trace time)."""
    return (
        options.current().graph_weight_quantize
        and cfg.kind == "current"
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and getattr(m, "tp_size", 1) == 1
    )


def current_weight_parts(weight: torch.Tensor, cfg: QuantConfig) -> list[torch.Tensor]:
    """[data, (transpose), scale_inv] of `weight` quantized as TE's weight quantizer of `cfg`
    would: uint8 data as TE stores it, the transposed copy when backward may need it (grad
    enabled and `cfg.fp8_transpose`), scale_inv float32 [1]. No gradient flows through them:
    the op returns the weight's gradient through its `weight` argument."""
    fp8 = cfg.dtypes[_WEIGHT]
    data, scale_inv = quantize.quantize_current(
        weight.detach(), fp8, cfg.amax_eps[_WEIGHT], cfg.pow2[_WEIGHT]
    )
    data = data.view(torch.uint8)
    transpose = [data.t().contiguous()] if cfg.fp8_transpose and torch.is_grad_enabled() else []
    return [data, *transpose, scale_inv]
