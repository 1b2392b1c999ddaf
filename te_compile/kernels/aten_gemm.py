"""Per-tensor FP8 GEMMs (Float8CurrentScaling, DelayedScaling) through aten's `_scaled_mm`
instead of TE's `generic_gemm`: the same cuBLASLt FP8 GEMM in TN layout with per-tensor
scale_inv pointers, fast accumulation unless split accumulation, the bias in the epilogue, at
about a third of the CPU cost per call (no TE storage to unpack in C++, no workspace or
quantizer plumbing). tests/gpu/test_aten_gemm_gpu.py checks it bit for bit against
`generic_gemm` over shapes, layouts and both accumulation modes; `te_compile.configure(
aten_fp8_gemm=False)` sends every GEMM back to TE.

TE's layouts (its column-major convention; Hopper FP8 GEMMs read the transposed copies that
make every GEMM TN), as `_scaled_mm(mat1 row-major, mat2 column-major)`:

    "TN" fprop  y  = x @ W.T    mat1 = B.data       mat2 = A.data.T
    "NN" dgrad  dx = dy @ W     mat1 = B.data       mat2 = A.transpose.T
    "NT" wgrad  dW = dy.T @ x   mat1 = B.transpose  mat2 = A.transpose.T
"""

from __future__ import annotations

import functools

import torch

# layout -> (B's half read as mat1, A's half read as mat2)
_HALVES = {
    "TN": ("_data", "_data"),
    "NN": ("_data", "_transpose"),
    "NT": ("_transpose", "_transpose"),
}


@functools.cache
def _te():
    from transformer_engine.pytorch.constants import TE_DType_To_Torch
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
        Float8TensorStorage,
    )

    return Float8TensorStorage, TE_DType_To_Torch


def _matrix(t, half: str, fp8_dtype) -> torch.Tensor:
    data = getattr(t, half).view(_te()[1][fp8_dtype])
    # Row-wise data is [*leading, last]; TE's transposed copy is [last, *leading].
    return data.view(-1, data.shape[-1]) if half == "_data" else data.reshape(data.shape[0], -1)


def scaled_mm(a, b, layout: str, out_dtype: torch.dtype, split_accumulator: bool, bias):
    """TE's `generic_gemm(a, b, layout)` for two per-tensor FP8 storages, or None where this
    path does not apply (other operands, a half missing or not contiguous, dimensions not
    multiples of 16, a bias of another dtype than the output): the caller then runs TE's GEMM."""
    storage = _te()[0]
    if not (isinstance(a, storage) and isinstance(b, storage)):
        return None
    if bias is not None and bias.dtype != out_dtype:
        return None
    b_half, a_half = _HALVES[layout]
    halves = (getattr(b, b_half), getattr(a, a_half))
    if any(h is None or not h.is_contiguous() for h in halves):
        return None
    mat1 = _matrix(b, b_half, b._fp8_dtype)
    mat2 = _matrix(a, a_half, a._fp8_dtype).t()
    if mat1.shape[1] != mat2.shape[0] or mat1.shape[1] % 16 or mat2.shape[1] % 16:
        return None
    out = torch.ops.aten._scaled_mm(
        mat1,
        mat2,
        b._scale_inv,
        a._scale_inv,
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=not split_accumulator,
    )
    if b_half == "_data":  # B's leading dimensions, as generic_gemm shapes its output
        return out.view(*b._data.shape[:-1], out.shape[-1])
    return out
