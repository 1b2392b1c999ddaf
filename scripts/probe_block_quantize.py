"""Probe (GPU): does Float8BlockScaling's quantization written in torch give TE's bytes?

    python scripts/probe_block_quantize.py

Block scaling's default-mode step waits on the CPU, 112 calls into TE per step at H=2048
(session 59); a graph path for it, as graph_fp8/ is for the per-tensor recipes, would need
inductor to generate TE's block quantization bit for bit. TE's arithmetic, from its sources
(docs/graph_fp8.md, "Next" 5): per block of 128 (1x128 along a row for inputs and gradients,
each output direction on its own; 128x128 tiles for weights, one scale for both directions) an
amax that skips NaNs, TE's compute_scale_from_amax with the input type's maximum for an
infinite quotient and power-of-two scales, a float32 multiply and a saturating
round-to-nearest-even cast. This probe compares, per input, TE's `quantize` output (both
directions' FP8 bytes and scale_inv, the valid part of TE's padded GEMM-ready layout) with the
same formulas in torch, eager and compiled. It prints a table: a measurement for a design
decision, not a test (tests/cpu/test_probe_block_quantize.py checks its layout code on CPU).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# The graph path's per-tensor pieces, which block scaling's rules share: NaN-skipping maxima,
# TE's compute_scale_from_amax, the saturating cast.
from te_compile.graph_fp8.quantize import cast, row_maxima, scale_from_amax  # noqa: E402

BF16_MAX = 3.3895313892515355e38  # 0x1.FEp127: TE's value_for_inf for a bf16 input


def block_scale(amax: torch.Tensor, fp8: str, epsilon: float, pow2: bool) -> torch.Tensor:
    """TE's compute_scale_from_amax for a bf16 input, elementwise over block amaxes."""
    return scale_from_amax(amax, fp8, epsilon, pow2, value_for_inf=BF16_MAX)


def _padded(x: torch.Tensor, rows_to: int, cols_to: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols_to - x.shape[1], 0, rows_to - x.shape[0]))


def _blocks(n: int) -> int:
    return -(-n // 128)


def quantize_1x128(x: torch.Tensor, fp8: str, epsilon: float, pow2: bool):
    """(FP8 data [R, C], scale_inv [R, ceil(C/128)]) of a 2-D x, blocks of 128 along rows."""
    rows, cols = x.shape
    nb = _blocks(cols)
    blocks = _padded(x, rows, nb * 128).view(rows, nb, 128)
    scale = block_scale(row_maxima(blocks), fp8, epsilon, pow2)
    block_of = torch.arange(cols, device=x.device) // 128
    scale_inv = (1.0 / scale.double()).float()  # TE's 1D kernel: `1.0 / scale` in double
    return cast(x, scale[:, block_of], fp8), scale_inv


def quantize_128x128(x: torch.Tensor, fp8: str, epsilon: float, pow2: bool):
    """(FP8 data [M, K], scale_inv [ceil(M/128), ceil(K/128)]) with one scale per tile."""
    m, k = x.shape
    mb, kb = _blocks(m), _blocks(k)
    tiles = _padded(x, mb * 128, kb * 128).view(mb, 128, kb, 128)
    scale = block_scale(row_maxima(tiles).amax(dim=1), fp8, epsilon, pow2)
    row_block = torch.arange(m, device=x.device)[:, None] // 128
    col_block = torch.arange(k, device=x.device)[None, :] // 128
    scale_inv = 1.0 / scale  # TE's 2D kernel: `1.0f / scale`
    return cast(x, scale[row_block, col_block], fp8), scale_inv


def quantize(x: torch.Tensor, dims: int, fp8: str = "e4m3", epsilon=0.0, pow2=True):
    """Both directions as TE's block quantizer makes them, logical layouts: row-wise (data
    [M, K], scale_inv), column-wise (data [K, M] = the transpose's, scale_inv)."""
    x = x.reshape(-1, x.shape[-1])
    if dims == 2:
        data, scale_inv = quantize_128x128(x, fp8, epsilon, pow2)
        return data, scale_inv, data.t().contiguous(), scale_inv.t().contiguous()
    data, scale_inv = quantize_1x128(x, fp8, epsilon, pow2)
    col_data, col_scale_inv = quantize_1x128(x.t(), fp8, epsilon, pow2)
    return data, scale_inv, col_data, col_scale_inv


def te_logical(storage, m: int, k: int, dims: int):
    """TE's storage halves as `quantize` returns them: the valid part of its GEMM-ready,
    transposed and padded scale_inv layout."""
    rs, cs = storage._rowwise_scale_inv, storage._columnwise_scale_inv
    if dims == 2:
        rs, cs = rs[:, : _blocks(k)], cs[:, : _blocks(m)]
    else:
        rs, cs = rs[:, :m].t(), cs[:, :k].t()
    data = storage._rowwise_data.view(-1, k)
    col = storage._columnwise_data.reshape(k, -1)
    return data, rs, col, cs


def inputs() -> dict:
    """Adversarial bf16 inputs, [rows, cols] with edges that are not multiples of 128."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

    tiny = randn(256, 384, scale=1e-36)
    special = randn(256, 384)
    special[3, 5], special[7, 200], special[130, 7] = float("nan"), float("inf"), -float("inf")
    special[200:, 256:] = float("nan")  # a whole block of NaNs: amax 0
    at_max = randn(256, 384).clamp(-1, 1) * 448
    denormal = torch.full((256, 384), 2.0**-133, device="cuda").bfloat16()
    denormal[::2] *= -1
    return {
        "randn": randn(1024, 2048),
        "edges 200x300": randn(200, 300),
        "large 1e4": randn(512, 1024, scale=1e4),
        "small 1e-3": randn(512, 1024, scale=1e-3),
        "tiny amax 1e-36": tiny,
        "nan/inf": special,
        "at fp8 max": at_max,
        "bf16 denormals": denormal,
        "zeros": torch.zeros(256, 384, device="cuda", dtype=torch.bfloat16),
        "bf16 max": torch.full((128, 256), BF16_MAX, device="cuda").bfloat16(),
    }


def _differs(ours, theirs) -> int:
    ours, theirs = ours.contiguous(), theirs.contiguous()
    if ours.dtype != theirs.dtype:
        ours, theirs = ours.view(torch.uint8), theirs.view(torch.uint8)
    bits = {1: torch.uint8, 4: torch.int32}[ours.element_size()]
    return int((ours.view(bits) != theirs.view(bits)).sum())


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    print("Bytes (data) and floats (scale_inv) that differ from TE's, row-wise / column-wise:\n")
    print(
        "| input | block | eager: data | eager: scale_inv | compiled: data | compiled: scale_inv |"
    )
    print("|---|---|---|---|---|---|")
    for name, x in inputs().items():
        m, k = x.shape
        # Each input is a new shape: a fresh compile per input keeps under the recompile limit.
        torch.compiler.reset()
        compiled = torch.compile(quantize, fullgraph=True, dynamic=False)
        for dims in (1, 2):
            q = Float8BlockQuantizer(
                tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dims
            )
            q.internal = True
            te = te_logical(tex.quantize(x, q), m, k, dims)
            te = (te[0].view(torch.float8_e4m3fn), te[1], te[2].view(torch.float8_e4m3fn), te[3])
            cells = []
            for fn in (quantize, compiled):
                d, s, cd, cs = (_differs(a, b) for a, b in zip(fn(x, dims), te, strict=True))
                cells += [f"{d} / {cd}", f"{s} / {cs}"]
            print(f"| {name} | {'128x128' if dims == 2 else '1x128'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
