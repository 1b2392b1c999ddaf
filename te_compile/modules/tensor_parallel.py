"""Tensor and sequence parallelism of TE's GEMM modules at trace time: a module's tp_group,
parallel_mode and sequence_parallel as the `ParallelSpec` key its ops carry (the
communication itself runs inside the ops, kernels/tensor_parallel.py), or a named refusal
where the compiled path does not implement it.

The group crosses the op boundary by name, as DelayedScaling's amax reduction group does
(kernels/process_groups.py): AOTAutograd's backward cannot hold a c10d collective on a
process group, and backward is where half of the communication is.
"""

from __future__ import annotations

from ..kernels.fp8_operands import MX_KINDS
from ..kernels.process_groups import name_of
from ..recipes import QuantConfig
from ..spec import ParallelSpec
from .gemm_common import unsupported

NO_TP = "use tp_size=1 and sequence_parallel=False"


def uses_tp(m) -> bool:
    return m.tp_size > 1 or m.sequence_parallel


def parallel_key(name: str, m, cfg: QuantConfig, mode: str | None = None) -> str:
    """Module `m`'s ParallelSpec key ("" when its GEMM communicates nothing: tp_size 1, or
    no parallel_mode, as in eager TE). `mode`: instead of m.parallel_mode."""
    mode = mode or m.parallel_mode
    if not uses_tp(m) or mode not in ("column", "row"):
        return ""
    if cfg.kind in MX_KINDS:
        raise unsupported(
            name,
            f"tensor parallelism with the {cfg.kind} recipe (its gathers are not rebuilt)",
            f"use a per-tensor or Float8BlockScaling recipe, or {NO_TP}",
        )
    spec = ParallelSpec(
        mode=mode,
        sequence=bool(m.sequence_parallel),
        group=name_of(m.tp_group),
        size=m.tp_size,
    )
    return spec.key


def mlp_parallel_key(name: str, m, cfg: QuantConfig) -> str:
    """te.LayerNormMLP's key: FC1's (column-parallel; FC2 is its row-parallel partner) under
    set_parallel_mode. Without it eager TE shards the weights but communicates nothing,
    except an all-gather under sequence parallelism that nothing reduces back: refused."""
    if m.set_parallel_mode:
        return parallel_key(name, m, cfg, mode="column")
    if m.sequence_parallel:
        raise unsupported(
            name, "sequence_parallel=True without set_parallel_mode", "set set_parallel_mode=True"
        )
    return ""
