"""te-compile: Transformer Engine modules with FP8 inside ``torch.compile(fullgraph=True)``.

    import te_compile
    te_compile.patch()      # idempotent; te_compile.unpatch() restores TE exactly

When not compiling, TE runs its own unchanged code. While dynamo traces, the patched pieces
route through te-compile's traceable twins and custom ops (see docs/architecture.md).
"""

from __future__ import annotations

from .errors import (
    RecipeNotSupportedError,
    TECompileError,
    UnsupportedUnderCompileError,
    UnsupportedVersionError,
)
from .modules.checkpointing import checkpoint, checkpoint_policy, gemm_forward_ops
from .options import configure
from .patching import Patcher
from .prepare import prepare
from .tools.check import check  # noqa: F401  (also binds te_compile.check to the function)
from .tools.graph_capture import capture
from .tools.simulate import simulate_gpu
from .tools.tf32 import configure_tf32
from .versions import check_versions, supported_range

__version__ = "0.1.0"

_PATCHER = Patcher()


def patch() -> None:
    """Make TE compile-aware. Checks versions first; calling it twice is a no-op."""
    if _PATCHER.active:
        return
    check_versions()
    from . import autocast, cache_key, inline_recipes, modules

    _PATCHER.apply(autocast.swaps() + inline_recipes.swaps() + modules.swaps())
    cache_key.add()  # compiled code cached by another te_compile is not reused


def unpatch() -> None:
    """Restore every TE attribute that patch() replaced. A no-op when not patched."""
    from . import cache_key

    if _PATCHER.active:
        cache_key.remove()
    _PATCHER.revert()


def is_patched() -> bool:
    return _PATCHER.active


def flush_delayed_updates() -> None:
    """Apply the DelayedScaling backward amax/scale updates that compiled modules leave to the
    next autocast exit, so that `fp8_meta` holds what eager TE would hold after a backward.
    Only code that reads the state directly between steps needs it (state_dict flushes each
    module); with reduce_amax over several ranks, call it on every rank."""
    from .delayed_updates import flush

    flush()


def doctor() -> str:
    """A short report of the environment: versions, GPU, recipe support, patch state."""
    from .tools.doctor import report

    return report()


__all__ = [
    "patch",
    "unpatch",
    "is_patched",
    "doctor",
    "flush_delayed_updates",
    "prepare",
    "simulate_gpu",
    "check",
    "configure",
    "configure_tf32",
    "capture",
    "checkpoint",
    "checkpoint_policy",
    "gemm_forward_ops",
    "check_versions",
    "supported_range",
    "TECompileError",
    "UnsupportedVersionError",
    "UnsupportedUnderCompileError",
    "RecipeNotSupportedError",
]
