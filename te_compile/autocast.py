"""Compile-aware `te.autocast`: four TE functions, each replaced by a version that runs TE's own
code when not compiling and a traceable twin while dynamo traces.

What TE 2.20 does under `torch.compile`, and what the twins do instead:

- `check_recipe_support` raises for DelayedScaling while compiling. Twin: the hardware checks
  only (TE's cached answers, read through `assume_constant_result`); DelayedScaling is accepted.
- `get_default_fp8_recipe` asserts while compiling. Twin: the same choice (MXFP8 if supported,
  Float8CurrentScaling on cc >= 12.0, else DelayedScaling), decided at trace time without
  tracing any hardware query, returning one shared recipe object per choice.
- `FP8GlobalStateManager.autocast_enter` checks support with `assert`. Twin: explicit raises.
  It also does not write `autocast_arguments`: that dict is read only by the DelayedScaling
  update, and whoever registers DelayedScaling tensors records their recipe there. Not
  touching it keeps compiled code free of guards on it, so `FP8GlobalStateManager.reset()`
  causes no recompile.
- `FP8GlobalStateManager.reduce_and_update_fp8_tensors` calls pybind kernels. Twin: the same
  update as one custom op (`te_compile::amax_and_scale_update`) per buffer key, over the TE
  GEMM modules' state in it (persistent_state.compiled_buffer_positions). Eagerly, at the
  outermost exit, it also runs the backward updates that compiled modules defer to an eager
  autocast (delayed_updates.py); `autocast_enter`/`autocast_exit` record whether one is open.

`autocast.__enter__/__exit__` themselves are TE's, unchanged: dynamo traces them into the twins.
"""

from __future__ import annotations

import torch

from . import delayed_updates, ops
from .aliases import swaps as alias_swaps
from .errors import RecipeNotSupportedError, UnsupportedUnderCompileError
from .modules import persistent_state
from .patching import Swap

# One recipe object per default choice, built on first use outside compiled code (recipe
# construction reads environment defaults and is not something to trace).
_DEFAULT_RECIPES: dict = {}


def _q():
    from transformer_engine.pytorch import quantization

    return quantization


def _build_default_recipes() -> None:
    from transformer_engine.common import recipe as R

    if not _DEFAULT_RECIPES:
        _DEFAULT_RECIPES.update(
            mxfp8=R.MXFP8BlockScaling(),
            current=R.Float8CurrentScaling(),
            delayed=R.DelayedScaling(),
        )


@torch.compiler.assume_constant_result
def _default_recipe_kind() -> str:
    """TE's default-recipe rule, evaluated once at trace time (no hardware query is traced)."""
    q = _q()
    if q.check_mxfp8_support()[0]:
        return "mxfp8"
    if q.get_device_compute_capability() >= (12, 0):
        return "current"
    return "delayed"


@torch.compiler.assume_constant_result
def _support(kind: str) -> tuple[bool, str]:
    q = _q()
    check = {
        "fp8": q.check_fp8_support,
        "fp8_block": q.check_fp8_block_scaling_support,
        "mxfp8": q.check_mxfp8_support,
        "nvfp4": q.check_nvfp4_support,
    }[kind]
    return check()


def _required_support(recipe) -> list[str]:
    """The hardware features a recipe needs, in the order TE checks them."""
    from transformer_engine.common import recipe as R

    needs = ["fp8"]  # TE's autocast_enter requires basic FP8 for every enabled recipe
    if isinstance(recipe, R.Float8BlockScaling):
        needs.append("fp8_block")
    elif isinstance(recipe, R.MXFP8BlockScaling):
        needs.append("mxfp8")
    elif isinstance(recipe, R.NVFP4BlockScaling):
        needs.append("nvfp4")
    return needs


def _raise_if_unsupported(recipe) -> None:
    for kind in _required_support(recipe):
        ok, reason = _support(kind)
        if not ok:
            raise RecipeNotSupportedError(
                f"{type(recipe).__name__} cannot run on this GPU: {reason}"
            )


# ---- the twins ---------------------------------------------------------------------------------


def make_check_recipe_support(original):
    def check_recipe_support(recipe) -> None:
        if not torch.compiler.is_compiling():
            return original(recipe)
        if recipe is not None:
            _raise_if_unsupported(recipe)

    return check_recipe_support


def make_get_default_fp8_recipe(original):
    def get_default_fp8_recipe():
        if not torch.compiler.is_compiling():
            return original()
        return _DEFAULT_RECIPES[_default_recipe_kind()]

    return get_default_fp8_recipe


def make_autocast_enter(original):
    original_fn = original.__func__

    def autocast_enter(
        cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False
    ) -> None:
        if not torch.compiler.is_compiling():
            original_fn(cls, enabled, calibrating, fp8_recipe, fp8_group, _graph)
            if cls.quantization_state.autocast_depth == 1:  # the outermost: its exit updates
                persistent_state.AUTOCAST_EAGER[0] = enabled
            return
        if _graph:
            raise UnsupportedUnderCompileError(
                "te.autocast(_graph=True) is TE's make_graphed_callables mode and is not "
                "supported inside torch.compile; use torch.compile(mode='reduce-overhead') "
                "for CUDA graphs instead."
            )
        recipe = _q().get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        if enabled:
            _raise_if_unsupported(recipe)
        state = cls.quantization_state
        state.fp8_enabled = enabled
        state.fp8_calibration = calibrating
        state.fp8_recipe = recipe
        state.fp8_distributed_group = fp8_group
        state.fp8_graph_capturing = False
        if state.autocast_depth == 0:
            state.is_first_fp8_module = True
        state.autocast_depth += 1

    return classmethod(autocast_enter)


def make_autocast_exit(original):
    original_fn = original.__func__

    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        try:
            original_fn(cls, enabled, _graph)  # traced as it is while compiling
        finally:  # cleared even if the update raised: a stale flag would defer with no exit
            if not torch.compiler.is_compiling() and cls.quantization_state.autocast_depth == 0:
                persistent_state.AUTOCAST_EAGER[0] = False

    return classmethod(autocast_exit)


def make_reduce_and_update_fp8_tensors(original):
    original_fn = original.__func__

    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        if not torch.compiler.is_compiling():
            original_fn(cls, forward)
            # an eager outermost exit also runs the backward updates that modules compiled
            # inside it left pending (delayed_updates.py)
            if forward and delayed_updates.backward_pending():
                delayed_updates.update_states(cls, forward=False, skip_unsupported=True)
            return
        delayed_updates.update_states(cls, forward)

    return classmethod(reduce_and_update_fp8_tensors)


def swaps() -> list[Swap]:
    """The attribute swaps that make te.autocast compile-aware."""
    q = _q()
    _build_default_recipes()
    manager = q.FP8GlobalStateManager
    return [
        Swap(q, "check_recipe_support", make_check_recipe_support(q.check_recipe_support)),
        Swap(q, "get_default_fp8_recipe", make_get_default_fp8_recipe(q.get_default_fp8_recipe)),
        Swap(manager, "autocast_enter", make_autocast_enter(vars(manager)["autocast_enter"])),
        Swap(manager, "autocast_exit", make_autocast_exit(vars(manager)["autocast_exit"])),
        Swap(
            manager,
            "reduce_and_update_fp8_tensors",
            make_reduce_and_update_fp8_tensors(vars(manager)["reduce_and_update_fp8_tensors"]),
        ),
        *alias_swaps(),  # te.fp8_autocast, te.fp8_model_init: te_compile/aliases.py
        *delayed_updates.swaps(),  # state_dict flushes a module's pending backward update
    ]


__all__ = ["swaps", "ops"]
