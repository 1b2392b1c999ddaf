"""TE's fused LayerNorm + DelayedScaling cast against the graph path's recomputation, element by
element, on the input where session 28's varying-length test parted (one GPU).

    python bench/norm_cast_probe.py

bench/varying_length_parity.py --modules (session 29) put the first difference of the failing
order (64 then 128 tokens, DelayedScaling, the "causal" TransformerLayer) in the output of
self_attention.layernorm_qkv at step 1, with equal state. This script rebuilds that step's norm:
eager TE trains step 0 on 64 tokens, then layernorm_qkv's norm of step 1's input (seed 11, 128
tokens) is quantized with the module's live forward scale by TE's fused kernel
(tex.layernorm_fwd with a Float8Quantizer) and by graph_fp8.norm.unrounded + quantize.cast,
eager and compiled, with mu and rsigma from TE's bfloat16-output kernel (the helpers of
tests/gpu/test_graph_fp8_norm_gpu.py). Then the same at scales that saturate. Prints, per
scale, the FP8 bytes apart and the first few elements apart. Session 29, before the fix: 1 of
32,768 apart at the live scale, eager and in that layer's graph; an exact float64 FMA matched
TE's kernel, which is what graph_fp8/norm.py computes now.
"""

from __future__ import annotations

import os
import sys

import torch

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path[:0] = [_TESTS, os.path.join(_TESTS, "gpu")]
import attention_cases as cases  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from test_graph_fp8_norm_gpu import graph_path, tes_fused  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402

from te_compile.graph_fp8 import norm as graph_norm  # noqa: E402
from te_compile.spec import NormSpec  # noqa: E402


def report(name, got, want, z, scale):
    apart = (got != want).nonzero()
    print(f"  {name}: {len(apart)} of {want.numel()} bytes apart", flush=True)
    for r, c in apart[:4].tolist():
        v = z[r, c].item()
        print(
            f"    [{r},{c}] z={v!r} z*scale={(z[r, c] * scale).item()!r} "
            f"got={got[r, c].item():#04x} te={want[r, c].item():#04x}"
        )


def main() -> None:
    layer = cases.fresh_layer(cases.LAYER_CASES["causal"])
    rec = R.DelayedScaling()
    x0 = torch.randn(64, cases.BATCH, cases.HIDDEN, generator=torch.Generator().manual_seed(10)).to(
        "cuda", torch.bfloat16
    )
    with te.autocast(recipe=rec):
        out = layer(x0.requires_grad_())
    out.backward(torch.randn_like(out))
    qkv = layer.self_attention.layernorm_qkv
    live = qkv.fp8_meta["scaling_fwd"].scale[0:1].clone()
    x = torch.randn(128, cases.BATCH, cases.HIDDEN, generator=torch.Generator().manual_seed(11)).to(
        "cuda", torch.bfloat16
    )
    x = x.view(-1, cases.HIDDEN)
    g, b = qkv.layer_norm_weight.detach(), qkv.layer_norm_bias.detach()
    spec = NormSpec(eps=qkv.eps)
    _, _, mu, rs = tes_fused(x, g, b, spec, live)
    compiled = torch.compile(graph_path, fullgraph=True)
    z = graph_norm.unrounded(x, g, b, mu, rs, spec)
    amax = z.abs().amax()
    print(
        f"rows {x.shape[0]}, live scale {live.item()!r} (448/scale = {448 / live.item():.4f}), "
        f"amax of this input {amax.item():.4f}"
    )
    for label, scale in [
        ("live", live),
        ("448/amax", (448 / amax).view(1)),
        ("2x: saturating", (896 / amax).view(1)),
        ("8x: saturating", (3584 / amax).view(1)),
    ]:
        want, te_amax, _, _ = tes_fused(x, g, b, spec, scale)
        print(f"{label}: scale {scale.item()!r}; TE amax {te_amax.item()!r} ours {amax.item()!r}")
        got, _ = graph_path(x, g, b, mu, rs, spec, scale)
        report("graph ops, eager", got, want, z, scale)
        got_c, _ = compiled(x, g, b, mu, rs, spec, scale)
        report("graph ops, inductor", got_c, want, z, scale)


if __name__ == "__main__":
    main()
