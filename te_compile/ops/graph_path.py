"""The ops the graph path (graph_fp8/) keeps out of inductor: where TE's kernels or ATen's give
TE's bytes, or do the job faster than inductor's generated code.

- bias_grad: a bias's gradient. Eager TE's `bgrad_quantize` sums grad_output over rows with
  `at::sum_out` wherever it does not fuse the sum into its cast kernel (Float8CurrentScaling
  always). Inductor would generate its own reduction, whose order of float additions differs,
  so the rounded bf16 sums may differ in the last bit; ATen's sum kernel on the same tensor is
  bit-identical to TE's, for one small launch.
- fp8_transpose: FP8 data's transposed copy (the column-wise data Hopper's FP8 GEMMs read) by
  TE's transpose kernel, for large tensors (graph_fp8/linear.py says when).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import extension
from .registry import op


@op()
def bias_grad(grad_output: Tensor) -> Tensor:
    """The sum of 2-D `grad_output` over its rows, in its dtype (ATen accumulates in float32),
    on a contiguous copy as TE's (the layout decides ATen's order of additions)."""
    return grad_output.contiguous().sum(dim=0)


bias_grad.fake(lambda a: a.grad_output.new_empty(a.grad_output.shape[-1:]))


@op()
def fp8_transpose(data: Tensor) -> Tensor:
    """2-D FP8 `data` transposed, contiguous: tex.fp8_transpose's bytes."""
    fp8 = extension.te_dtype(data.dtype)
    out = extension.tex().fp8_transpose(data.contiguous().view(torch.uint8), fp8, out=None)
    return out.view(data.dtype)


fp8_transpose.fake(lambda a: a.data.new_empty(a.data.shape[::-1]))
