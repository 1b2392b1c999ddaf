"""A bias gradient summed in the order of TE's fused DelayedScaling cast kernel, as graph
operations (the `graph_dbias` option).

With DelayedScaling on Hopper, eager TE computes grad_output's FP8 cast, its transpose, its amax
and the bias gradient in one kernel (`tex.bgrad_quantize` -> `cast_transpose_fused`, TE 2.20's
common/transpose/). The cast is the graph path's (x * scale, saturated, rounded to nearest
even); the sum is float32 additions in an order fixed by the kernel's tiling:

- a tile is 32 * R rows (R = the kernel's `NVEC_OUT`, below); its 8 warps take 4 * R rows each,
  in 4 steps of R consecutive rows;
- a thread sums a step's R rows from 0, then its warp's 4 step sums from 0, in order;
- a tile's 8 warp sums are added in warp order (warp 0's is the start);
- a second kernel adds the tiles' sums from 0, in tile order, and rounds to the grad's dtype.

R: with NVRTC (TE's default) and both dimensions multiples of 32, the kernel configuration of
least estimated cost, a function of the shape and the GPU's SM count (`_nvrtc_rows`); otherwise
8, the static kernel's, whose rows past the end load as zeros. Every addition is one IEEE
float32 add, so the order written here is the order computed: inductor keeps explicit additions
as written. Starting a sum "from 0" turns -0 into +0 (taken as a select, which no graph pass
folds away). A NaN's payload is not reproduced.
"""

from __future__ import annotations

import os

import torch

_WARP = 32
_WARPS_PER_TILE = 8
_STEPS_PER_WARP = _WARP // _WARPS_PER_TILE
_CACHE_LINE = 128  # bytes
# The (load, store) byte sizes TE's NVRTC kernel tries, in its order (the first of equal cost wins)
_CONFIGS = [(8, 8), (4, 8), (8, 4), (4, 4), (2, 8), (8, 2), (2, 4), (4, 2), (2, 2)]
_CONFIGS += [(1, 8), (8, 1), (1, 4), (4, 1), (1, 2), (2, 1), (1, 1)]
_STATIC_STORE = 8  # the static kernel's store size: R = 8 for a 1-byte FP8 output


def _costs(rows: int, cols: int, in_bytes: int, load: int, store: int, sms: int):
    """(elements per load, per cast store, per transposed store, active SMs) of one
    configuration as TE's performance model counts them, or None where it does not apply."""
    if load % in_bytes or _CACHE_LINE % in_bytes:
        return None
    tile_cols, tile_rows = load * _WARP // in_bytes, store * _WARP  # FP8 out: 1 byte
    if cols % tile_cols or rows % tile_rows:
        return None
    blocks = (cols // tile_cols) * (rows // tile_rows)
    active = min(-(-blocks * _WARPS_PER_TILE // 16), sms)  # 16 warps: a busy SM
    loads = min(_CACHE_LINE, tile_cols * in_bytes) // in_bytes
    return loads, min(_CACHE_LINE, tile_cols), min(_CACHE_LINE, tile_rows), active


def _cheaper(a, b) -> bool:
    """Whether configuration costs `a` are below `b`: TE's (1/load + 1/store + 1/store_t) / SMs
    in integer arithmetic over a common multiple, so that its truncations are the kernel's."""
    if a is None or b is None:
        return a is not None and b is None
    common = (a[0] * a[1] * a[2] * a[3]) * (b[0] * b[1] * b[2] * b[3])

    def cost(c):
        return (common // c[0] + common // c[1] + common // c[2]) // c[3]

    return cost(a) < cost(b)


def _nvrtc_rows(rows: int, cols: int, in_bytes: int, sms: int) -> int:
    """R of TE's NVRTC kernel: its store size (bytes of FP8, one per row) of least cost."""
    best = None
    for load, store in _CONFIGS:
        c = _costs(rows, cols, in_bytes, load, store, sms)
        if best is None or _cheaper(c, best[1]):
            best = (store, c)
    if best[1] is None:
        raise ValueError(f"no kernel configuration of TE's fits a [{rows}, {cols}] gradient")
    return best[0]


def rows_per_step(rows: int, cols: int, in_bytes: int, sms: int) -> int:
    """R, the rows a thread sums in one step, for a [rows, cols] gradient on a GPU of `sms` SMs."""
    aligned = rows % _WARP == 0 and cols % _WARP == 0
    if aligned and os.environ.get("NVTE_DISABLE_NVRTC", "") in ("", "0"):
        return _nvrtc_rows(rows, cols, in_bytes, sms)
    return _STATIC_STORE


@torch.compiler.assume_constant_result
def _rows_per_step_on(rows: int, cols: int, in_bytes: int, device_index) -> int:
    """rows_per_step on the GPU `device_index` (its SM count, TE's `cuda::sm_count`), run
    eagerly at trace time: no device query or environment read is traced."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return rows_per_step(rows, cols, in_bytes, sms)


def _from_zero(x: torch.Tensor) -> torch.Tensor:
    """0 + x: x, but +0 for -0."""
    return torch.where(x == 0, torch.zeros_like(x), x)


def _in_order(parts: torch.Tensor, start_from_zero: bool = True) -> torch.Tensor:
    """parts[0] + parts[1] + ... left to right (dimension 0), as explicit float32 additions."""
    total = _from_zero(parts[0]) if start_from_zero else parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


def bias_grad(grad2d: torch.Tensor, sms: int | None = None) -> torch.Tensor:
    """The sum of 2-D `grad2d` over its rows in grad2d's dtype, added as TE's fused kernel adds
    it (see the module docstring) on a GPU of `sms` SMs (None: grad2d's)."""
    rows, cols = int(grad2d.shape[0]), int(grad2d.shape[1])  # R depends on them: static
    if sms is None:
        r = _rows_per_step_on(rows, cols, grad2d.element_size(), grad2d.device.index)
    else:
        r = rows_per_step(rows, cols, grad2d.element_size(), sms)
    tile = _WARP * r
    tiles = -(-rows // tile)
    x = grad2d.float()
    if tiles * tile != rows:  # the static kernel's rows past the end: zeros
        x = torch.nn.functional.pad(x, (0, 0, 0, tiles * tile - rows))
    # [tile, warp, step, row of the step, column]
    x = x.reshape(tiles, _WARPS_PER_TILE, _STEPS_PER_WARP, r, cols)
    steps = _in_order(x.movedim(3, 0))  # [tile, warp, step, column]
    warps = _in_order(steps.movedim(2, 0))  # [tile, warp, column]
    tile_sums = _in_order(warps.movedim(1, 0), start_from_zero=False)  # [tile, column]
    return _in_order(tile_sums).to(grad2d.dtype)
