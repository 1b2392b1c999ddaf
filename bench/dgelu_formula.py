"""TE's GELU gradient formula compiled by inductor against TE's kernel (`tex.dgelu`), one GPU.

    python bench/dgelu_formula.py

Why the graph path calls TE's kernel for the GELU's gradient (te_compile::activation_grad):
`(dgelu(x) * g)` written operation for operation from TE's common/util/math.h and compiled by
inductor matched `tex.dgelu` in sessions 13-19 on every bfloat16 x with g = 1 and on random
inputs at three scales, yet a GPT trained on it (Float8CurrentScaling, bench/gpt_parity.py)
parted from eager TE by one bf16 step at its 4th step, where TE's kernel kept it bit-identical.
The float32 result of such an expression depends on which multiplies and adds the compiler
fuses into FMAs, which can change with the kernel the expression is fused into. This table
counts the bf16 results that differ from TE's, for every bfloat16 x against random gradients
at several scales, the formula compiled alone and inside the rounding + amax it fed.
"""

from __future__ import annotations

import torch
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
