"""te_compile::bias_grad: a bias's gradient summed by ATen, outside inductor.

Eager TE's `bgrad_quantize` sums grad_output over rows with `at::sum_out` wherever it does not
fuse the sum into its cast kernel (Float8CurrentScaling always; the unquantized path). Inductor
would generate its own reduction, whose order of float additions differs, so the rounded bf16
sums may differ in the last bit. The graph path (graph_fp8/) calls this op instead: ATen's sum
kernel on the same tensor, bit-identical to TE's, for one small launch.
"""

from __future__ import annotations

from torch import Tensor

from .registry import op


@op()
def bias_grad(grad_output: Tensor) -> Tensor:
    """The sum of 2-D `grad_output` over its rows, in its dtype (ATen accumulates in float32),
    on a contiguous copy as TE's (the layout decides ATen's order of additions)."""
    return grad_output.contiguous().sum(dim=0)


bias_grad.fake(lambda a: a.grad_output.new_empty(a.grad_output.shape[-1:]))
