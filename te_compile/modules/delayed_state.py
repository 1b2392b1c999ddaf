"""DelayedScaling's per-module state as the GEMM ops take it: TE's `fp8_meta` scale and amax
history tensors, created and registered at trace time (persistent_state.py), the forward op's
view of them, and the forward amaxes merged back into TE's history row 0."""

from __future__ import annotations

import torch

from ..errors import UnsupportedUnderCompileError
from ..recipes import DelayedFields, QuantConfig
from . import persistent_state


def module_state(m, recipe) -> tuple[list, list]:
    """TE's fp8_meta tensors for the ops, created at trace time (see persistent_state.py):
    ([fwd scale, fwd amax_history[0]], [bwd scale, bwd amax_history])."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    fields, group = DelayedFields.values_of(recipe), manager.get_fp8_group()
    persistent_state.ensure_delayed_states(fields, persistent_state.is_prepared(m), group)
    if getattr(m, persistent_state.DELAYED_ATTR, None) != fields:
        persistent_state.reinit_delayed_state(id(m), fields, group)  # made for another recipe
    # Each autocast exit reduces a registration's amaxes over the group it was registered
    # under; a module registered under another group would be reduced over that one.
    mismatch = persistent_state.group_mismatch(m.fp8_meta.get("fp8_group"), group)
    if mismatch:
        raise UnsupportedUnderCompileError(
            f"{type(m).__name__} with DelayedScaling state registered under "
            f"amax_reduction_group {mismatch} is not supported under torch.compile by "
            "te_compile: run each module under one amax_reduction_group; with models under "
            "different groups, call te_compile.prepare(model, recipe, amax_reduction_group=...) "
            "for each one before compiling any (the first trace registers every live TE module)."
        )
    fwd, bwd = m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]
    # Eager TE lets the first FP8 module of an autocast (by forward order, with grad) run the
    # backward update of every registered state; compiled modules leave theirs to the next
    # autocast exit (QuantConfig.defers_backward_update), so they never claim TE's
    # `is_first_fp8_module` flag: a Python write inside traced code is a side effect
    # torch.utils.checkpoint refuses.
    return [fwd.scale, fwd.amax_history[0]], [bwd.scale, bwd.amax_history]


def op_state(fwd_state: list, bwd_state: list) -> list:
    """A forward GEMM op's `delayed_state` ([] for recipes other than DelayedScaling): what it
    reads of the forward state, a snapshot of the scales (see ops/delayed_scaling.scale_snapshot)
    and never the history it updates, then the backward [scale, amax_history] that rides along
    to the backward op. The graph path (graph_fp8) takes the same three tensors."""
    if not fwd_state:
        return []
    return [torch.ops.te_compile.scale_snapshot(fwd_state[0]), *bwd_state]


def merge_forward_amaxes(fwd_state: list, amaxes: torch.Tensor) -> None:
    """Max-merge the amaxes a forward op recorded into TE's history (row 0), where a cached
    weight's amax may already be (quantize_weight writes it there)."""
    if fwd_state:
        fwd_state[1].copy_(torch.maximum(fwd_state[1], amaxes))


def fp8_module_state(m, recipe, cfg: QuantConfig) -> tuple[list, list]:
    """(fwd_state, bwd_state) for the ops: DelayedScaling's state, else empty lists."""
    if cfg.kind == "delayed":
        return module_state(m, recipe)
    return [], []
