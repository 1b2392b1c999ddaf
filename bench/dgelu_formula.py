"""TE's GELU gradient formula compiled by inductor against TE's kernel (`tex.dgelu`), one GPU.

    python bench/dgelu_formula.py

Why the graph path calls TE's kernel for the GELU's gradient (te_compile::activation_grad):
the formula written operation for operation from TE's common/util/math.h and compiled by
inductor, `(dgelu(x) * g)` rounded to bf16, was the graph path's only Float8CurrentScaling piece
in a GPT's LayerNormMLP that parted from eager TE (session 20, H100, bench/gpt_parity.py: at the
4th step under emulate_precision_casts; with TE's kernel, bit-identical over 30 steps). This
table checks the formula alone: every finite bfloat16 x against random gradients at four
scales, compiled alone and fused with the amax that followed it. Session 20 (H100, torch 2.11):
0 of 33,554,432 differ in every row, alone and fused. So the formula is TE's, and the
difference came from the kernel inductor made of it inside the MLP's whole backward (which
multiply-adds the compiler fuses can depend on that kernel), not reproduced here.
"""

from __future__ import annotations

import torch
import transformer_engine.pytorch  # noqa: F401  (loads transformer_engine_torch)
import transformer_engine_torch as tex


def dgelu(v: torch.Tensor) -> torch.Tensor:
    """TE's derivative of its tanh GELU at float32 `v` (common/util/math.h, operation order)."""
    t = torch.tanh(0.79788456 * v * (1.0 + 0.044715 * v * v))
    return 0.5 * v * ((1.0 - t * t) * (0.79788456 + 0.1070322243 * v * v)) + 0.5 * (1.0 + t)


@torch.compile
def alone(x, g):
    return (dgelu(x.float()) * g.float()).to(torch.bfloat16)


@torch.compile
def with_amax(x, g):
    d = (dgelu(x.float()) * g.float()).to(torch.bfloat16)
    return d, d.float().abs().amax()


def main() -> None:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).cuda().reshape(1, -1).expand(512, -1).contiguous()
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; x: every finite bfloat16")
    print("| gradient scale | elements | differ (alone) | differ (with amax) |")
    print("|---|---|---|---|")
    for scale in (1.0, 1e-3, 1e-6, 1e3):
        torch.manual_seed(0)
        g = (torch.randn_like(x, dtype=torch.float32) * scale).to(torch.bfloat16)
        want = tex.dgelu(g, x, None)
        got = alone(x, g)
        fused, _ = with_amax(x, g)
        n = [int((a.view(torch.int16) != want.view(torch.int16)).sum()) for a in (got, fused)]
        print(f"| {scale:g} | {x.numel()} | {n[0]} | {n[1]} |", flush=True)


if __name__ == "__main__":
    main()
