"""The ops the graph path (graph_fp8/) keeps out of inductor: where TE's kernels or ATen's give
TE's bytes, or do the job faster than inductor's generated code.

- bias_grad: a bias's gradient. Eager TE's `bgrad_quantize` sums grad_output over rows with
  `at::sum_out` wherever it does not fuse the sum into its cast kernel (Float8CurrentScaling
  always). Inductor would generate its own reduction, whose order of float additions differs,
  so the rounded bf16 sums may differ in the last bit; ATen's sum kernel on the same tensor is
  bit-identical to TE's, for one small launch.
- fp8_transpose: FP8 data's transposed copy (the column-wise data Hopper's FP8 GEMMs read) by
  TE's transpose kernel, for large tensors (graph_fp8/linear.py says when).
- scaled_mm_transposing: one FP8 GEMM (aten's `_scaled_mm`, as the graph calls it) and the
  transposed copy of one of its operands (TE's transpose kernel), where both read an FP8 tensor
  the graph has just cast: as two consumers, each asking inductor for exact strides, they made
  it store the cast's bytes twice (graph_fp8/linear.py); as one, it stores them once.
- activation_grad: LayerNormMLP's activation gradient with Float8CurrentScaling, by TE's own
  `tex.d<act>` (float32 arithmetic, stored in grad's dtype). The same formula compiled by
  inductor matched TE's kernel on every input tried alone, yet a GPT trained on it parted from
  eager TE by one bf16 step at the 4th step (session 20, H100); with this kernel it did not. Why
  the compiled formula parted inside the MLP's backward kernel was not found.
- delayed_grad_quantize: DelayedScaling's gradient quantization where eager TE fuses a bias
  gradient into it (te.Linear's and FC2's grad_output with a bias, LayerNormMLP's activation
  backward always). TE's fused kernel sums the bias gradient in its own order (per-tile float32
  partial sums, then a reduction), which no graph reduction reproduces bit for bit: the op
  calls that kernel, as eager TE does, and returns its FP8 data with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import activation, extension, gemm_layer
from ..kernels.te_dtypes import TORCH_FP8
from ..recipes import QuantConfig
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


@op()
def scaled_mm_transposing(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    fast_accum: bool,
    transpose_b: bool,
) -> tuple[Tensor, Tensor]:
    """(a @ b.T of row-major FP8 `a` [M, K] and `b` [N, K], the transposed copy of `b` if
    `transpose_b` else of `a`): aten's `_scaled_mm` as the graph path calls it, and
    fp8_transpose's bytes."""
    y = torch.ops.aten._scaled_mm(
        a,
        b.t(),
        a_scale_inv,
        b_scale_inv,
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    return y, fp8_transpose.impl(b if transpose_b else a)


@scaled_mm_transposing.fake
def _(a):
    copied = a.b if a.transpose_b else a.a
    y = a.a.new_empty((a.a.shape[0], a.b.shape[0]), dtype=a.out_dtype)
    return y, copied.new_empty(copied.shape[::-1])


@op()
def activation_grad(grad: Tensor, act_input: Tensor, act: str) -> Tensor:
    """`tex.d<act>(grad, act_input, None)`: the activation's gradient in grad's dtype."""
    return activation.dactivate(grad, act_input, act, ())


activation_grad.fake(lambda a: a.grad.new_empty(a.grad.shape))


@op()
def delayed_grad_quantize(
    grad: Tensor, act_input: Tensor | None, scales: Tensor, slot: int, config: str, act: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """DelayedScaling's quantization of 2-D `grad` for the grad_output role, with the scale
    `scales[slot]`, and the bias gradient TE's kernel fuses into it: `tex.bgrad_quantize(grad)`,
    or with `act_input` (LayerNormMLP's FC1 output) `tex.dbias_d<act>(grad, act_input)`, which
    quantizes the activation's gradient. Returns (dbias, FP8 data, its transpose, scale_inv [1],
    amax [1]); the caller records the amax into TE's history. `scales`: the direction's whole
    tensor, so that the backward reads TE's tensor itself (a slice taken outside the op may be
    taken in the forward graph and saved: graph_fp8.delayed.scale_for_te_cast)."""
    cfg = QuantConfig.from_key(config)
    state = [scales[slot : slot + 1], grad.new_zeros(1, dtype=torch.float32)]
    if act_input is None:
        dbias, q = gemm_layer.quantize(grad, cfg, "grad", True, True, state, bgrad=True)
    else:
        q, dbias = activation.backward(grad, act_input, cfg, act, (), state=state)
    fp8 = TORCH_FP8[cfg.dtypes[2]]
    return dbias, q._data.view(fp8), q._transpose.view(fp8), q._scale_inv.view(1), state[1]


@delayed_grad_quantize.fake
def _(a):
    fp8 = TORCH_FP8[QuantConfig.from_key(a.config).dtypes[2]]
    g, (rows, cols) = a.grad, a.grad.shape
    scalars = [g.new_empty([1], dtype=torch.float32) for _ in range(2)]
    return (
        g.new_empty([cols]),
        g.new_empty(g.shape, dtype=fp8),
        g.new_empty([cols, rows], dtype=fp8),
        *scalars,
    )
