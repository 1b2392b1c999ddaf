"""graph_fp8 on LayerNormLinear, LayerNormMLP and TransformerLayer, traced on CPU with a pretend
Hopper: which calls take the graph path (TE's norm op, aten scaled GEMMs, te_compile::bias_grad)
and which stay on TE's kernel ops. Numerics: tests/gpu/test_graph_fp8_layers_gpu.py.
"""

from __future__ import annotations

import collections

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile_testing import JointRecorder, graph_fp8


def _trace(make, recipe, shape=(32, 2, 64)):
    """One compiled fwd+bwd of `make()` under `recipe`: per graph, {op: count} of the
    te_compile ops and scaled GEMMs."""
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"), graph_fp8():
        torch.manual_seed(0)
        module = make()
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def fn(x):
            with te.autocast(recipe=recipe):
                return module(x)

        out = torch.compile(fn, backend=rec.backend, fullgraph=True)(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    assert (len(rec.fw), len(rec.bw)) == (1, 1)
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())

    def count(graphs):
        targets = rec.targets(graphs)
        return collections.Counter(
            t.split(".")[1] for t in targets if "te_compile" in t or "_scaled_mm" in t
        )

    return count(rec.fw), count(rec.bw)


def _layers(n=2, **kw):
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16)
    return torch.nn.Sequential(
        *[te.TransformerLayer(64, 256, 4, **{**args, **kw}).cuda() for _ in range(n)]
    )


def test_transformer_layers_take_the_graph_path(patched, graph_breaks):
    """Float8CurrentScaling: every GEMM of two TransformerLayers is an aten scaled GEMM (4 per
    layer forward, 8 backward); TE's kernels stay for the norms, attention and the GELU's
    gradient; the QKV and FC1 biases' gradients are te_compile::bias_grad (the others are
    returned to the layer's bias-dropout-add)."""
    fw, bw = _trace(_layers, R.Float8CurrentScaling())
    assert graph_breaks() == 0
    assert fw == {"norm_fwd": 4, "_scaled_mm": 8, "fused_attn_fwd": 2}
    want_bw = {"_scaled_mm": 16, "bias_grad": 4, "norm_bwd": 4, "fused_attn_bwd": 2}
    assert bw == {**want_bw, "activation_grad": 2}


def test_delayed_scaling_layer(patched, graph_breaks):
    """DelayedScaling: every GEMM of a TransformerLayer on the graph path (TE's norm op for the
    statistics, the float32 norm value recomputed and cast in the graph, graph_fp8/norm.py).
    The biases the GEMMs add (QKV, FC1) get their gradients from TE's fused dbias + cast kernels
    (te_compile::delayed_grad_quantize); the projection's and FC2's, which the layer adds
    itself, from the layer's bias-dropout-add. The backward updates are graph operations."""
    fw, bw = _trace(lambda: _layers(1), R.DelayedScaling())
    assert graph_breaks() == 0
    assert not {"layernorm_mlp_fwd", "layernorm_linear_fwd", "linear_fwd"} & set(fw)
    assert fw["norm_fwd"] == 2 and fw["_scaled_mm"] == 4
    assert bw["_scaled_mm"] == 8 and bw["delayed_grad_quantize"] == 2 and "bias_grad" not in bw
    assert "amax_and_scale_update" not in bw and "scale_snapshot" not in bw


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_delayed_scaling_mlp(bias, patched, graph_breaks):
    """DelayedScaling's LayerNormMLP on the graph path: both biases' gradients from TE's fused
    kernels (FC2's grad_output cast, FC1's GELU-gradient cast); without biases FC2's is in the
    graph, FC1's still TE's kernel (eager TE calls it with or without a bias). The forward
    merges the six slots' amaxes into TE's history; the backward runs the module's own update
    in graph operations."""

    def make():
        return te.LayerNormMLP(64, 256, bias=bias, params_dtype=torch.bfloat16).cuda()

    fw, bw = _trace(make, R.DelayedScaling(amax_history_len=4))
    assert graph_breaks() == 0
    assert fw == {"norm_fwd": 1, "_scaled_mm": 2, "scale_snapshot": 1, "amax_and_scale_update": 1}
    # (without a bias, FC2's inductor-made cast reads TE's scales tied to the gradient: no copy)
    assert bw == {"_scaled_mm": 4, "norm_bwd": 1, "delayed_grad_quantize": 2 if bias else 1}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_unrounded_norm_value_is_tes_formula(normalization, zero_centered_gamma):
    """graph_fp8.norm.unrounded against float64 arithmetic of TE's formula on the same
    statistics (the rounding of its float32 steps is the GPU test's to check)."""
    from te_compile.graph_fp8.norm import unrounded
    from te_compile.spec import NormSpec

    torch.manual_seed(0)
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    gamma, beta = torch.randn(32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    spec = NormSpec(normalization=normalization, zero_centered_gamma=zero_centered_gamma)
    xd, gd = x.double(), gamma.double() + (1 if zero_centered_gamma else 0)
    if normalization == "RMSNorm":
        mu, rsigma = torch.empty(0), (xd.pow(2).mean(1) + 1e-5).rsqrt().float()
        want = xd * rsigma.double()[:, None] * gd
    else:
        mu = xd.mean(1).float()
        rsigma = (xd.var(1, unbiased=False) + 1e-5).rsqrt().float()
        want = (xd - mu.double()[:, None]) * rsigma.double()[:, None] * gd + beta.double()
    got = unrounded(x, gamma, beta, mu, rsigma, spec)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    # and not the bf16 rounding TE's bf16-output kernel stores
    assert not torch.equal(got, got.bfloat16().float())


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_other_activations_keep_te_mlp_kernels(activation, patched):
    """The graph MLP has TE's GELU only: another activation runs TE's MLP op; the norm +
    GEMM of LayerNormLinear still takes the graph path."""
    fw, _ = _trace(
        lambda: _layers(1, activation=activation, normalization="RMSNorm"),
        R.Float8CurrentScaling(),
    )
    assert fw["layernorm_mlp_fwd"] == 1 and "layernorm_linear_fwd" not in fw
    assert fw["_scaled_mm"] == 2


def test_layernorm_linear_returned_norm_output(patched):
    """return_layernorm_output on the graph path: the norm op's output is returned and its
    gradient joins the GEMM's before the norm backward, as in eager TE."""

    def make():
        return te.LayerNormLinear(
            64, 32, return_layernorm_output=True, params_dtype=torch.bfloat16
        ).cuda()

    fw, bw = _trace(make, R.Float8CurrentScaling())
    assert fw == {"norm_fwd": 1, "_scaled_mm": 1}
    assert bw == {"_scaled_mm": 2, "bias_grad": 1, "norm_bwd": 1}


def test_large_transposes_use_tes_kernel(patched):
    """Transposed FP8 copies of at least TE_TRANSPOSE_MIN_ELEMENTS go through TE's transpose
    kernel; smaller ones stay inductor's. The weight's copy (in forward) and grad_output's (in
    backward) are made by the op that runs the GEMM reading the same tensor
    (te_compile::scaled_mm_transposing), so that tensor has one consumer: as two, inductor
    stored its bytes twice (graph_fp8/linear.py). The input's copy for wgrad stays apart."""
    from te_compile.graph_fp8.linear import TE_TRANSPOSE_MIN_ELEMENTS

    side = 4096
    assert side * side >= TE_TRANSPOSE_MIN_ELEMENTS > 64 * 64

    def make(n):
        return lambda: te.Linear(n, n, bias=False, params_dtype=torch.bfloat16).cuda()

    fw, bw = _trace(make(side), R.Float8CurrentScaling(), shape=(side, side))
    fw, bw = dict(fw), dict(bw)
    # the input's copy: in forward or in backward, as the partitioner places it
    assert fw.pop("fp8_transpose", 0) + bw.pop("fp8_transpose", 0) == 1
    assert fw == {"scaled_mm_transposing": 1}  # fprop and the weight's copy
    assert bw == {"scaled_mm_transposing": 1, "_scaled_mm": 1}  # dgrad + grad's copy; wgrad
    fw, bw = _trace(make(64), R.Float8CurrentScaling(), shape=(32, 64))
    assert (fw, bw) == ({"_scaled_mm": 1}, {"_scaled_mm": 2})


def test_large_transposes_only_where_their_gemm_runs(patched):
    """An input that needs no gradient: no dgrad, so no weight copy, and wgrad's copies
    (grad_output's and the input's) by TE's transpose kernel alone."""
    side = 4096
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"), graph_fp8():
        module = te.Linear(side, side, bias=False, params_dtype=torch.bfloat16).cuda()
        x = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)

        def fn(x):
            with te.autocast(recipe=R.Float8CurrentScaling()):
                return module(x)

        torch.compile(fn, backend=rec.backend, fullgraph=True)(x).float().sum().backward()
    ops = [t for t in rec.targets(rec.fw + rec.bw) if "te_compile" in t or "_scaled_mm" in t]
    want = ["_scaled_mm", "_scaled_mm", "fp8_transpose", "fp8_transpose"]
    assert sorted(t.split(".")[1] for t in ops) == want


def test_inference_under_no_grad_takes_the_graph_path(patched, graph_breaks):
    """Eval mode under no_grad: the graph path's forward alone (4 scaled GEMMs per layer),
    without a backward to save for."""
    for recipe, want in ((R.Float8CurrentScaling(), 8), (R.DelayedScaling(), 8)):
        rec = JointRecorder()
        with te_compile.simulate_gpu("hopper"), graph_fp8(), torch.no_grad():
            layers = _layers().eval()
            x = torch.randn(32, 2, 64, device="cuda", dtype=torch.bfloat16)

            def fn(x, layers=layers, recipe=recipe):
                with te.autocast(recipe=recipe):
                    return layers(x)

            torch.compile(fn, backend=rec.backend, fullgraph=True)(x)
        assert graph_breaks() == 0
        assert sum("_scaled_mm" in t for t in rec.targets(rec.fw)) == want
