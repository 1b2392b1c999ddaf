"""DelayedScaling's amax/scale updates of the compiled TE GEMM modules' state, batched as eager
TE batches them: one update per direction per step.

Eager TE updates every registered forward state at the outermost autocast exit and every
backward state at the end of the first FP8 module's backward. Compiled modules do the forward
half the same way (the autocast twin calls `update_states` while tracing the exit). For the
backward half there is no traceable "first module" (claiming TE's flag is a Python write, which
dynamo refuses inside torch.utils.checkpoint). Under an autocast entered outside compiled code
(regional compilation, a compiled model called inside `te.autocast`), each backward op only
max-merges its grad_output amaxes into history row 0, as TE's casts do, and the next outermost
autocast exit, eager code, updates the backward states too (QuantConfig.defers_backward_update).
An autocast traced inside the compiled function cannot do this (AOT autograd refuses a tensor
written in both the forward graph and the backward graph): there each backward op updates its
own module's state at its end, which differs from eager TE only for a module run twice in a
step (docs/architecture.md). The deferred update equals eager TE's
values because TE's fused kernel (`kernel_bulk`, common/recipe/delayed_scaling.cu) is a pure
function of (history, scale) per tensor and leaves a state whose latest amax is 0 as it is:
between backward N and backward N+1 nothing else reads a backward scale or writes row 0, a
module run twice merges twice and updates once, and a forward whose backward never runs leaves
row 0 at 0.

What can be seen between steps is the difference: after backward N, row 0 holds the step's
amaxes and the backward scale is not yet updated. `flush` applies the pending updates (the
same no-op rule makes it safe at any time), and TE modules' `get_extra_state` (what state_dict
saves) flushes its own module first, so checkpoints hold what eager TE's would (with an amax
reduction over ranks, only after a flush on every rank: state_dict cannot run a collective).
"""

from __future__ import annotations

import functools
import warnings

import torch

from .errors import UnsupportedUnderCompileError
from .modules import persistent_state
from .patching import Swap
from .recipes import unfused_update_requested


def update_states(manager, forward: bool, skip_unsupported: bool = False) -> None:
    """Eager TE's `reduce_and_update_fp8_tensors(forward)` over the TE GEMM modules' state in its
    buffers (persistent_state.compiled_buffer_positions), as te_compile's op: traceable, and the
    same update eagerly. `skip_unsupported`: leave recipes te_compile refuses (a callable
    amax_compute_algo: no compiled module has their state) instead of raising."""
    state = manager.quantization_state
    for key, amax_buffer in state.global_amax_buffer.items():
        is_forward, autocast_key = manager.split_key_in_buffer(key)
        if is_forward != forward or len(amax_buffer) == 0:
            continue
        recipe, group = state.autocast_arguments[autocast_key]
        if skip_unsupported and _callable_parts(recipe):
            continue
        positions = persistent_state.compiled_buffer_positions(key)
        if not positions:
            continue
        histories = state.global_amax_history_buffer[key]
        scales = state.global_scale_buffer[key]
        _update(
            recipe,
            group,
            [histories[i] for i in positions],
            [scales[i] for i in positions],
            forward,
        )


def backward_pending() -> bool:
    """Whether compiled modules may have left backward updates to the autocast exit: one was
    traced deferring them in this process, with TE's fused update."""
    return persistent_state.deferred_update_traced() and not unfused_update_requested()


def flush() -> None:
    """Apply the backward DelayedScaling updates compiled modules left to the next autocast exit
    (a no-op where none is pending): one update per recipe over the modules in TE's global
    buffers, as the exit runs it, then one per module for those the buffers no longer hold
    (after FP8GlobalStateManager.reset()). For code that reads `fp8_meta` between steps, and
    between two backward passes with no autocast exit between them (docs/training.md); state_dict
    needs no flush. With `reduce_amax` over several ranks it all-reduces: call it on every rank."""
    if torch.compiler.is_compiling():
        raise UnsupportedUnderCompileError(
            "te_compile.flush_delayed_updates() runs between steps, not inside torch.compile: "
            "the compiled autocast exit already applies the pending updates."
        )
    if not backward_pending():
        return
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    update_states(manager, forward=False, skip_unsupported=True)
    registered = {
        id(h)
        for key, hs in manager.quantization_state.global_amax_history_buffer.items()
        for h in hs
        if not manager.split_key_in_buffer(key)[0]
    }
    for module in persistent_state.delayed_modules():
        history = getattr(module.fp8_meta.get("scaling_bwd"), "amax_history", None)
        if history is not None and id(history) not in registered:
            _flush_module(module, collective=True)


def _flush_module(module, collective: bool = False) -> None:
    """The pending backward update of one module's state. Without `collective` (state_dict, which
    may run on one rank only) it cannot reduce amaxes over ranks: where the recipe asks for that,
    the update is left pending, with a warning (the saved row 0 holds this rank's amaxes only)."""
    from transformer_engine.common.recipe import DelayedScaling

    meta = getattr(module, "fp8_meta", {})
    bwd, recipe, group = meta.get("scaling_bwd"), meta.get("recipe"), meta.get("fp8_group")
    if (
        not isinstance(recipe, DelayedScaling)  # state of another recipe since (a load, eager)
        or not hasattr(bwd, "amax_history")
        or getattr(module, persistent_state.DELAYED_ATTR, None) is None
        or not backward_pending()
        or _callable_parts(recipe)
    ):
        return
    if recipe.reduce_amax and _world_size(group) > 1 and not collective:
        warnings.warn(
            "te_compile: state_dict() saved a DelayedScaling backward state whose update is "
            "still pending (amaxes not yet reduced over ranks); call "
            "te_compile.flush_delayed_updates() on every rank before saving for eager TE's values",
            stacklevel=3,
        )
        return
    _update(recipe, group, [bwd.amax_history], [bwd.scale], forward=False)


def _make_get_extra_state(original):
    @functools.wraps(original)
    def get_extra_state(self):
        if not torch.compiler.is_compiling():
            _flush_module(self)
        return original(self)

    return get_extra_state


def swaps() -> list[Swap]:
    """TE modules' get_extra_state, flushing the module's pending backward update first."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule as base

    return [Swap(base, "get_extra_state", _make_get_extra_state(vars(base)["get_extra_state"]))]


def _callable_parts(recipe) -> bool:
    return callable(getattr(recipe, "amax_compute_algo", None)) or callable(
        getattr(recipe, "scaling_factor_compute_algo", None)
    )


def _update(recipe, group, histories, scales, forward: bool) -> None:
    from transformer_engine.common.recipe import Format

    if _callable_parts(recipe):
        raise UnsupportedUnderCompileError(
            "DelayedScaling with a callable amax_compute_algo or scaling_factor_compute_algo "
            "is not supported under torch.compile (a Python callable cannot cross a custom-op "
            "boundary); use amax_compute_algo='max' or 'most_recent', or run this step eagerly."
        )
    e4m3 = recipe.fp8_format == Format.E4M3 or (recipe.fp8_format == Format.HYBRID and forward)
    latest = None
    if recipe.reduce_amax and _world_size(group) > 1:
        # As eager TE: the latest amaxes of every registered tensor, concatenated, MAX-reduced
        # over the group. Traced, dynamo makes this a functional collective in the graph.
        latest = torch.cat([h[0] for h in histories])
        torch.distributed.all_reduce(latest, op=torch.distributed.ReduceOp.MAX, group=group)
    torch.ops.te_compile.amax_and_scale_update(
        histories,
        scales,
        recipe.amax_compute_algo,
        "e4m3" if e4m3 else "e5m2",
        float(recipe.margin),
        not unfused_update_requested(),
        latest,
    )


def _world_size(group) -> int:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)
