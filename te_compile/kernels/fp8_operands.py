"""FP8 GEMM operands as plain tensors: TE quantizers rebuilt from a `QuantConfig`, and a
quantized operand's column-wise half (what backward GEMMs read) taken apart and put back
together across op boundaries.

Column-wise parts, per config kind:
- "current" and "delayed" (per-tensor): [data, scale_inv]. `data` is TE's separate transpose
  (uint8 [last, *leading]) when `cfg.fp8_transpose`, else the row-major data itself (GPUs
  with non-TN FP8 GEMMs read it directly). scale_inv is float32 [1].
- "block": [columnwise_data, columnwise_scale_inv]: uint8 [last, *leading] and float32 of
  the shape TE's `Float8BlockQuantizer.get_scale_shape(shape, columnwise=True)` gives.
- "mxfp8" and "nvfp4": see operands_mx.py.

The `fake_*` helpers compute the same shapes without touching a device.
"""

from __future__ import annotations

import functools

import torch

from ..recipes import ROLES, QuantConfig
from .operands_mx import (
    MX_KINDS,
    check_swizzled,
    make_mx_quantizer,
    mx_columnwise_count,
    mx_columnwise_parts,
    mx_columnwise_specs,
    mx_columnwise_storage,
)
from .te_dtypes import te_fp8_dtype

# DelayedScaling slots in TE's fp8_meta: forward [input, weight, output], backward
# [grad_output, grad_input] (csrc/common.h); the role picks its slot in its direction's state.
DELAYED_SLOT = {"input": 0, "weight": 1, "grad": 0}
# Slots per GEMM: 3 forward (input, weight, output), 2 backward (grad_output, grad_input); GEMM
# `g` of a module (LayerNormMLP's FC2: 1) uses slots offset by g times that.
_SLOTS_PER_GEMM = {"input": 3, "weight": 3, "grad": 2}


def delayed_slot(role: str, gemm: int = 0) -> int:
    """The slot of `role` of a module's GEMM `gemm` in its direction's DelayedScaling state."""
    return DELAYED_SLOT[role] + _SLOTS_PER_GEMM[role] * gemm


@functools.lru_cache(maxsize=4096)
def quantizer(
    cfg: QuantConfig,
    role: str,
    *,
    rowwise: bool,
    columnwise: bool,
    weight_shape: tuple[int, ...] | None = None,
):
    """The quantizer te.Linear uses for `role`, configured as eager TE configures it; built
    once per (config, role, usages, weight shape): quantizers depend only on the recipe config,
    so ops must not rebuild them every step. Callers must not change the returned object except
    through `extension.with_state`.

    DelayedScaling quantizers are built without state: `extension.with_state` points them at a
    module's scale and amax before each use (the kernel reads the scale and max-accumulates
    the amax in place). The weight role needs the weight's shape (TE decides scale swizzling
    from it)."""
    i = ROLES.index(role)
    if cfg.kind == "delayed":
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

        q = Float8Quantizer(
            None,  # scale and amax: per module, set by extension.with_state
            None,
            te_fp8_dtype(cfg.dtypes[i]),
            rowwise=rowwise,
            columnwise=columnwise,
        )
    elif cfg.kind == "current":
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

        q = Float8CurrentScalingQuantizer(
            te_fp8_dtype(cfg.dtypes[i]),
            None,  # the device argument is ignored by TE 2.20
            rowwise=rowwise,
            columnwise=columnwise,
            force_pow_2_scales=cfg.pow2[i],
            amax_epsilon=cfg.amax_eps[i],
        )
    elif cfg.kind == "block":
        # a fresh object: the flags set below must not leak into the cached storage quantizers
        q = _block_quantizer.__wrapped__(cfg, i, rowwise=rowwise, columnwise=columnwise)
    elif cfg.kind in MX_KINDS:
        q = make_mx_quantizer(cfg, role, rowwise=rowwise, columnwise=columnwise)
    else:
        raise ValueError(f"no quantizer for QuantConfig kind {cfg.kind!r}")
    # Linear marks all its quantizers internal (bare storages, no autograd) and asks input and
    # grad-output quantization for GEMM-ready (swizzled) scales (linear.py:2590-2600); the
    # weight's flag is TE's `_enable_weight_preswizzle` (linear.py:2430).
    q.internal = True
    q.optimize_for_gemm = _weight_preswizzle(q, weight_shape) if role == "weight" else True
    return q


class _HighPrecisionWeights:
    """The one module attribute `_enable_weight_preswizzle` reads. The compiled path never
    quantizes an FP8 primary weight (modules/fp8_params.py reads its parts) and refuses
    primary_weights_in_fp8 with the MXFP8/NVFP4 recipes, whose weight quantizers read it."""

    primary_weights_in_fp8 = False


def _weight_preswizzle(q, weight_shape: tuple[int, ...] | None) -> bool:
    if weight_shape is None:
        raise ValueError("the weight quantizer needs the weight's shape (scale swizzling)")
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    # TE reads only the weight's shape; False for per-tensor and Float8 block quantizers.
    weight = torch.empty(weight_shape, device="meta")
    return TransformerEngineBaseModule._enable_weight_preswizzle(_HighPrecisionWeights, q, weight)


@functools.lru_cache(maxsize=1024)
def _block_quantizer(cfg: QuantConfig, i: int, *, rowwise: bool, columnwise: bool):
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    return Float8BlockQuantizer(
        te_fp8_dtype(cfg.dtypes[i]),
        rowwise=rowwise,
        columnwise=columnwise,
        amax_epsilon=cfg.amax_eps[i],
        force_pow_2_scales=cfg.pow2[i],
        block_scaling_dim=cfg.block_dims[i],
    )


def columnwise_parts(storage, cfg: QuantConfig) -> list[torch.Tensor]:
    """The column-wise data and scales of a quantized operand, as plain tensors."""
    if cfg.per_tensor:
        data = storage._transpose if cfg.fp8_transpose else storage._data
        if data is None:
            raise RuntimeError(
                "te_compile: the FP8 operand has no column-wise data in the layout the trace "
                f"assumed (fp8_transpose={cfg.fp8_transpose}); was the program traced for "
                "another GPU generation?"
            )
        return [data, storage._scale_inv]
    if cfg.kind == "block":
        return [storage._columnwise_data, storage._columnwise_scale_inv]
    if cfg.kind in MX_KINDS:
        return mx_columnwise_parts(storage, cfg)
    raise ValueError(f"no FP8 operand for QuantConfig kind {cfg.kind!r}")


def columnwise_storage(parts: list[torch.Tensor], cfg: QuantConfig, role: str, fake_dtype):
    """A TE storage holding only the column-wise half, ready for `general_gemm`."""
    if cfg.kind in MX_KINDS:
        return mx_columnwise_storage(parts, cfg, role, fake_dtype)
    data, scale_inv = parts
    if cfg.per_tensor:
        if cfg.fp8_transpose:
            return _per_tensor_storage(cfg, role, None, data, scale_inv, fake_dtype)
        return _per_tensor_storage(cfg, role, data, None, scale_inv, fake_dtype)
    return _block_storage(cfg, role, None, None, data, scale_inv, fake_dtype)


def rowwise_storage(parts: list[torch.Tensor], cfg: QuantConfig, role: str, fake_dtype):
    """A per-tensor TE storage holding only the row-wise half [data, scale_inv]."""
    data, scale_inv = parts
    return _per_tensor_storage(cfg, role, data, None, scale_inv, fake_dtype)


def _per_tensor_storage(cfg, role, data, transpose, scale_inv, fake_dtype):
    # GEMMs read only data, transpose, scale_inv and dtype: no quantizer needed.
    return _storage_classes()[0](
        data=data,
        data_transpose=transpose,
        fp8_scale_inv=scale_inv,
        fp8_dtype=te_fp8_dtype(cfg.dtypes[ROLES.index(role)]),
        fake_dtype=fake_dtype,
    )


def _block_storage(cfg, role, data, scale_inv, col_data, col_scale_inv, fake_dtype):
    i = ROLES.index(role)
    return _storage_classes()[1](
        data,
        scale_inv,
        col_data,
        col_scale_inv,
        te_fp8_dtype(cfg.dtypes[i]),
        _block_quantizer(cfg, i, rowwise=data is not None, columnwise=col_data is not None),
        cfg.block_dims[i] == 2,
        fake_dtype=fake_dtype,
    )


@functools.cache
def _storage_classes():
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
        Float8TensorStorage,
    )

    return Float8TensorStorage, Float8BlockwiseQTensorStorage


def columnwise_count(cfg: QuantConfig) -> int:
    if cfg.kind in MX_KINDS:
        return mx_columnwise_count(cfg)
    return 2 if cfg.fp8 else 0


def check_scale_layout(storage, cfg: QuantConfig, role: str, shape) -> None:
    """MXFP8/NVFP4: the scale layout backward will assume is the one TE produced."""
    if cfg.kind in MX_KINDS:
        check_swizzled(storage, cfg, role, shape)


def _transposed(shape) -> list:
    return [shape[-1], *shape[:-1]]


def fake_columnwise_parts(shape, cfg: QuantConfig, role: str, like: torch.Tensor) -> list:
    """Empty tensors shaped like `columnwise_parts` of a `shape` operand (fake kernels)."""
    shape = list(shape)
    if cfg.per_tensor:
        data_shape = _transposed(shape) if cfg.fp8_transpose else shape
        return [
            like.new_empty(data_shape, dtype=torch.uint8),
            like.new_empty([1], dtype=torch.float32),
        ]
    if cfg.kind in MX_KINDS:
        return [
            like.new_empty(list(part_shape), dtype=dtype)
            for part_shape, dtype in mx_columnwise_specs(shape, cfg, role)
        ]
    i = ROLES.index(role)
    q = _block_quantizer(cfg, i, rowwise=False, columnwise=True)
    return [
        like.new_empty(_transposed(shape), dtype=torch.uint8),
        like.new_empty(list(q.get_scale_shape(shape, columnwise=True)), dtype=torch.float32),
    ]


# ---- FP8 weight caches (is_first_microbatch) ----------------------------------------------------
#
# A cached quantized weight is a list of plain tensors a module keeps across steps:
# - "current"/"delayed": [data, transpose, scale_inv] ([data, scale_inv] without a separate
#   transpose): row-wise data uint8 [out, in], its transpose uint8 [in, out], float32 [1].
# - "block": [data, scale_inv, columnwise_data, columnwise_scale_inv].
# Both halves are always kept: forward reads the row-wise half, backward the column-wise one.

CACHEABLE_KINDS = ("current", "delayed", "block")


def weight_cache_specs(cfg: QuantConfig, shape) -> list[tuple[list[int], torch.dtype]]:
    """(shape, dtype) of each tensor of a cached `shape` weight."""
    shape = list(shape)
    if cfg.per_tensor:
        specs = [(shape, torch.uint8)]
        if cfg.fp8_transpose:
            specs.append((_transposed(shape), torch.uint8))
        return [*specs, ([1], torch.float32)]
    if cfg.kind == "block":
        q = _block_quantizer(cfg, ROLES.index("weight"), rowwise=True, columnwise=True)
        return [
            (shape, torch.uint8),
            (list(q.get_scale_shape(shape, columnwise=False)), torch.float32),
            (_transposed(shape), torch.uint8),
            (list(q.get_scale_shape(shape, columnwise=True)), torch.float32),
        ]
    raise ValueError(f"no FP8 weight cache for QuantConfig kind {cfg.kind!r}")


def weight_cache_storage(parts: list[torch.Tensor], cfg: QuantConfig, fake_dtype):
    """The TE storage (both halves) over a weight cache's tensors, for GEMMs and for
    quantizing into it."""
    if cfg.per_tensor:
        data, *transpose, scale_inv = parts
        return _per_tensor_storage(
            cfg, "weight", data, transpose[0] if transpose else None, scale_inv, fake_dtype
        )
    return _block_storage(cfg, "weight", *parts, fake_dtype)


def weight_cache_columnwise(parts: list[torch.Tensor], cfg: QuantConfig) -> list[torch.Tensor]:
    """The cache's column-wise parts, in the layout of `columnwise_parts`."""
    if cfg.per_tensor:
        return [parts[1] if cfg.fp8_transpose else parts[0], parts[-1]]
    return parts[2:]
