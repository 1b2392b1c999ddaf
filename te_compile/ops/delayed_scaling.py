"""DelayedScaling's amax-history and scale update as a custom op.

Eager TE runs this update from `FP8GlobalStateManager.reduce_and_update_fp8_tensors`: at the exit
of the outermost autocast (forward) and at the end of the first FP8 module's backward. Under
compile the same update runs through this op, which mutates TE's own `amax_history` and `scale`
tensors in place (declared in `mutates`), so compiled and eager training share one state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import delayed_update
from .registry import op

amax_and_scale_update = op(mutates=("amax_histories", "scales"))(
    delayed_update.amax_and_scale_update
)
amax_and_scale_update.fake(lambda a: None)


@op()
def scale_snapshot(scale: Tensor) -> Tensor:
    """A copy of a module's forward scales, taken where its forward reads them. The ops quantize
    with the copy, so a recomputed forward (activation checkpointing) quantizes as the original
    did once a checkpoint policy saves it (te_compile.checkpoint_policy); the autocast exit
    updates the scales themselves before backward runs."""
    return scale.clone()


scale_snapshot.fake(lambda a: torch.empty_like(a.scale))


@op()
def scale_in_backward(scale: Tensor, grad: Tensor) -> Tensor:
    """A copy of a module's backward scales, read where its backward runs, for a backward that
    also runs TE's update op on them (elsewhere graph_fp8.delayed.read_with reads them without
    a copy). `grad`, a gradient of that backward and otherwise unused, is what places the read
    there: AOT autograd's partitioner may compute in the forward graph, and save, whatever
    depends on forward inputs alone. It chose so for FSDP2's modules, whose tensors are not
    static inputs: the backward GEMMs then ran with the forward-time reciprocal of the scale."""
    return scale.clone()


scale_in_backward.fake(lambda a: torch.empty_like(a.scale))
