"""The op envelope: what every GEMM op's results and autograd context share (te.Linear,
LayerNormLinear, LayerNormMLP ops)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def results(like: torch.Tensor, dtype: torch.dtype, *tensors) -> tuple[torch.Tensor, ...]:
    """A backward op's results: a result not computed is an empty [0] tensor (an op's outputs
    may not be None, nor alias each other)."""
    return tuple(like.new_empty([0], dtype=dtype) if t is None else t for t in tensors)


def fake_results(like: torch.Tensor, dtype: torch.dtype, *shapes) -> tuple[torch.Tensor, ...]:
    """`results`' fake twin: (shape, computed) per result."""
    return tuple(
        like.new_empty(shape if computed else [0], dtype=dtype) for shape, computed in shapes
    )


def ride_along(a) -> SimpleNamespace:
    """What a GEMM op's backward reads from its forward call's arguments `a`, besides saved
    tensors: the plain values, and the state backward mutates (DelayedScaling's backward state,
    main_grad). Mutable state rides on ctx, not save_for_backward: backward mutates it in place,
    which the saved-tensor version check would reject."""
    return SimpleNamespace(
        **{k: v for k, v in vars(a).items() if k in _MUTATED_IN_BACKWARD or not _holds_tensor(v)}
    )


# (`delayed_state`: its backward [scale, amax_history])
_MUTATED_IN_BACKWARD = frozenset({"delayed_state", "main_grad", "fc1_main_grad", "fc2_main_grad"})


def _holds_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, list) and bool(v))
