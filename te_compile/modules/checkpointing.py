"""Activation checkpointing of TE modules under torch.compile.

Under compile, `torch.utils.checkpoint` becomes a region of the joint graph whose forward ops the
partitioner recomputes in backward; nothing of eager TE's FP8-aware recompute (which stashes and
restores `fp8_meta`) runs. What that needs from te_compile's ops:

- A recomputed op must not record amaxes a second time: the GEMM ops return this call's amaxes
  and the module merges them into TE's history in the graph, so a recomputed op's amaxes are
  simply dropped (ops/gemm_layer.fresh_amax_state).
- A recomputed op must quantize with the scales of the original forward. DelayedScaling updates
  its scales at the autocast exit, between forward and backward, so the ops quantize with a
  snapshot (`te_compile::scale_snapshot`), and the policy here makes the partitioner save that
  snapshot instead of recomputing it from the updated scales. Current and block scaling keep
  no state: a recompute equals the original with any policy.

`checkpoint` (and TE's own `te.distributed.checkpoint`, which `te_compile.patch()` routes here
while compiling) applies that policy. Plain `torch.utils.checkpoint` works for every recipe but
DelayedScaling, whose recompute would read the scales after their update (see docs/training.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..errors import UnsupportedUnderCompileError
from ..patching import Swap

Policy = Callable[..., CheckpointPolicy | bool]


def _always_recompute(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_policy(policy: Policy | None = None) -> Policy:
    """A selective-checkpoint policy for `create_selective_checkpoint_contexts`: `policy`'s
    decision for every op (default: recompute everything), except that the DelayedScaling
    scale snapshots a TE module's forward reads are always saved.

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        save_gemms = lambda ctx, op, *a, **k: (
            CheckpointPolicy.MUST_SAVE if op in te_compile.gemm_forward_ops()
            else CheckpointPolicy.PREFER_RECOMPUTE)
        context = functools.partial(create_selective_checkpoint_contexts,
                                    te_compile.checkpoint_policy(save_gemms))
        out = checkpoint(block, x, use_reentrant=False, context_fn=context)
    """
    inner = policy or _always_recompute
    snapshot = torch.ops.te_compile.scale_snapshot.default

    def te_compile_policy(ctx, op, *args, **kwargs):
        if op is snapshot:
            return CheckpointPolicy.MUST_SAVE
        return inner(ctx, op, *args, **kwargs)

    return te_compile_policy


def _context(policy: Policy | None):
    return create_selective_checkpoint_contexts(checkpoint_policy(policy))


def checkpoint(function: Callable, *args, policy: Policy | None = None, **kwargs):
    """`torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)` with
    `checkpoint_policy(policy)`: FP8-correct recompute of TE modules for every recipe under
    torch.compile. Not compiling, it is TE's own `te.distributed.checkpoint` (eager TE's
    FP8-aware recompute), so eager and compiled runs match."""
    if not torch.compiler.is_compiling():
        from transformer_engine.pytorch import distributed

        if policy is not None:
            kwargs["context_fn"] = functools.partial(_context, policy)
        return distributed.checkpoint(function, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=functools.partial(_context, policy),
        **kwargs,
    )


# ---- te.distributed.checkpoint while compiling ------------------------------------------------

_TE_ONLY = ("distribute_saved_activations", "get_rng_state_tracker", "tp_group")


def make_te_checkpoint(original):
    def te_checkpoint(function, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return original(function, *args, **kwargs)
        # Reentrant or not, a compiled checkpoint is the graph's recompute: same numerics.
        kwargs.pop("use_reentrant", None)
        if kwargs.pop("distribute_saved_activations", False):
            raise UnsupportedUnderCompileError(
                "te.distributed.checkpoint(distribute_saved_activations=True) is not supported "
                "under torch.compile by te_compile; pass distribute_saved_activations=False "
                "(the compiled recompute keeps only the region's inputs)."
            )
        if kwargs.pop("get_rng_state_tracker", None) is not None:
            raise UnsupportedUnderCompileError(
                "te.distributed.checkpoint(get_rng_state_tracker=...) is not supported under "
                "torch.compile by te_compile; pass no tracker: the compiled recompute replays "
                "torch's RNG state for the random ops it recomputes."
            )
        kwargs.pop("tp_group", None)  # only used with distribute_saved_activations
        context_fn = kwargs.pop("context_fn", None)
        if context_fn is not None and context_fn is not torch.utils.checkpoint.noop_context_fn:
            # A user's selective-checkpoint contexts: kept as given (see checkpoint_policy).
            return torch.utils.checkpoint.checkpoint(
                function, *args, use_reentrant=False, context_fn=context_fn, **kwargs
            )
        return checkpoint(function, *args, **kwargs)

    te_checkpoint.__doc__ = original.__doc__
    return te_checkpoint


def swaps() -> list[Swap]:
    from transformer_engine.pytorch import distributed

    return [Swap(distributed, "checkpoint", make_te_checkpoint(distributed.checkpoint))]


def gemm_forward_ops() -> frozenset:
    """The GEMM modules' forward ops (te.Linear, te.LayerNormLinear, te.LayerNormMLP), for
    selective-checkpoint policies that save their outputs: FP8 operands, no recompute of the
    GEMM, at the cost of keeping them."""
    ops = torch.ops.te_compile
    return frozenset(
        (ops.linear_fwd.default, ops.layernorm_linear_fwd.default, ops.layernorm_mlp_fwd.default)
    )
