"""GPU tests: the graph path's norm + DelayedScaling cast (graph_fp8/norm.py, quantize.cast)
against TE's fused norm kernel with FP8 output, byte for byte, over many scales, eager graph
operations and inductor's. Session 29 found one value in 32,768 apart at one scale when the
norm's multiply-add was left to the compiler (bench/norm_cast_probe.py, the same comparison
on the layer input that showed it).

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_graph_fp8_norm_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch
import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

from te_compile.graph_fp8 import norm as graph_norm
from te_compile.graph_fp8 import quantize
from te_compile.spec import NormSpec

pytestmark = pytest.mark.gpu
E4M3 = tex.DType.kFloat8E4M3


def tes_fused(x, gamma, beta, spec: NormSpec, scale):
    """(FP8 bytes, amax) of TE's norm kernel casting straight to FP8, and (mu, rsigma) of its
    bfloat16-output kernel, which the graph path reads."""
    q = Float8Quantizer(scale.clone(), torch.zeros(1, device="cuda"), E4M3, columnwise=False)
    zcg = spec.zero_centered_gamma
    if spec.normalization == "LayerNorm":
        out, _, _ = tex.layernorm_fwd(x, gamma, beta, spec.eps, None, q, E4M3, 0, zcg)
        _, mu, rs = tex.layernorm_fwd(
            x, gamma, beta, spec.eps, None, None, tex.DType.kBFloat16, 0, zcg
        )
    else:
        out, _, _ = tex.rmsnorm_fwd(x, gamma, spec.eps, None, q, E4M3, 0, zcg)
        _, _, rs = tex.rmsnorm_fwd(x, gamma, spec.eps, None, None, tex.DType.kBFloat16, 0, zcg)
        mu = torch.empty(0, device="cuda")  # what te_compile::norm_fwd returns for RMSNorm
    return out._data.view(torch.uint8), q.amax, mu, rs


def graph_path(x, gamma, beta, mu, rs, spec: NormSpec, scale):
    z = graph_norm.unrounded(x, gamma, beta, mu, rs, spec)
    return quantize.cast(z, scale, "e4m3").view(torch.uint8), z.abs().amax()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("rows,hidden", [(256, 128), (1024, 1024)])
def test_norm_cast_is_tes_fused_kernel(rows, hidden, normalization, zcg, compiled):
    g = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to("cuda", torch.bfloat16)
    gamma = (0.1 * torch.randn(hidden, generator=g) + (0 if zcg else 1)).to("cuda", torch.bfloat16)
    beta = (0.3 * torch.randn(hidden, generator=g)).to("cuda", torch.bfloat16)
    spec = NormSpec(normalization=normalization, zero_centered_gamma=zcg)
    fn = torch.compile(graph_path, fullgraph=True, dynamic=False) if compiled else graph_path
    _, _, mu, rs = tes_fused(x, gamma, beta, spec, torch.ones(1, device="cuda"))
    amax = graph_norm.unrounded(x, gamma, beta, mu, rs, spec).abs().amax()
    # scales from far below the amax's to 8x past it (saturating), not round numbers
    for factor in torch.logspace(-2, 3, 48, base=2.0).tolist():
        scale = (448.0 * factor / amax).view(1).float()
        want, want_amax, _, _ = tes_fused(x, gamma, beta, spec, scale)
        got, got_amax = fn(x, gamma, beta, mu, rs, spec, scale)
        apart = int((got != want).sum())
        assert apart == 0, f"scale {scale.item()!r}: {apart} FP8 values apart"
        assert torch.equal(got_amax.view(1), want_amax.view(1))
