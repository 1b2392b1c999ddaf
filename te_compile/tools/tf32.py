"""`te_compile.configure_tf32`: TF32 for FP32 matmuls and cuDNN, set through exactly one torch API.

torch has two APIs for TF32: the legacy flags (`torch.backends.cuda.matmul.allow_tf32`,
`torch.backends.cudnn.allow_tf32`, `torch.set_float32_matmul_precision`) and, since torch 2.9,
the `fp32_precision` properties (`torch.backends.cuda.matmul.fp32_precision`,
`torch.backends.cudnn.conv/rnn.fp32_precision`). Setting TF32 through both leaves torch in a
state it reports as "you have used mix of the legacy and new APIs to set the TF32 status", and
it raises that error wherever the legacy flags are read, inductor included.

`configure_tf32` uses the `fp32_precision` properties (every supported torch has them) unless
asked for the legacy flags, never both, and returns which. Read the state back through the same
API (`tf32_enabled()` does): with the new API set to "tf32", torch (2.14 seen) raises on a read
of the legacy matmul flag, by design.

TF32 does not change FP8 GEMMs (TE's cuBLASLt FP8 GEMMs accumulate in FP32 regardless); it
changes FP32 matmuls and convolutions around them.
"""

from __future__ import annotations

import torch

NEW_API = "fp32_precision"
LEGACY_API = "allow_tf32"


def configure_tf32(enabled: bool = True, *, api: str = NEW_API) -> str:
    """Allow (or forbid) TF32 for FP32 matmuls (cuBLAS) and cuDNN convolutions and RNNs, through
    one API (`api`). Returns the API used. Works without a GPU (it sets flags; nothing runs)."""
    backends = torch.backends
    if api == NEW_API:
        value = "tf32" if enabled else "ieee"
        backends.cuda.matmul.fp32_precision = value
        backends.cudnn.conv.fp32_precision = value
        backends.cudnn.rnn.fp32_precision = value
    elif api == LEGACY_API:
        backends.cuda.matmul.allow_tf32 = enabled
        backends.cudnn.allow_tf32 = enabled
    else:
        raise ValueError(f"api must be {NEW_API!r} or {LEGACY_API!r}, got {api!r}")
    return api


def tf32_enabled(api: str = NEW_API) -> dict[str, bool]:
    """{"matmul": ..., "cudnn": ...}: whether TF32 is allowed, read through `api` (the one
    configure_tf32 returned)."""
    backends = torch.backends
    if api == NEW_API:
        return {
            "matmul": backends.cuda.matmul.fp32_precision == "tf32",
            "cudnn": backends.cudnn.conv.fp32_precision == "tf32",
        }
    return {"matmul": backends.cuda.matmul.allow_tf32, "cudnn": backends.cudnn.allow_tf32}
