"""The graph path's norm value (graph_fp8/norm.py) rounds `g * y + b` once, as the fused
multiply-add nvcc makes of TE's LayerNorm kernel does: checked against exact rational
arithmetic, eager and compiled (session 29: two roundings put one product a float32 step past an
FP8 tie, and a DelayedScaling TransformerLayer one bf16 step off eager TE)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from te_compile.graph_fp8 import norm as graph_norm
from te_compile.spec import NormSpec


def round_to_float32(exact: Fraction) -> np.float32:
    """`exact` rounded to the nearest float32, ties to an even significand."""
    near = np.float32(float(exact))  # within one float32 step of the answer
    candidates = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, -np.inf)]
    best = min(abs(Fraction(float(c)) - exact) for c in candidates)
    tied = [c for c in candidates if abs(Fraction(float(c)) - exact) == best]
    return min(tied, key=lambda c: int(np.array(c).view(np.uint32)) & 1)


def norm_inputs(rows=64, hidden=256):
    """bf16 x, gamma and beta where single rounding matters: gamma near 1, beta of the size of
    the product, so the sum cancels."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    beta = (0.5 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    xf = x.float()
    mu = xf.mean(dim=1)
    rsigma = torch.rsqrt(xf.var(dim=1, unbiased=False) + 1e-5)
    return x, gamma, beta, mu, rsigma


def exact_fma(x, gamma, beta, mu, rsigma) -> np.ndarray:
    y = ((x.float() - mu.view(-1, 1)) * rsigma.view(-1, 1)).numpy()  # TE: rs * (x - mu)
    g, b = gamma.float().numpy(), beta.float().numpy()
    out = np.empty_like(y)
    for i, j in np.ndindex(*y.shape):
        out[i, j] = round_to_float32(
            Fraction(float(g[j])) * Fraction(float(y[i, j])) + Fraction(float(b[j]))
        )
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_layernorm_value_is_one_fused_multiply_add(compiled):
    args = norm_inputs()
    want = exact_fma(*args)
    fn = graph_norm.unrounded
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    got = fn(*args, NormSpec()).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # the test can fail: two roundings in float32 part from the exact answer somewhere
    x, gamma, beta, mu, rsigma = args
    twice = ((x.float() - mu.view(-1, 1)) * rsigma.view(-1, 1)) * gamma.float() + beta.float()
    assert not np.array_equal(twice.numpy().view(np.uint32), want.view(np.uint32))
