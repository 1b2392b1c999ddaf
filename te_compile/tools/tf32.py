"""`te_compile.configure_tf32`: TF32 for FP32 matmuls and cuDNN, set through exactly one torch API.

torch has two APIs for TF32: the legacy flags (`torch.backends.cuda.matmul.allow_tf32`,
`torch.backends.cudnn.allow_tf32`, `torch.set_float32_matmul_precision`) and, since torch 2.9,
the `fp32_precision` properties (`torch.backends.cuda.matmul.fp32_precision`,
`torch.backends.cudnn.conv/rnn.fp32_precision`). Setting TF32 through both leaves torch in a
state it reports as "you have used mix of the legacy and new APIs to set the TF32 status", and
it raises that error wherever the legacy flags are read, inductor included.

`configure_tf32` uses the `fp32_precision` properties where the installed torch has them and the
legacy flags otherwise, never both, and returns which ("fp32_precision" or "allow_tf32"). Read
the state back through the same API (`tf32_enabled()` does). Note: with the new API set to
"tf32", torch (2.14 seen) raises on a read of the legacy matmul flag, by design: code that still
reads `torch.backends.cuda.matmul.allow_tf32` must move to `fp32_precision`.

TF32 does not change FP8 GEMMs (TE's cuBLASLt FP8 GEMMs accumulate in FP32 regardless); it
changes FP32 matmuls and convolutions around them.
"""

from __future__ import annotations

import torch

NEW_API = "fp32_precision"
LEGACY_API = "allow_tf32"


def tf32_api() -> str:
    """The TF32 API this torch has: "fp32_precision" (torch >= 2.9) or "allow_tf32"."""
    matmul = torch.backends.cuda.matmul
    has_new = hasattr(torch.backends.cudnn, "conv") and hasattr(torch.backends.cudnn, "rnn")
    try:
        has_new = has_new and isinstance(matmul.fp32_precision, str)
    except AttributeError:
        has_new = False
    return NEW_API if has_new else LEGACY_API


def configure_tf32(enabled: bool = True, *, api: str | None = None) -> str:
    """Allow (or forbid) TF32 for FP32 matmuls (cuBLAS) and cuDNN convolutions and RNNs, through
    one API: `api` if given, else `tf32_api()`. Returns the API used. Works without a GPU (it
    sets flags; nothing runs)."""
    api = api or tf32_api()
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


def tf32_enabled(api: str | None = None) -> dict[str, bool]:
    """{"matmul": ..., "cudnn": ...}: whether TF32 is allowed, read through `api` (the one
    configure_tf32 returned; default `tf32_api()`)."""
    api = api or tf32_api()
    backends = torch.backends
    if api == NEW_API:
        return {
            "matmul": backends.cuda.matmul.fp32_precision == "tf32",
            "cudnn": backends.cudnn.conv.fp32_precision == "tf32",
        }
    return {"matmul": backends.cuda.matmul.allow_tf32, "cudnn": backends.cudnn.allow_tf32}
