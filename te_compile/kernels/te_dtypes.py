"""FP8 dtype names, as ops carry them, to TE's `DType` enum and torch's dtypes."""

from __future__ import annotations

import functools

import torch

FP8_DTYPES = ("e4m3", "e5m2")
# torch's dtypes of the same formats (how FP8 data crosses op boundaries)
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@functools.cache  # called per op call (storages rebuilt from saved parts): no import, no dict
def te_fp8_dtype(name: str):
    """ "e4m3" / "e5m2" -> transformer_engine_torch.DType."""
    import transformer_engine_torch as tex

    if name not in FP8_DTYPES:
        raise ValueError(f"FP8 dtype must be one of {FP8_DTYPES}, got {name!r}")
    return {"e4m3": tex.DType.kFloat8E4M3, "e5m2": tex.DType.kFloat8E5M2}[name]
