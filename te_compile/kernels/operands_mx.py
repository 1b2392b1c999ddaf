"""MXFP8 and NVFP4 GEMM operands as plain tensors (the block-scaled formats of Blackwell).

Quantizers are built as te.Linear's recipe state builds them (TE 2.20.2), from a `QuantConfig`
of kind "mxfp8" or "nvfp4". A quantized operand's column-wise half (what the backward GEMMs
read) crosses op boundaries as plain tensors:

- "mxfp8": [columnwise_data, columnwise_scale_inv]: uint8 of the operand's own shape (MXFP8
  keeps column-scaled data untransposed) and uint8 E8M0 scales of
  `MXFP8Quantizer.get_scale_shape(shape, columnwise=True)` (padded to [4, 128] multiples).
- "nvfp4": [columnwise_data, columnwise_scale_inv, amax_columnwise]: uint8 [K, M // 2] (two FP4
  values a byte, transposed over the 2-D flattening [M, K] of the operand), uint8 E4M3 scales
  [round_up(K, 128), round_up(ceil(M / 16), 4)] and the float32 [1] column-wise amax (taken
  after the Hadamard transform when RHT is on).

Neither layout depends on the GPU generation: TE's is_non_tn_fp8_gemm_supported only changes
per-tensor FP8 storages (float8_tensor_storage.py); MXFP8 column-wise data is never
transposed and NVFP4's always is.
"""

from __future__ import annotations

import math

import torch

from ..recipes import ROLES, QuantConfig
from .te_dtypes import te_fp8_dtype

MX_KINDS = ("mxfp8", "nvfp4")


def make_mx_quantizer(cfg: QuantConfig, role: str, *, rowwise: bool, columnwise: bool):
    """The MXFP8 or NVFP4 quantizer of te.Linear's recipe state for `role`, before Linear sets
    its internal/optimize_for_gemm flags (the caller does)."""
    i = ROLES.index(role)
    if cfg.kind == "mxfp8":
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

        # quantization.py:1536-1549: with_2d_quantization only for Linear's weight
        # (module_type "linear", tensor_type "weight") under enable_2d_quantization.
        return MXFP8Quantizer(
            te_fp8_dtype(cfg.dtypes[i]),
            rowwise=rowwise,
            columnwise=columnwise,
            with_2d_quantization=cfg.block_dims[i] == 2,
        )
    if cfg.kind == "nvfp4":
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

        # quantization.py:1730-1745, for the configurations for_linear accepts (no row-scaled
        # activations, no 4over6: their defaults). The constructor reads the current CUDA
        # device (RHT matrix), so it runs only inside real op kernels.
        return NVFP4Quantizer(
            fp4_dtype=tex.DType.kFloat4E2M1,
            rowwise=rowwise,
            columnwise=columnwise,
            with_rht=cfg.rht[i],
            with_post_rht_amax=cfg.rht[i],
            with_2d_quantization=cfg.block_dims[i] == 2,
            # Gradients only (NVFP4BlockScaling.fp4_quant_bwd_grad). The kernel draws its Philox
            # seed and offset from the default CUDA generator (quantizer.cpp:2603-2626), inside
            # our opaque op, exactly where eager TE draws it: compiled and eager runs consume the
            # generator identically as long as the same quantizations run in the same order, so
            # with one seed they are bit-identical. Compiled backward runs grad quantizations in
            # the order of its graph; independent branches ordered differently from eager's
            # autograd engine, or other generator users (inductor's own random ops seed
            # differently), shift the offsets and break bit-equality, not correctness. Under
            # CUDA graphs the generator hands out graph-safe offsets, as in eager capture.
            stochastic_rounding=cfg.stochastic_rounding[i],
        )
    raise ValueError(f"no MXFP8/NVFP4 quantizer for QuantConfig kind {cfg.kind!r}")


def _rows_cols(shape) -> tuple[int, int]:
    return math.prod(shape[:-1]), shape[-1]


def swizzled_scales(cfg: QuantConfig, role: str, shape) -> bool:
    """Whether te.Linear's quantizer for `role` leaves `shape`'s scales in cuBLAS's swizzled
    layout (a storage flag the backward op must restore).

    MXFP8: always (Linear asks input and grad-output for GEMM-ready scales, and
    `_enable_weight_preswizzle` says yes for any MXFP8 weight, base.py:1292-1295; the C++
    storage takes the flag from optimize_for_gemm, quantizer.cpp:1509). NVFP4: only where a
    fused kernel emits them (quantizer.cpp:1934-1966 `nvfp4_emits_gemm_swizzled_scales`, on SM
    10.0-11.0): RHT with rows % 64 == 0 and cols % 128 == 0, else 2-D quantization with both
    % 128; the weight's preswizzle rule (base.py:1296-1308) asks for no more than that."""
    if cfg.kind == "mxfp8":
        return True
    from transformer_engine.pytorch.utils import get_device_compute_capability

    i = ROLES.index(role)
    major, minor = get_device_compute_capability()
    if not 100 <= 10 * major + minor <= 110:
        return False
    rows, cols = _rows_cols(shape)
    if cfg.rht[i]:
        return rows % 64 == 0 and cols % 128 == 0
    return cfg.block_dims[i] == 2 and rows % 128 == 0 and cols % 128 == 0


def check_swizzled(storage, cfg: QuantConfig, role: str, shape) -> None:
    """Forward-side check that `swizzled_scales` predicts what TE's kernels did."""
    if storage._with_gemm_swizzled_scales != swizzled_scales(cfg, role, shape):
        raise RuntimeError(
            f"te_compile: TE produced {cfg.kind} {role} scales with "
            f"with_gemm_swizzled_scales={storage._with_gemm_swizzled_scales} for shape "
            f"{list(shape)}, not what te_compile predicts; backward would misread them."
        )


def mx_columnwise_parts(storage, cfg: QuantConfig) -> list[torch.Tensor]:
    parts = [storage._columnwise_data, storage._columnwise_scale_inv]
    if cfg.kind == "nvfp4":
        parts.append(storage._amax_columnwise)
    return parts


def mx_columnwise_count(cfg: QuantConfig) -> int:
    return 3 if cfg.kind == "nvfp4" else 2


def _nvfp4_logical_shape(columnwise_data: torch.Tensor) -> list[int]:
    k, half_m = columnwise_data.shape
    return [2 * half_m, k]


def mx_columnwise_storage(parts: list[torch.Tensor], cfg: QuantConfig, role: str, fake_dtype):
    """A column-wise-only storage for `general_gemm`. The GEMM reads only the storage's
    attributes (type_converters.cpp NVTETensorFromMXFP8Tensor/NVTETensorFromNVFP4Tensor), so
    no quantizer is attached."""
    if cfg.kind == "mxfp8":
        from transformer_engine.pytorch.tensor.storage.mxfp8_tensor_storage import (
            MXFP8TensorStorage,
        )

        data, scale_inv = parts
        return MXFP8TensorStorage(
            None,
            None,
            data,
            scale_inv,
            te_fp8_dtype(cfg.dtypes[ROLES.index(role)]),
            None,
            swizzled_scales(cfg, role, data.shape),
            fake_dtype=fake_dtype,
        )
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage.nvfp4_tensor_storage import (
        NVFP4TensorStorage,
    )

    data, scale_inv, amax = parts
    return NVFP4TensorStorage(
        None,
        None,
        data,
        scale_inv,
        None,
        amax,
        tex.DType.kFloat4E2M1,
        None,
        swizzled_scales(cfg, role, _nvfp4_logical_shape(data)),
        fake_dtype=fake_dtype,
    )


def nvfp4_columnwise_specs(shape) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of NVFP4's column-wise data, scales and amax for a `shape` operand, as
    TE's C++ allocates them (quantizer.cpp:2045-2056): the data is laid out over the 2-D
    flattening [M, K]. (TE's Python `inner_tensor_specs` keeps the leading dims, [K, *lead]
    with the last halved, which differs for 3-D operands; the C++ is what runs.)"""
    from transformer_engine.pytorch.constants import NVFP4_BLOCK_SCALING_SIZE
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
    from transformer_engine.pytorch.utils import round_up_to_nearest_multiple as round_up

    rows, cols = _rows_cols(shape)
    data = NVFP4Quantizer.convert_shape_for_fp4(NVFP4Quantizer.get_columnwise_shape((rows, cols)))
    blocks = -(-rows // NVFP4_BLOCK_SCALING_SIZE)  # ceil, in integers (symbolic sizes too)
    scale = (round_up(cols, 128), round_up(blocks, 4))
    return [(tuple(data), torch.uint8), (scale, torch.uint8), ((1,), torch.float32)]


def mx_columnwise_specs(shape, cfg: QuantConfig, role: str) -> list:
    """(shape, dtype) of every column-wise part, without touching a device."""
    if cfg.kind == "nvfp4":
        return nvfp4_columnwise_specs(shape)
    # MXFP8Quantizer's constructor and pure-Python specs touch no device.
    q = make_mx_quantizer(cfg, role, rowwise=False, columnwise=True)
    specs = q.inner_tensor_specs(tuple(shape))
    return [specs["_columnwise_data"], specs["_columnwise_scale_inv"]]
