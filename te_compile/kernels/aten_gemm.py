"""FP8 GEMMs through aten's scaled matmul instead of TE's `generic_gemm`.

Per-tensor FP8 GEMMs (Float8CurrentScaling, DelayedScaling) through aten's `_scaled_mm`
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

Float8BlockScaling GEMMs (`block_scaled_mm`, opt-in: `configure(aten_block_gemm=True)`) through
aten's `_scaled_mm_v2` with 1x128 and 128x128 block scales, the halves as above (row-wise data
for `_data`, column-wise for `_transpose`). TE keeps its block scales GEMM-ready, transposed
and padded to multiples of 4 ([ceil(cols/128), round4(rows)] for 1x128 blocks of a [rows, cols]
matrix, [ceil(rows/128), round4(ceil(cols/128))] for 128x128 blocks): their transposed views
are the outer-dim-major scales aten's Hopper path requires, no copy. TE's cuBLASLt call sets
the same scale modes (VEC128_32F, BLK128x128_32F) and no fast accumulation; whether cuBLASLt
picks the same algorithm for both callers is for tests/gpu/test_aten_gemm_gpu.py to show.
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
    return _two_d(getattr(t, half).view(_te()[1][fp8_dtype]), half)


def _two_d(data: torch.Tensor, half: str) -> torch.Tensor:
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


# ScalingType values of torch.nn.functional (BlockWise1x128, BlockWise128x128)
_BLOCK_RECIPE = {False: 4, True: 5}
_BLOCK_HALVES = {
    "_data": ("_rowwise_data", "_rowwise_scale_inv"),
    "_transpose": ("_columnwise_data", "_columnwise_scale_inv"),
}


@functools.cache
def _block_te():
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )

    return Float8BlockwiseQTensorStorage, int(tex.DType.kFloat8E4M3)  # (storages hold an IntEnum)


def _block_matrix(t, half: str):
    """(the half's [rows, cols] FP8 matrix, its scales as aten reads them), or None where the
    scales are not TE's GEMM-ready layout for that matrix (1x128 blocks: rows a multiple of 4,
    so that TE's padding is none and aten's exact stride check holds)."""
    data_name, scale_name = _BLOCK_HALVES[half]
    data, scale = getattr(t, data_name), getattr(t, scale_name)
    if data is None or scale is None or not (data.is_contiguous() and scale.is_contiguous()):
        return None
    matrix = _two_d(data.view(torch.float8_e4m3fn), half)
    rows, col_blocks = matrix.shape[0], -(-matrix.shape[1] // 128)
    if t._is_2D_scaled:
        want = (-(-rows // 128), -(-col_blocks // 4) * 4)
    else:
        want = (col_blocks, rows)  # rows % 4 != 0 would leave TE's padding in the stride
    return (matrix, scale.t()) if tuple(scale.shape) == want else None


def block_scaled_mm(a, b, layout: str, out_dtype: torch.dtype, bias):
    """TE's `generic_gemm(a, b, layout)` (split accumulation, no fast accumulation: TE's only
    mode for block scaling) for two Float8BlockScaling storages, or None where this path does
    not apply (other operands, E5M2 data, a half missing, dimensions not multiples of 16, two
    128x128 operands, a bias aten does not take): the caller then runs TE's GEMM."""
    storage, e4m3 = _block_te()
    if not (isinstance(a, storage) and isinstance(b, storage)):
        return None
    if (
        int(a._fp8_dtype) != e4m3
        or int(b._fp8_dtype) != e4m3
        or (a._is_2D_scaled and b._is_2D_scaled)
    ):
        return None
    if bias is not None and (bias.dtype != out_dtype or out_dtype == torch.float32):
        return None
    b_half, a_half = _HALVES[layout]
    first, second = _block_matrix(b, b_half), _block_matrix(a, a_half)
    if first is None or second is None:
        return None
    (mat1, scale1), (mat2, scale2) = first, second
    if mat1.shape[1] != mat2.shape[1] or mat1.shape[1] % 16 or mat2.shape[0] % 16:
        return None
    out = torch.ops.aten._scaled_mm_v2(
        mat1,
        mat2.t(),
        [scale1],
        [_BLOCK_RECIPE[b._is_2D_scaled]],
        [],
        [scale2],
        [_BLOCK_RECIPE[a._is_2D_scaled]],
        [],
        bias,
        out_dtype,
        [],
        False,
    )
    if b_half == "_data":  # B's leading dimensions, as generic_gemm shapes its output
        return out.view(*b._rowwise_data.shape[:-1], out.shape[-1])
    return out
