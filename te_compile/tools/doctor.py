"""`te_compile.doctor()`: what te-compile sees in this environment. Run `python -m te_compile`."""

from __future__ import annotations

import importlib


def _line(name: str, value: object) -> str:
    return f"  {name:<28} {value}"


def report() -> str:
    import torch

    import te_compile

    from ..versions import supported_range, te_version

    lines = ["te-compile doctor"]
    lines.append(_line("te-compile", te_compile.__version__))
    lines.append(_line("torch", torch.__version__))
    lines.append(_line("transformer-engine", te_version()))
    lines.append(_line("supported", supported_range()))
    cuda = torch.cuda.is_available()
    lines.append(_line("GPU", torch.cuda.get_device_name() if cuda else "none (CPU trace only)"))
    try:
        te_compile.check_versions()
        lines.append(_line("versions", "ok"))
    except te_compile.UnsupportedVersionError as e:
        lines.append(_line("versions", f"NOT SUPPORTED: {e}"))
        return "\n".join(lines)
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # noqa: BLE001  (report any import failure)
        lines.append(_line("import TE", f"FAILED: {type(e).__name__}: {e}{_import_hint(e)}"))
        return "\n".join(lines)
    utils = importlib.import_module("transformer_engine.pytorch.utils")
    reason = getattr(utils, "_compile_disabled_reason", None)
    lines.append(_line("TE's own compile path", f"off ({reason})" if reason else "on"))
    if cuda:
        q = importlib.import_module("transformer_engine.pytorch.quantization")
        for name, check in [
            ("FP8 (delayed/current)", q.check_fp8_support),
            ("FP8 block scaling", q.check_fp8_block_scaling_support),
            ("MXFP8", q.check_mxfp8_support),
            ("NVFP4", q.check_nvfp4_support),
        ]:
            ok, why = check()
            lines.append(_line(name, "yes" if ok else f"no ({why})"))
        te = importlib.import_module("transformer_engine.pytorch")
        try:
            cudnn = _cudnn_graph_note(te.get_cudnn_version())
        except Exception as e:  # noqa: BLE001  (a report, not a check)
            cudnn = f"unknown ({type(e).__name__}: {e})"
        lines.append(_line("cuDNN (TE's)", cudnn))
        lines.append(_line("cuDNN (torch's)", _torch_cudnn()))
    lines.append(_line("patched", te_compile.is_patched()))
    return "\n".join(lines)


def _import_hint(error: Exception) -> str:
    """The way out of an import failure seen before: torch 2.15 stopped installing cuRAND, which
    TE 2.20 loads at import (docs/install.md)."""
    if "curand shared object not found" in str(error):
        return " (torch 2.15 does not install cuRAND: pip install nvidia-curand)"
    return ""


def _torch_cudnn() -> str:
    """torch's view of the cuDNN loaded in this process. TE's import loads a cuDNN, a system one
    before the pip package's; on a lent H200 (session 38) that was 9.14 and torch, built against
    9.19, then refused it in `torch.backends.cudnn.version()`: say so here rather than at a
    user's first torch cuDNN call."""
    import torch

    try:
        version = torch.backends.cudnn.version()
    except RuntimeError as e:
        return f"UNUSABLE by torch: {str(e).splitlines()[0]}"
    return "none" if version is None else str(version)


def _cudnn_graph_note(version: tuple) -> str:
    """TE's cuDNN version, with the CUDA-graph limit of cuDNN <= 9.15 that TE enforces: training
    attention (sbhd/bshd, no padding mask) inside a CUDA graph needs max_seqlen_kv % 128 == 0."""
    text = ".".join(str(v) for v in version)
    if tuple(version) <= (9, 15, 0):
        text += (
            " (<= 9.15: under mode='reduce-overhead', attention needs sequence lengths that are "
            "multiples of 128, or a padding mask; TE refuses the rest inside CUDA graphs)"
        )
    return text
