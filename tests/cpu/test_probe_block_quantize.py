"""scripts/probe_block_quantize.py's torch formulas on the CPU, against TE's rules as its
sources state them (docs/graph_fp8.md, "Next" 5), element by element in float64, and its
reading of TE's padded, transposed scale layouts (TE's own get_scale_shape). The probe itself
compares with TE's kernel on a GPU."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import file_module


def probe():
    return file_module("probe_block_quantize", "scripts/probe_block_quantize.py")


def _reference_scale(amax: float) -> float:
    """TE's compute_scale_from_amax, E4M3, epsilon 0, bf16 input, power-of-two scales."""
    if amax == 0 or math.isinf(amax) or math.isnan(amax):
        return 1.0
    quotient = torch.tensor(448.0 / amax, dtype=torch.float64).float().item()  # RN to float
    if math.isinf(quotient):
        quotient = probe().BF16_MAX
    return 2.0 ** math.floor(math.log2(quotient))


def test_1x128_rows_match_the_rules_elementwise():
    torch.manual_seed(0)
    x = (torch.randn(6, 300) * torch.logspace(-3, 3, 300)).bfloat16()
    x[1, 5], x[2, 130], x[3, 0:128] = float("nan"), float("inf"), float("nan")
    data, scale_inv = probe().quantize_1x128(x, "e4m3", 0.0, True)
    assert data.shape == (6, 300) and scale_inv.shape == (6, 3)
    for r in range(6):
        for b in range(3):
            block = x[r, b * 128 : (b + 1) * 128].double()
            finite = block[~block.isnan()].abs()
            amax = finite.max().item() if finite.numel() else 0.0
            scale = _reference_scale(amax)
            assert scale_inv[r, b].item() == 1.0 / scale, (r, b)
            want = (block * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            got = data[r, b * 128 : (b + 1) * 128]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (r, b)
    assert scale_inv[2, 1].item() == 1.0 and data[2, 130].float().item() == 448.0  # inf block
    assert scale_inv[3, 0].item() == 1.0 and data[3, :128].float().isnan().all()  # all NaN


def test_tiny_amax_takes_the_bf16_maximum_then_a_power_of_two():
    x = torch.full((4, 128), 1e-36).bfloat16()
    _, scale_inv = probe().quantize_1x128(x, "e4m3", 0.0, True)
    assert (scale_inv == 2.0**-127).all()


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
def test_128x128_tiles_share_one_scale_and_both_directions(shape):
    torch.manual_seed(1)
    x = (torch.randn(*shape) * 10).bfloat16()
    data, scale_inv, col, col_scale_inv = probe().quantize(x, 2)
    m, k = shape
    assert scale_inv.shape == (-(-m // 128), -(-k // 128))
    tile = x[:128, :128].double().abs().max().item()
    assert scale_inv[0, 0].item() == 1.0 / _reference_scale(tile)
    assert torch.equal(col.view(torch.uint8), data.view(torch.uint8).t())
    assert torch.equal(col_scale_inv, scale_inv.t())


def test_1x128_columns_are_blocks_of_the_transpose():
    torch.manual_seed(2)
    x = torch.randn(300, 256).bfloat16()
    _, _, col, col_scale_inv = probe().quantize(x, 1)
    assert col.shape == (256, 300) and col_scale_inv.shape == (256, 3)
    want, want_inv = probe().quantize_1x128(x.t().contiguous(), "e4m3", 0.0, True)
    assert torch.equal(col.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(col_scale_inv, want_inv)


@pytest.mark.parametrize("dims", [1, 2])
def test_te_layout_read_back(dims):
    """A TE storage laid out by TE's quantizer (CPU), its scale_inv written where TE's kernels
    write each block's value: te_logical reads back the logical [rows, blocks] values."""
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    m, k = 260, 384
    q = Float8BlockQuantizer(
        tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dims
    )
    t = q.make_empty((m, k), dtype=torch.bfloat16, device="cpu")
    mb, kb = -(-m // 128), -(-k // 128)
    row_shape = (mb, kb) if dims == 2 else (m, kb)
    col_shape = (kb, mb) if dims == 2 else (k, mb)
    row = torch.arange(math.prod(row_shape), dtype=torch.float32).view(row_shape)
    col = -torch.arange(math.prod(col_shape), dtype=torch.float32).view(col_shape)
    # TE's kernels: 1x128 scales transposed ([block, row]), 128x128 row-major; padding after
    if dims == 2:
        t._rowwise_scale_inv[:, :kb] = row
        t._columnwise_scale_inv[:, :mb] = col
    else:
        t._rowwise_scale_inv[:, :m] = row.t()
        t._columnwise_scale_inv[:, :k] = col.t()
    _, got_row, got_col_data, got_col = probe().te_logical(t, m, k, dims)
    assert torch.equal(got_row, row) and torch.equal(got_col, col)
    assert got_col_data.shape == (k, m)


def test_compiled_gives_the_eager_bytes():
    """Inductor (CPU here) on the probe's formulas, edge blocks included. A first form that cast
    the padded blocks, then sliced them, compiled to wrong bytes in the last partial block on
    torch 2.14.1's CPU backend; the probe gathers each element's scale instead."""
    torch.manual_seed(3)
    x = (torch.randn(200, 300) * 5).bfloat16()
    compiled = torch.compile(probe().quantize, fullgraph=True, dynamic=False)
    for dims in (1, 2):
        for got, want in zip(compiled(x, dims), probe().quantize(x, dims), strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dims
