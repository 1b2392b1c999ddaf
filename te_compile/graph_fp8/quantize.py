"""TE's per-tensor FP8 quantization in aten ops, operation for operation (TE 2.20.2's
`transformer_engine/common`: the amax kernel, `compute_scale_from_amax` of
recipe/recipe_common.cuh, the saturating cast of its pointwise kernels). Inductor turns these
into Triton kernels and fuses them with whatever produces or reads the tensor.

Where the arithmetic needs care:
- amax: TE reduces with `fmaxf(amax, fabsf(x))` from 0, which skips NaNs; `torch.amax`
  propagates them, so NaNs are zeroed first.
- scale = `__fdiv_rn(fp8_max, amax)` and scale_inv = `__frcp_rn(scale)`: IEEE division in
  float32. Triton's float32 division is not guaranteed correctly rounded, so both are
  computed in float64 and rounded once to float32; a float64 quotient of float32 operands
  rounds to the correctly rounded float32 quotient (53 >= 2 * 24 + 2: double rounding is
  innocuous for division).
- the cast: float32 `x * scale`, then TE's `__NV_SATFINITE` conversion (beyond +-fp8_max,
  infinities included, to +-fp8_max; NaN stays NaN; round to nearest even). PyTorch's cast
  maps out-of-range values to NaN, so they are clamped first (clamp keeps NaN).
- few distinct operations (`x != x` for isnan, `full_like` for constants, no shifts): inductor
  names a fused kernel after its operations, and past Triton's 150-character cut of a cubin's
  name inductor launches the kernel through Triton's slower launcher
  (tests/cpu/test_kernel_names.py).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels.te_dtypes import TORCH_FP8

# Float constants are literals inside functions, not module globals: under
# torch.compile(dynamic=True) dynamo reads a global float as a symbolic one, which then fails
# inside the graph path's autograd.Functions (ints it keeps as constants).


def fp8_max(fp8: str) -> float:
    """The largest finite value of the FP8 format `fp8`."""
    return 448.0 if fp8 == "e4m3" else 57344.0


def flt_max() -> float:
    """torch.finfo(torch.float32).max."""
    return 3.4028234663852886e38


_EXPONENT_MASK = -8388608  # 0xFF800000 as int32: sign and exponent bits of a float32
_BF16_BITS = -65536  # 0xFFFF0000 as int32: the bits a bfloat16 keeps of a float32


def amax(x: torch.Tensor, by_rows: bool = False) -> torch.Tensor:
    """max |x| as float32 [1], NaNs skipped (TE's amax kernel); 0 when every element is NaN.

    A maximum does not depend on its order, so the form is chosen for speed. Current scaling's
    amax is a pass of its own (its cast needs the finished amax): one reduction over the whole
    tensor, which inductor splits, ran 1.05-1.3x faster than rows-then-whole on the H100
    (bench/amax_variants.py, session 26). `by_rows`: over each row, then over the rows, for
    DelayedScaling, whose cast reads the same rows and takes the amax in the same pass (as TE's
    DelayedScaling cast records it; H200, [2048, 8192] bf16: 20 against 50 us for the split
    whole-tensor reduction beside the cast)."""
    if by_rows:
        return row_maxima(x).amax().reshape(1)
    return _magnitude(x).amax().float().reshape(1)


def row_maxima(x: torch.Tensor) -> torch.Tensor:
    """max |x| over each row (the last dimension), NaNs skipped, as float32 [rows].
    `amax(dim=-1)` rather than a reshape to rows: the same kernels, and torch 2.11's dynamo
    fails on the reshape's form inside the graph path's autograd.Function when the row count
    is dynamic (an AssertionError in its higher-order-op output handling)."""
    return _magnitude(x).amax(dim=-1).float()


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaNs as 0: TE's `fmaxf` from 0 skips them, `torch.amax` would propagate them."""
    magnitude = x.abs()
    return torch.where(magnitude != magnitude, torch.full_like(magnitude, 0.0), magnitude)


# Inductor reduces up to this many elements to one value in a single kernel on Hopper (its
# split heuristic's threshold, torch 2.11-2.15); amaxes() keeps its final reductions under it.
_ONE_KERNEL_ROWS = 8192


def _first_fit(sizes: list) -> list[list[int]]:
    """Indices grouped first fit, each group's sizes summing to at most _ONE_KERNEL_ROWS; a
    size of None (no whole number of rows), or one whose fit depends on a dynamic size, in a
    group of its own."""
    groups: list[list[int]] = []
    totals: list = []
    for i, n in enumerate(sizes):
        fit = [
            k
            for k, total in enumerate(totals)
            if n is not None and holds_for_every_size(total + n <= _ONE_KERNEL_ROWS)
        ]
        if fit:
            groups[fit[0]].append(i)
            totals[fit[0]] += n
        else:
            groups.append([i])
            totals.append(_ONE_KERNEL_ROWS + 1 if n is None else n)
    return groups


def holds_for_every_size(condition) -> bool:
    """`condition` where it holds for every size the graph takes, False where it depends on a
    dynamic size. Deciding that would add a guard, and a few such guards can pin the size to
    one value: the graph then recompiles for every other size, and torch 2.11's dynamo fails
    inside the autograd.Function (session 44). `isinstance(n, int)` cannot tell: dynamo
    answers True for a SymInt."""
    return statically_known_true(condition)


def _amax_groups(tensors) -> tuple[list[list[int]], int]:
    """(amaxes()'s groups, the row width): the width, the first tensor's last dimension times a
    power of two, whose rows need the fewest groups (_first_fit); tensors of dynamic size, or
    of no whole number of rows, alone."""
    last = tensors[0].shape[-1]
    best: tuple[list[list[int]], int] = ([[i] for i in range(len(tensors))], 0)
    sizes = [t.numel() for t in tensors]
    for width in [last << k for k in range(5)] if holds_for_every_size(last > 0) else []:
        rows = [n // width if holds_for_every_size(n % width == 0) else None for n in sizes]
        groups = _first_fit(rows)
        if len(groups) < len(best[0]):
            best = (groups, width)
    return best


def amaxes(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """amax() of each tensor, from one pass over several: two kernels where each amax alone
    is two (inductor splits a whole-tensor max into a partial and a final reduction), for
    tensors available together, such as a GEMM's input and its weight (session 31's count:
    8 of a TransformerLayer forward's 28 launches). Tensors of static size are read as rows
    of one width (a maximum does not depend on the order), reduced by row in one kernel, then
    each tensor's maximum over its own rows, masked: reductions over one range, which
    inductor computes in one kernel (_amax_groups says which tensors and the width). A tensor
    alone in its group gets amax() of its own."""
    groups, width = _amax_groups(tensors)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for group in groups:
        if len(group) == 1:
            out[group[0]] = amax(tensors[group[0]])
            continue
        parts = [tensors[i].reshape(-1, width) for i in group]
        found = _segment_maxima(row_maxima(torch.cat(parts)), [p.shape[0] for p in parts])
        for i, value in zip(group, found, strict=True):
            out[i] = value
    return out


def maxima(*vectors: torch.Tensor) -> list[torch.Tensor]:
    """The maximum of each float32 vector of row maxima (row_maxima's) as [1]: DelayedScaling's
    amaxes of a module's forward, which only its history merge reads. Vectors are finished
    together in groups (_first_fit), one kernel per group."""
    out: list[torch.Tensor | None] = [None] * len(vectors)
    for group in _first_fit([v.shape[0] for v in vectors]):
        if len(group) == 1:
            out[group[0]] = vectors[group[0]].amax().reshape(1)
            continue
        found = _segment_maxima(
            torch.cat([vectors[i] for i in group]), [vectors[i].shape[0] for i in group]
        )
        for i, value in zip(group, found, strict=True):
            out[i] = value
    return out


def _segment_maxima(values: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """max of each consecutive segment of `values` (non-negative float32; lengths in order) as
    [1]: masked reductions over one range, which inductor computes in one kernel (a max over
    each segment's slice would be a kernel per segment)."""
    index = torch.arange(values.shape[0], device=values.device)
    out, start = [], 0
    for n in lengths:
        inside = (index >= start) & (index < start + n)
        out.append(torch.where(inside, values, torch.full_like(values, 0.0)).amax().reshape(1))
        start += n
    return out


def scale_from_amax(
    amax: torch.Tensor, fp8: str, epsilon: float, pow2: bool, value_for_inf: float | None = None
) -> torch.Tensor:
    """TE's compute_scale_from_amax. `value_for_inf` replaces an infinite quotient: FLT_MAX
    (None) for current scaling; block scaling's kernels pass the input type's maximum."""
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    amax64 = amax.double()  # tensor / tensor: a scalar numerator is traced as a reciprocal
    scale = (torch.full_like(amax64, fp8_max(fp8)) / amax64).float()
    # isinf(s) as |s| > FLT_MAX, and TE's "isinf, 0 or NaN" as "not (finite and nonzero)"
    infinite = scale.abs() > flt_max()
    for_inf = flt_max() if value_for_inf is None else value_for_inf
    scale = torch.where(infinite, torch.full_like(scale, for_inf), scale)
    finite_nonzero = (amax.abs() < float("inf")) & (amax != 0)
    scale = torch.where(finite_nonzero, scale, torch.full_like(scale, 1.0))
    if pow2:  # keep sign and exponent: the largest power of two not above the scale
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return scale


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """TE's scale_inv, `__frcp_rn(scale)`, by way of float64 (see the module docstring)."""
    scale64 = scale.double()
    return (torch.full_like(scale64, 1.0) / scale64).float()


def fused_multiply_add(a: torch.Tensor, b: torch.Tensor, c) -> torch.Tensor:
    """float32 `a * b + c` rounded once, as the FMA nvcc makes of such a line in TE's kernels.
    Computed in float64, where the product of two floats is exact, so that the rounding does not
    depend on whether inductor contracts (it did in one graph and not in another: norm.py).
    `c`: a tensor, or a float holding a float32 value."""
    addend = c.double() if isinstance(c, torch.Tensor) else c
    return (a.double() * b.double() + addend).float()


def cast(x: torch.Tensor, scale: torch.Tensor, fp8: str) -> torch.Tensor:
    """FP8 data of `x * scale` with TE's saturating, round-to-nearest-even conversion."""
    limit = fp8_max(fp8)
    return (x.float() * scale).clamp(-limit, limit).to(TORCH_FP8[fp8])


def quantize_current(
    x: torch.Tensor,
    fp8: str,
    epsilon: float,
    pow2: bool,
    stored: bool = False,
    x_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8CurrentScaling: (FP8 data, scale_inv [1]) of x with a scale from x's own amax.
    `stored`: quantize stored_bf16(x), the value TE reads after the producer's store. Its amax
    is taken of x and rounded once: rounding to nearest is monotone and odd, so
    max |round(v)| = round(max |v|) (NaNs, zeroed first, are below any amax either way), and
    the amax pass over the tensor does no per-element rounding. `x_amax`: amax(x), if already
    taken (amaxes())."""
    x_amax = amax(x) if x_amax is None else x_amax
    if stored:
        x_amax, x = stored_bf16(x_amax), stored_bf16(x)
    scale = scale_from_amax(x_amax, fp8, epsilon, pow2)
    return cast(x, scale, fp8), reciprocal(scale)


def quantize_delayed(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8: str,
    scale_inv: torch.Tensor | None = None,
    rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DelayedScaling: (FP8 data, scale_inv [1], amax [1]) of x with a given scale [1]; the
    amax is x's, recorded for the history as TE's cast kernel records it. `scale_inv`: the
    scale's reciprocal, if already taken (graph_fp8.delayed.Scales). `rows`: the amax's row
    maxima instead (row_maxima; maxima() finishes several in one kernel)."""
    scale_inv = reciprocal(scale) if scale_inv is None else scale_inv
    return cast(x, scale, fp8), scale_inv, row_maxima(x) if rows else amax(x, by_rows=True)


def stored_bf16(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as float32, rounded to bfloat16 as a store would round them. Inductor keeps
    a fused producer's result (a GELU, a residual add) in float32 registers, unrounded, and
    would quantize that; TE quantizes the bfloat16 tensor the producer stored. Rounding to
    nearest even on the bits (a no-op on a value already bfloat16) gives TE's input back."""
    f = t.float()
    bits = f.view(torch.int32)
    # 0x7FFF plus bit 16 (the kept bits' last), chosen rather than shifted out: the same add
    odd = (bits & 0x10000) != 0
    bias = torch.where(odd, torch.full_like(bits, 0x8000), torch.full_like(bits, 0x7FFF))
    rounded = ((bits + bias) & _BF16_BITS).view(torch.float32)
    return torch.where(f != f, f, rounded)  # NaN payloads may carry into the sign
