"""TE's fused LayerNorm + DelayedScaling cast against the graph path's recomputation, element by
element, on the input where session 28's varying-length test parted (one GPU).

    python bench/norm_cast_probe.py

bench/varying_length_parity.py --modules (session 29) put the first difference of the failing
order (64 then 128 tokens, DelayedScaling, the "causal" TransformerLayer) in the output of
self_attention.layernorm_qkv at step 1, with equal state. This script rebuilds that step's norm:
eager TE trains step 0 on 64 tokens, then layernorm_qkv's norm of step 1's input (seed 11, 128
tokens) is quantized with the module's live forward scale by TE's fused kernel
(tex.layernorm_fwd with a Float8Quantizer) and by graph_fp8.norm.unrounded + quantize.cast,
eager and compiled, with mu and rsigma from TE's bfloat16-output kernel. Then the same at
scales that saturate. Prints, per scale, the FP8 bytes apart and the first few elements apart.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import attention_cases as cases  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
import transformer_engine_torch as tex  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer  # noqa: E402

from te_compile.graph_fp8 import norm as graph_norm  # noqa: E402
from te_compile.graph_fp8 import quantize  # noqa: E402
from te_compile.spec import NormSpec  # noqa: E402


def te_fused(x, g, b, eps, scale):
    q = Float8Quantizer(
        scale.clone(), torch.zeros(1, device="cuda"), tex.DType.kFloat8E4M3, columnwise=False
    )
    out, _, _ = tex.layernorm_fwd(x, g, b, eps, None, q, tex.DType.kFloat8E4M3, 0, False)
    return out._data.view(torch.uint8), q.amax


def ours(x, g, b, mu, rs, spec, scale):
    z = graph_norm.unrounded(x, g, b, mu, rs, spec)
    return quantize.cast(z, scale, "e4m3").view(torch.uint8), z.abs().amax()


def fma64(x, g, b, mu, rs, scale):
    """TE's arithmetic with g * y + b as one correctly rounded fused multiply-add."""
    y = (x.float() - mu.view(-1, 1)) * rs.view(-1, 1)
    z = (g.double() * y.double() + b.double()).float()
    return quantize.cast(z, scale, "e4m3").view(torch.uint8)


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
    torch.manual_seed(0)
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
    g, b, eps = qkv.layer_norm_weight.detach(), qkv.layer_norm_bias.detach(), qkv.eps
    spec = NormSpec(eps=eps)
    _, mu, rs = tex.layernorm_fwd(x, g, b, eps, None, None, tex.DType.kBFloat16, 0, False)
    compiled = torch.compile(ours, fullgraph=True)
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
        want, te_amax = te_fused(x, g, b, eps, scale)
        print(f"{label}: scale {scale.item()!r}; TE amax {te_amax.item()!r} ours {amax.item()!r}")
        got, _ = ours(x, g, b, mu, rs, spec, scale)
        report("graph ops, eager", got, want, z, scale)
        got_c, _ = compiled(x, g, b, mu, rs, spec, scale)
        report("graph ops, inductor", got_c, want, z, scale)
        report("fma in float64", fma64(x, g, b, mu, rs, scale), want, z, scale)


if __name__ == "__main__":
    main()
