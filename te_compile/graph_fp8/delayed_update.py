"""DelayedScaling's amax-history roll and scale update as graph operations, for a module's
backward state on the graph path: inductor fuses it into the backward's kernels, where the op
(te_compile::amax_and_scale_update, TE's kernel) costs a call into TE and a scale snapshot.

What TE's fused update does per tensor (`kernel_bulk` of common/recipe/delayed_scaling.cu, not
built with fast math), given the latest amax `last` (the reduction buffer's value, or row 0 of
the history where that is 0; the graph path passes row 0 merged with this step's amax):

- `last == 0`: nothing changes (no roll; the scale stays).
- else the history rolls: row i takes row i + 1, the last row `last`, row 0 becomes 0; the amax
  is `last` ("most_recent") or `fmaxf` from 0 over the rows read (rows 1.. and `last`: NaNs
  skipped) ("max").
- scale = `scaled_max / amax` (IEEE float32 division; here in float64, rounded once, as
  quantize.py's scale) when the amax is finite and > 0, else the old scale; an infinite scale
  becomes FLT_MAX. `scaled_max` = fp8_max * 2^-margin in float32 on the host: exact
  for integer margins, the only ones taken here (`applies`).
"""

from __future__ import annotations

import torch

from .quantize import flt_max, fp8_max


def applies(algo: str, margin: float, fused: bool) -> bool:
    """Whether the graph computes TE's update bit for bit (else the op runs TE's)."""
    return fused and algo in ("max", "most_recent") and float(margin).is_integer()


def scaled_max(fp8: str, margin: float) -> float:
    """The update's numerator: the FP8 format's maximum times 2^-margin (exact in float32 for
    the integer margins taken here)."""
    return fp8_max(fp8) * 2.0**-margin


def updated(history, scale, last, algo: str, fp8: str, margin: float):
    """(new history [len, n], new scale [n]) of TE's fused update, `last` [n] the latest amaxes."""
    # Selects over a roll, not cats: inductor fuses them into one kernel with the amax.
    row = torch.arange(history.shape[0], device=history.device).unsqueeze(1)
    last_row = row == history.shape[0] - 1
    read = torch.where(last_row, last.unsqueeze(0), torch.roll(history, -1, 0))  # row i + 1
    changed = last != 0
    rolled = torch.where(row == 0, torch.zeros_like(read), read)
    new_history = torch.where(changed, rolled, history)
    if algo == "max":
        finite_or_zero = torch.where(torch.isnan(read), torch.zeros_like(read), read)
        amax = finite_or_zero.clamp_min(0).amax(dim=0)
    else:
        amax = last
    amax = torch.where(changed, amax, torch.zeros_like(amax))
    amax64 = amax.double()
    quotient = (torch.full_like(amax64, scaled_max(fp8, margin)) / amax64).float()
    new_scale = torch.where(torch.isfinite(amax) & (amax > 0), quotient, scale)
    infinite = torch.isinf(new_scale)
    return new_history, torch.where(infinite, torch.full_like(new_scale, flt_max()), new_scale)
