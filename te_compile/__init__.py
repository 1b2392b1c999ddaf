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
from .patching import Patcher
from .versions import check_versions, supported_range

__version__ = "0.1.0"

_PATCHER = Patcher()


def patch() -> None:
    """Make TE compile-aware. Checks versions first; calling it twice is a no-op."""
    if _PATCHER.active:
        return
    check_versions()
    from . import autocast, inline_recipes, modules

    _PATCHER.apply(autocast.swaps() + inline_recipes.swaps() + modules.swaps())


def unpatch() -> None:
    """Restore every TE attribute that patch() replaced. A no-op when not patched."""
    _PATCHER.revert()


def is_patched() -> bool:
    return _PATCHER.active


def simulate_gpu(arch: str = "hopper"):
    """Context manager: run TE model code as if on one GPU of `arch` ("hopper"/"sm90",
    "blackwell"/"sm100") on any machine; "cuda" tensors land on the meta device, so
    torch.compile traces forward and backward without a driver (te_compile/simulate.py)."""
    from .simulate import simulate_gpu as simulate

    return simulate(arch)


def check(model_or_fn, *example_inputs, arch: str = "hopper", recipes=None, per_module=True):
    """Trace a model forward + backward with fullgraph per recipe under simulate_gpu(arch) and
    return a CheckReport (print it for the table; `.ok` gates CI). See te_compile/check.py."""
    from .check import check as run_check

    return run_check(
        model_or_fn, *example_inputs, arch=arch, recipes=recipes, per_module=per_module
    )


def doctor() -> str:
    """A short report of the environment: versions, GPU, recipe support, patch state."""
    from .doctor import report

    return report()


__all__ = [
    "patch",
    "unpatch",
    "is_patched",
    "doctor",
    "simulate_gpu",
    "check",
    "check_versions",
    "supported_range",
    "TECompileError",
    "UnsupportedVersionError",
    "UnsupportedUnderCompileError",
    "RecipeNotSupportedError",
]
