"""Which torch and Transformer Engine releases te-compile supports, and the check patch() runs."""

from __future__ import annotations

import re
from importlib import metadata

from .errors import UnsupportedVersionError

MIN_TORCH = (2, 11)  # 2.9 aborts tracing fake CUDA autograd; docs/install.md (floor)
SUPPORTED_TE = ((2, 20),)  # (major, minor) series whose internals we have mapped


def _release(version: str) -> tuple[int, ...]:
    """'2.14.1+cu130' -> (2, 14, 1); pre/dev suffixes are ignored."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def torch_version() -> str:
    import torch

    return torch.__version__


def te_version() -> str | None:
    """Version of the installed Transformer Engine Python package, or None if absent."""
    for dist in ("transformer_engine", "transformer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def supported_range() -> str:
    te = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_TE)
    return f"torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, transformer-engine {te}"


def check_versions(torch_ver: str | None = None, te_ver: str | None = None) -> None:
    """Raise UnsupportedVersionError naming both versions and the supported range."""
    torch_ver = torch_ver or torch_version()
    te_ver = te_ver if te_ver is not None else te_version()
    problems = []
    if _release(torch_ver)[:2] < MIN_TORCH:
        problems.append(f"torch {torch_ver} is too old")
    if te_ver is None:
        problems.append("Transformer Engine is not installed (pip install 'te-compile[te]')")
    elif _release(te_ver)[:2] not in SUPPORTED_TE:
        problems.append(f"transformer-engine {te_ver} is not a supported series")
    if problems:
        raise UnsupportedVersionError(
            f"te-compile cannot patch this environment: {'; '.join(problems)}. "
            f"Installed: torch {torch_ver}, transformer-engine {te_ver}. "
            f"Supported: {supported_range()}."
        )
