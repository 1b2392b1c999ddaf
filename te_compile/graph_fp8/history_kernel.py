"""DelayedScaling's backward history roll and scale update (delayed_update.py) as one Triton
kernel, the `triton_history_update` option (on by default): inductor writes
`delayed_update.updated` as 3 launches per module (the amax and scale, the rolled history into a
new buffer, its copy back into TE's tensor: inductor does not write a roll into the tensor it
reads), this is 1.

One program per tensor (column) of the [len, n] history: it loads the whole column and waits at
a barrier for all its warps before it stores, so its in-place roll reads every row before it
writes any. The arithmetic is delayed_update.updated's, operation for operation
(tests/cpu/test_history_kernel.py checks the two against each other in Triton's interpreter;
tests/gpu/test_history_kernel_gpu.py against TE's fused update kernel and in training against
eager TE). Imported when first used: it needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .quantize import flt_max


@triton.jit
def _roll_and_scale(
    history,
    scale,
    amax0,
    amax1,
    slot0,
    slot1,
    length,
    n,
    scaled_max,
    largest_float,
    MOST_RECENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    rows = tl.arange(0, BLOCK)
    inside = rows < length
    col = tl.load(history + rows * n + c, mask=inside, other=0.0)
    following = tl.load(history + ((rows + 1) % length) * n + c, mask=inside, other=0.0)
    row0 = tl.load(history + c)
    # this step's amax of the tensor: a GEMM's grad_output amax at its slot, else 0 (in_slots)
    a0 = tl.load(amax0).to(tl.float32)
    a1 = tl.load(amax1).to(tl.float32)
    step_amax = tl.where(c == slot0, a0, tl.where(c == slot1, a1, 0.0))
    # torch.maximum's rule as a select (a NaN operand is returned, the first if both), where
    # tl.maximum returns a canonical NaN. Under inductor the stored NaN was still canonical on
    # an H200: a NaN's payload is the one bit pattern not kept (docs/graph_fp8.md)
    latest = tl.where((row0 > step_amax) | (row0 != row0), row0, step_amax)
    read = tl.where(rows == length - 1, latest, following)  # row i + 1, the last row `latest`
    changed = latest != 0.0
    new_col = tl.where(changed, tl.where(rows == 0, 0.0, read), col)
    if MOST_RECENT:
        new_amax = latest
    else:  # fmaxf from 0 over the rows read: NaNs skipped
        finite_or_zero = tl.where(read != read, 0.0, read)
        new_amax = tl.max(tl.where(inside, tl.maximum(finite_or_zero, 0.0), 0.0), axis=0)
    new_amax = tl.where(changed, new_amax, 0.0)
    quotient = (scaled_max / new_amax.to(tl.float64)).to(tl.float32)
    usable = (new_amax == new_amax) & (tl.abs(new_amax) != float("inf")) & (new_amax > 0.0)
    new_scale = tl.where(usable, quotient, tl.load(scale + c))
    new_scale = tl.where(tl.abs(new_scale) == float("inf"), largest_float, new_scale)
    # every warp has read its rows before any warp writes: the roll is in place
    tl.debug_barrier()
    tl.store(history + rows * n + c, new_col, mask=inside)
    tl.store(scale + c, new_scale)


@torch.library.triton_op("te_compile::delayed_history_update", mutates_args={"history", "scale"})
def delayed_history_update(
    history: Tensor,
    scale: Tensor,
    amaxes: list[Tensor],
    slots: list[int],
    most_recent: bool,
    scaled_max: float,
) -> None:
    """Merge this step's `amaxes` ([1] each, at history columns `slots`; 0 in the others) into
    row 0 of `history` ([len, n], float32, contiguous) with a max, then roll it and update
    `scale` ([n]) in place, as delayed.in_slots and delayed_update.updated compute them; one or
    two amaxes (a TE module has at most two GEMMs). `scaled_max`: the FP8 format's maximum
    times 2^-margin. The amaxes go in as they are, so no kernel gathers them first."""
    if not 1 <= len(amaxes) == len(slots) <= 2:
        raise ValueError(f"one or two amaxes, one slot each: got {len(amaxes)}, {len(slots)}")
    length, n = history.shape
    second = len(amaxes) == 2
    torch.library.wrap_triton(_roll_and_scale)[(n,)](
        history,
        scale,
        amaxes[0],
        amaxes[1] if second else amaxes[0],
        slots[0],
        slots[1] if second else -1,
        length,
        n,
        scaled_max,
        flt_max(),
        MOST_RECENT=most_recent,
        BLOCK=triton.next_power_of_2(length),
    )
