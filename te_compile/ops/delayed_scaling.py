"""DelayedScaling's amax-history and scale update as a custom op.

Eager TE runs this update from `FP8GlobalStateManager.reduce_and_update_fp8_tensors`: at the exit
of the outermost autocast (forward) and at the end of the first FP8 module's backward. Under
compile the same update runs through this op, which mutates TE's own `amax_history` and `scale`
tensors in place (declared in `mutates_args`), so compiled and eager training share one state.
"""

from __future__ import annotations

import torch

from . import registry
from .te_dtypes import FP8_DTYPES, te_fp8_dtype


def update_amax_and_scale(
    amax_histories: list[torch.Tensor],
    scales: list[torch.Tensor],
    amax_compute_algo: str,
    fp8_dtype: str,
    margin: float,
    fused: bool,
) -> None:
    """Roll each `amax_histories[i]` ([history_len, n]) and recompute `scales[i]` ([n]).

    The most recent amaxes are row 0 of each history, as TE's kernels leave them. `fused` picks
    TE's fused CUDA kernel (the default) or its Python fallback (`NVTE_UNFUSED_FP8_UPDATE=1`).
    Without a cross-rank reduction each (history, scale) pair updates independently, so one
    call over many pairs equals one call per pair.
    """
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype!r}")
    if not amax_histories:
        return
    # Same layout TE hands its kernel: the latest amaxes of all tensors, concatenated.
    latest = torch.cat([h[0] for h in amax_histories])
    if fused:
        import transformer_engine_torch as tex

        tex.fused_amax_and_scale_update_after_reduction(
            latest, amax_histories, scales, amax_compute_algo, te_fp8_dtype(fp8_dtype), margin
        )
        return
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.pytorch import quantization as q

    recipe = DelayedScaling(margin=int(margin), amax_compute_algo=amax_compute_algo)
    fmt = Format.E4M3 if fp8_dtype == "e4m3" else Format.E5M2
    for history, scale in zip(amax_histories, scales, strict=True):
        q._amax_and_scale_update(history, scale, fmt.value.max_fwd, recipe)


AMAX_AND_SCALE_UPDATE = registry.define(
    "amax_and_scale_update(Tensor(a!)[] amax_histories, Tensor(b!)[] scales, "
    "str amax_compute_algo, str fp8_dtype, float margin, bool fused) -> ()",
    update_amax_and_scale,  # the op runs the function above
    lambda amax_histories, scales, amax_compute_algo, fp8_dtype, margin, fused: None,
)
