"""Tensor-parallel communication of one GEMM layer, as eager TE's te.Linear runs it (TE 2.20.2
module/linear.py: the input all-gather 440-530, the output reduction 660-675; backward: amax
groups 1140-1156, the input re-gather 1300-1340, dgrad 1455-1470; base.py's
grad_output_preprocess for the grad_output gather): TE's own `gather_along_first_dim`,
`reduce_scatter_along_first_dim` and `allreduce` on the group the op names, with quantizers
used as TE uses them, so FP8 tensors are gathered in FP8 with TE's scale rules.

The op bodies call these; the group arrives as a name (`ParallelSpec.group`, resolved by
process_groups.py). Float8CurrentScaling's amax of a tensor that is gathered is MAX-reduced
over the group first (TE's set_quantizer_amax_reduction_group), so every shard shares a scale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from ..recipes import QuantConfig
from ..spec import ParallelSpec
from . import extension
from .fp8_operands import (
    columnwise_parts,
    columnwise_storage,
    fake_columnwise_parts,
    quantizer,
    rowwise_storage,
)
from .process_groups import group_of


def decode(key: str) -> ParallelSpec | None:
    return ParallelSpec.from_key(key) if key else None


@functools.lru_cache(maxsize=256)
def decode_pair(key: str) -> tuple[ParallelSpec | None, ParallelSpec | None]:
    """A column-parallel GEMM's spec and its row-parallel partner's (LayerNormMLP's FC1 and
    FC2 on one group)."""
    tp = decode(key)
    return tp, None if tp is None else dataclasses.replace(tp, mode="row")


@functools.cache
def _te():
    from transformer_engine.pytorch import distributed

    return distributed


def gather(t, tp: ParallelSpec, q=None):
    """`t` all-gathered along its first dimension (quantized by `q` first when it is a
    high-precision tensor and `q` is given; an FP8 storage stays FP8)."""
    return _te().gather_along_first_dim(t, group_of(tp.group), quantizer=q)[0]


def reduce_output(out: torch.Tensor, tp: ParallelSpec | None) -> torch.Tensor:
    """Row-parallel forward output: reduce-scattered under sequence parallelism, else
    all-reduced (in place)."""
    if tp is None or tp.mode != "row":
        return out
    return _reduce(out, tp)


def reduce_dgrad(dgrad, tp: ParallelSpec | None):
    """Column-parallel dgrad: reduce-scattered under sequence parallelism, else all-reduced."""
    if dgrad is None or tp is None or tp.mode != "column":
        return dgrad
    return _reduce(dgrad, tp)


def _reduce(t: torch.Tensor, tp: ParallelSpec) -> torch.Tensor:
    group = group_of(tp.group)
    if tp.sequence:
        return _te().reduce_scatter_along_first_dim(t, group)[0]
    return _te().allreduce(t, group)[0]


@contextlib.contextmanager
def amax_reduced(q, tp: ParallelSpec | None):
    """Within the block, a Float8CurrentScaling quantizer MAX-reduces its amax over the group
    (other quantizers have no such option and are left alone; so is every quantizer when
    `tp` is None)."""
    if tp is None or not hasattr(q, "with_amax_reduction"):
        yield q
        return
    q.with_amax_reduction, q.amax_reduction_group = True, group_of(tp.group)
    try:
        yield q
    finally:
        q.with_amax_reduction, q.amax_reduction_group = False, None


# ---- the local input shard backward re-gathers (column-parallel, sequence parallel) -----------
#
# Per-tensor FP8 gathers only row-wise data (TE synthesizes the transpose after the gather), so
# the shard keeps its row-wise half [data, scale_inv]; block scaling gathers the column-wise
# half, which the shard keeps in `columnwise_parts`' layout.


def local_parts(storage, cfg: QuantConfig) -> list[torch.Tensor]:
    if cfg.per_tensor:
        return [storage._data, storage._scale_inv]
    return columnwise_parts(storage, cfg)


def fake_local_parts(shape, cfg: QuantConfig, like: torch.Tensor) -> list[torch.Tensor]:
    if cfg.per_tensor:
        return [
            like.new_empty(list(shape), dtype=torch.uint8),
            like.new_empty([1], dtype=torch.float32),
        ]
    return fake_columnwise_parts(shape, cfg, "input", like)


def gathered_wgrad_input(parts: list[torch.Tensor], cfg: QuantConfig, tp, fake_dtype):
    """The whole input, column-wise, for the wgrad GEMM: the saved shard re-gathered in FP8
    with TE's usages (set_quantizer_usage_for_wgrad_all_gather)."""
    if not cfg.per_tensor:
        local = columnwise_storage(parts, cfg, "input", fake_dtype)
        return gather(local, tp, quantizer(cfg, "input", rowwise=False, columnwise=True))
    local = rowwise_storage(parts, cfg, "input", fake_dtype)
    scale_inv = parts[1]
    q = quantizer(cfg, "input", rowwise=True, columnwise=False)
    if cfg.kind == "delayed":  # TE builds the empty result from a stateful quantizer
        with extension.with_state(q, torch.ones_like(scale_inv), torch.zeros_like(scale_inv)):
            total = gather(local, tp, q)
    else:
        total = gather(local, tp, q)
    total.update_usage(columnwise_usage=True)
    return total
