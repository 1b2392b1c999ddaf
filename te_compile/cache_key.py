"""te_compile's code in torch.compile's cache keys.

Inductor's FX-graph cache and AOTAutograd's cache key a compiled graph on the graph dynamo
captured, which holds our forward ops by name only: the backward graph, which our ops' autograd
formulas build, and the ops' schemas are not in it. A cache filled by another te_compile (or TE)
would then hand back compiled code calling ops with arguments they no longer take, or a
backward built by an older formula. `torch.compiler.config.cache_key_tag` (public, read into
both keys) carries a digest of te_compile's sources and TE's version while patched.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import pathlib

import torch

_SAVED: list = []  # the tag before patch()


@functools.cache
def digest() -> str:
    """sha256 of te_compile's Python sources and TE's version, 16 hex digits."""
    h = hashlib.sha256()
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    try:
        h.update(importlib.metadata.version("transformer_engine").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:16]


def add() -> None:
    """Append te_compile's digest to the cache key tag (kept: what the user set)."""
    tag = torch.compiler.config.cache_key_tag
    _SAVED.append(tag)
    ours = f"te_compile-{digest()}"
    torch.compiler.config.cache_key_tag = f"{tag}+{ours}" if tag else ours


def remove() -> None:
    """Put back the tag add() found."""
    if _SAVED:
        torch.compiler.config.cache_key_tag = _SAVED.pop()
