"""DelayedScaling's amax-history roll and scale update on TE's kernels (its fused CUDA kernel, or
TE's Python fallback). ops/delayed_scaling.py declares it as an op; the GEMM ops' backward
calls it directly, already inside an op kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .process_groups import all_reduce_max
from .te_dtypes import FP8_DTYPES, te_fp8_dtype


def amax_and_scale_update(
    amax_histories: list[Tensor],
    scales: list[Tensor],
    amax_compute_algo: str,
    fp8_dtype: str,
    margin: float,
    fused: bool,
    latest: Tensor | None = None,
    reduce_group: str = "",
) -> None:
    """Roll each `amax_histories[i]` ([history_len, n]) and recompute `scales[i]` ([n]).

    The most recent amaxes are row 0 of each history, as TE's kernels leave them, or `latest`
    (those rows concatenated, already reduced across ranks by the caller). `reduce_group`
    (process_groups.py) names a group to MAX-reduce them over here instead. `fused` picks TE's
    fused CUDA kernel (the default) or its Python fallback (`NVTE_UNFUSED_FP8_UPDATE=1`).
    A MAX reduction is elementwise, so one call over many pairs equals one call per pair, with
    or without it.
    """
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype!r}")
    if not amax_histories:
        return
    if latest is not None and reduce_group:
        raise ValueError("pass `latest` already reduced, or `reduce_group`, not both")
    reduced = latest is not None or bool(reduce_group)
    # Same layout TE hands its kernel: the latest amaxes of all tensors, concatenated. One
    # history (a module's own backward update) needs no copy: its row 0 is that buffer, and
    # TE's kernel reads each latest amax before its in-place roll writes row 0.
    if latest is None and len(amax_histories) == 1:
        latest = amax_histories[0][0]
    elif latest is None:
        latest = torch.cat([h[0] for h in amax_histories])
    if reduce_group:
        all_reduce_max(latest, reduce_group)
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
    if reduced:  # TE's split_and_copy of the reduced amaxes into the histories' row 0
        rows = latest.split([h.shape[1] for h in amax_histories])
        for history, row in zip(amax_histories, rows, strict=True):
            history[0].copy_(row)
    for history, scale in zip(amax_histories, scales, strict=True):
        q._amax_and_scale_update(history, scale, fmt.value.max_fwd, recipe)
