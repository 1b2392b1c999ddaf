"""Where nvcc fuses a multiply and an add in TE's kernels, the graph path rounds once too
(quantize.fused_multiply_add): the LayerNorm value DelayedScaling's fused norm casts
(graph_fp8/norm.py) and the GELU's inner polynomial (graph_fp8/mlp.py), checked against exact
rational arithmetic, eager and compiled (session 29: two roundings put one LayerNorm value a
float32 step past an FP8 tie, and a DelayedScaling TransformerLayer one bf16 step off eager TE)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from te_compile.graph_fp8 import mlp, quantize
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


def exact_norm_value(x, gamma, beta, mu, rsigma) -> np.ndarray:
    y = (x.float() - mu.view(-1, 1)) * rsigma.view(-1, 1)  # TE: rs * (x - mu), rounded
    g, b = gamma.float().expand_as(y), beta.float().expand_as(y)
    return exact_fma(y, g, b).reshape(y.shape)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_layernorm_value_is_one_fused_multiply_add(compiled):
    args = norm_inputs()
    want = exact_norm_value(*args)
    fn = graph_norm.unrounded
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    got = fn(*args, NormSpec()).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # the test can fail: two roundings in float32 part from the exact answer somewhere
    x, gamma, beta, mu, rsigma = args
    twice = ((x.float() - mu.view(-1, 1)) * rsigma.view(-1, 1)) * gamma.float() + beta.float()
    assert not np.array_equal(twice.numpy().view(np.uint32), want.view(np.uint32))


def exact_fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> np.ndarray:
    a, b, c = (t.numpy().ravel() for t in (a, b, c))
    out = [
        round_to_float32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        for x, y, z in zip(a, b, c, strict=True)
    ]
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_fused_multiply_add_rounds_once(compiled):
    """Random float32 operands over wide exponents, sums that cancel, and denormal results."""
    g = torch.Generator().manual_seed(1)
    n = 3000
    a = torch.randn(n, generator=g) * 2.0 ** torch.randint(-60, 60, (n,), generator=g)
    b = torch.randn(n, generator=g) * 2.0 ** torch.randint(-60, 60, (n,), generator=g)
    c = -(a * b) * (1 + 2.0**-20 * torch.randn(n, generator=g))  # near cancellation
    c[: n // 3] = torch.randn(n // 3, generator=g)
    a[-8:], b[-8:], c[-8:] = 1e-30, 1e-10, 0.0  # a denormal product
    fn = torch.compile(quantize.fused_multiply_add) if compiled else quantize.fused_multiply_add
    got = fn(a, b, c).numpy()
    assert np.array_equal(got.view(np.uint32), exact_fma(a, b, c).view(np.uint32))


def test_gelu_inner_polynomial_is_one_fused_multiply_add():
    """mlp.gelu's `0.79788456 + (0.03567741 * v) * v` as one FMA (nvcc's SASS for TE's line),
    the rest as TE writes it; the polynomial rounded twice differs (the test can fail)."""
    g = torch.Generator().manual_seed(2)
    v = torch.randn(4000, generator=g) * 3
    t = 0.03567741 * v
    inner = torch.from_numpy(exact_fma(v, t, torch.full_like(v, 0.79788456)))
    want = v * (0.5 + 0.5 * torch.tanh(v * inner))
    assert torch.equal(mlp.gelu(v).view(torch.int32), want.view(torch.int32))
    twice = 0.79788456 + 0.03567741 * v * v
    assert not torch.equal(twice.view(torch.int32), inner.view(torch.int32))
