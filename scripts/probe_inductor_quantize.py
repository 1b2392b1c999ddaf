"""Probe (GPU): does an inductor-generated Float8CurrentScaling quantization give TE's bytes?

    python scripts/probe_inductor_quantize.py

The launch-bound bound in docs/perf/history.md says default mode cannot beat eager TE by 1.3x
while every quantization is a call into TE's C++ extension. The way past it would be to let
inductor generate the quantization (fused with the neighbouring elementwise ops, as torchao's
float8 does) and keep only TE's GEMM. That keeps numerics identical to eager TE only if the
generated kernels produce TE's bytes: the same amax, the same scale (a float32 division), the
same rounding to FP8. This probe compares, per dtype and input, TE's `quantize` output with the
same formula in plain torch, eager and compiled: FP8 data, transpose and scale_inv, bit for bit.
It prints a table; it is a measurement for a design decision, not a test.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from transformer_engine.common import recipe as R  # noqa: E402

from te_compile.kernels import extension as core  # noqa: E402
from te_compile.kernels.fp8_operands import quantizer  # noqa: E402
from te_compile.modules.linear import _quant_config  # noqa: E402

FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def torch_quantize(x: torch.Tensor, dtype: torch.dtype, fp8_max: float, variant: str = "div"):
    """TE's current scaling written in torch: scale = max / amax (1 when amax is 0, float32
    max when the quotient overflows), data = saturate(x * scale) rounded to FP8, scale_inv =
    1 / scale. `variant` "rcp" computes the scale as max * (1 / amax) instead, "rcp-inv" also
    takes scale_inv as amax / max: other ways a kernel may compute the same numbers."""
    amax = x.abs().amax().float()
    if variant == "div":
        quotient = fp8_max / amax
    else:
        quotient = fp8_max * amax.reciprocal()
    scale = torch.where(amax > 0, quotient, torch.ones_like(amax))
    big = torch.full_like(scale, torch.finfo(torch.float32).max)
    scale = torch.where(torch.isinf(scale), big, scale)
    data = (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    scale_inv = amax / fp8_max if variant == "rcp-inv" else scale.reciprocal()
    return (
        data.view(torch.uint8),
        data.t().contiguous().view(torch.uint8),
        scale_inv.reshape(1),
    )


def inputs():
    torch.manual_seed(0)
    yield "randn 1024x1024", torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    yield "randn*1e-3 1024x4096", (torch.randn(1024, 4096, device="cuda") * 1e-3).bfloat16()
    yield "randn*300 4096x1024", (torch.randn(4096, 1024, device="cuda") * 300).bfloat16()
    yield "uniform 512x768", torch.rand(512, 768, device="cuda", dtype=torch.bfloat16)
    for i in range(20):
        scale = float(torch.empty(1).log_normal_(0, 4))
        x = (torch.randn(256, 512, device="cuda") * scale).bfloat16()
        yield f"randn*{scale:.3g} 256x512 (#{i})", x


def main() -> None:
    key_dtype = {"e4m3": "input", "e5m2": "grad"}
    cfg = _quant_config(R.Float8CurrentScaling())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("each cell: FP8 data / transpose / scale_inv equal to TE's quantize output")
    print(
        "| fp8 | input | eager torch | inductor | eager, max * (1/amax) | the same, scale_inv "
        "= amax / max |\n|---|---|---|---|---|---|"
    )
    totals = dict.fromkeys(("eager", "inductor", "eager rcp", "eager rcp-inv", "n"), 0)
    for name, (dtype, fp8_max) in FP8.items():
        q = quantizer(cfg, key_dtype[name], rowwise=True, columnwise=True)
        for label, x in inputs():
            te_out = core.quantize(x, q)
            want = (te_out._data, te_out._transpose, te_out._scale_inv)
            cells = []
            torch.compiler.reset()  # one static-shape compile per input, no recompile limit
            compiled = torch.compile(torch_quantize, fullgraph=True, dynamic=False)
            runs = (
                ("eager", torch_quantize, "div"),
                ("inductor", compiled, "div"),
                ("eager rcp", torch_quantize, "rcp"),
                ("eager rcp-inv", torch_quantize, "rcp-inv"),
            )
            for kind, fn, variant in runs:
                got = fn(x, dtype, fp8_max, variant)
                same = [
                    torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    for a, b in zip(want, got, strict=True)
                ]
                totals[kind] += all(same)
                cells.append(" / ".join("yes" if s else "NO" for s in same))
            totals["n"] += 1
            print(f"| {name} | {label} | " + " | ".join(cells) + " |", flush=True)
    n = totals["n"]
    print(f"\nall three equal to TE's, of {n} inputs:")
    for kind in ("eager", "inductor", "eager rcp", "eager rcp-inv"):
        print(f"  {kind}: {totals[kind]}")


if __name__ == "__main__":
    main()
