"""GPU suite for te.TransformerLayer under torch.compile(fullgraph=True): compiled (inductor)
vs eager TE on fresh, identical layers (option sets of tests/attention_cases.py); no recompile
over 3 steps (DelayedScaling state evolving); dropout; reduce-overhead with zero cudagraph
skips.

Parity. The TE kernels (cuDNN attention, fused RoPE, norms, GEMMs) are the same in both runs;
the elementwise code between them (bias-dropout-add, residual adds, gradient sums) is not TE's:
eager runs it as aten ops (and TE's bias-dropout-add as its own small torch.compile'd
function), compiled runs it fused into the layer's inductor kernels. Inductor keeps a fused
chain's intermediates in fp32 where eager rounds every op's result to bf16 (e.g. the residual
stream's gradient d_out + dgrad_mlp + dgrad_qkv): 1-ULP differences in dgrad and bias
gradients with inductor's defaults (run4 on an H100: max abs 0.0156-0.0625). With
`emulate_precision_casts=True` inductor rounds each op's result to its dtype as eager does:
then bit-identical is asserted. With inductor's defaults the measured max relative error is
asserted below BF16_DEFAULT_BOUND (two bf16 ULPs of the tensor's largest magnitude) and
printed (-s).

Lean: about 9 layer compiles (each 10-30 s). Run: `python3 -m pytest tests -m gpu -k
transformer_layer`.
"""

from __future__ import annotations

import contextlib

import attention_cases as cases
import pytest
import torch
import transformer_engine.pytorch as te
from conftest import recipe_for
from torch._dynamo.utils import counters
from transformer_engine.pytorch import quantization as q

from te_compile_testing import InductorRecorder
from te_compile_testing import recipe_supported as supported

pytestmark = pytest.mark.gpu
FGS = q.FP8GlobalStateManager
# Eager's rounding of every elementwise result, in inductor's fused kernels (see the docstring).
EAGER_ROUNDING = {"emulate_precision_casts": True}
BF16_DEFAULT_BOUND = 2.0**-7


fresh_layer = cases.fresh_layer


def steps(case_name, recipe_name, compiled, *, n=1, mode=None, lr=0.0):
    """`n` forward + backward steps of a fresh layer (optional SGD update); returns per step
    {out, dgrad, every parameter gradient}."""
    case = cases.LAYER_CASES[case_name]
    torch._dynamo.reset()
    FGS.reset()
    cases.reset_backend_choice()
    layer = fresh_layer(case)
    recipe = recipe_for(recipe_name)
    kwargs = cases.call_kwargs(case)

    def fn(x):
        with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            return layer(x, **kwargs)

    backend = InductorRecorder()
    if compiled:
        fn = torch.compile(fn, fullgraph=True, **({"mode": mode} if mode else {"backend": backend}))
    records = []
    torch.manual_seed(42)  # dropout's Philox stream
    for i in range(n):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        x = cases.layer_input(case, seed=10 + i)
        out = fn(x)
        out.backward(torch.randn_like(out))
        rec = {"out": out, "dgrad": x.grad} | {k: p.grad for k, p in layer.named_parameters()}
        records.append({k: v.detach().clone() for k, v in rec.items()})
        with torch.no_grad():
            for p in layer.parameters():
                p -= lr * p.grad
                p.grad = None
    if compiled and not mode:
        assert backend.graphs == 1, "recompiled"
    return records


def assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for key in w:
            assert torch.equal(g[key], w[key]), (
                f"step {i}: {key} differs from eager TE (max abs diff "
                f"{(g[key].float() - w[key].float()).abs().max().item():.3g})"
            )


def max_rel_err(got, want) -> dict[str, float]:
    """Per key, the max over steps of max|got - want| / max|want|."""
    errs = {}
    for g, w in zip(got, want, strict=True):
        for key in w:
            err = (g[key].float() - w[key].float()).abs().max() / w[key].float().abs().max()
            errs[key] = max(errs.get(key, 0.0), err.item())
    return errs


def assert_rounding_noise(got, want, key, scale_key, ratio=1e-2):
    """`key`'s gradient in both runs is below `ratio` x the largest `scale_key` gradient."""
    for run in (got, want):
        for step in run:
            scale = step[scale_key].float().abs().max()
            assert step[key].float().abs().max() <= ratio * scale, (key, scale.item())


def check(case_name, recipe_name, monkeypatch, *, exact=True, inductor=EAGER_ROUNDING, **kw):
    """Compiled vs eager TE, both run under the inductor settings `inductor` (eager TE's own
    torch.compile'd bias-dropout-add too): bit-identical when `exact`, else within
    BF16_DEFAULT_BOUND (measured value printed)."""
    import torch._inductor.config as inductor_config

    ok, reason = supported(recipe_name)
    if not ok:
        pytest.skip(reason)
    for k, v in cases.LAYER_CASES[case_name].env.items():
        monkeypatch.setenv(k, v)
    with inductor_config.patch(inductor):
        want = steps(case_name, recipe_name, False, **kw)
        got = steps(case_name, recipe_name, True, **kw)
    if not cases.LAYER_CASES[case_name].fused_attention:
        # Unfused backend: inductor compiles TE's PyTorch attention code around TE's softmax
        # kernels: compared with a bound (see test_attention_gpu.py), measured value printed.
        for key, err in max_rel_err(got, want).items():
            print(f"{case_name} {key}: max relative error {err:.3g}")
            if err < 2e-2:
                continue
            # Without RoPE, softmax is invariant to a shift of every score of a query, so the
            # key bias's true gradient is 0: both runs hold rounding noise (seen: 0.68
            # "relative" in fp32). Assert it is noise next to the query bias's gradient.
            # (RoPE rotates the bias with the keys: its gradient is real, bounded as the rest.)
            assert key.endswith("key_bias") and not cases.LAYER_CASES[case_name].rope, key
            assert_rounding_noise(got, want, key, key.replace("key_bias", "query_bias"))
        return
    if exact:
        assert_same(got, want)
        return
    errs = max_rel_err(got, want)
    print(f"{case_name}/{recipe_name} inductor defaults: max relative error per key {errs}")
    assert max(errs.values()) <= BF16_DEFAULT_BOUND, errs


# One layer per option set of tests/attention_cases.py, the Hopper recipes spread over them in
# turn (a layer compile each, 10-30 s). Random cases (dropout, drop path) are compared under one
# seed below; the sequence-128 cases are the reduce-overhead ones.
_RANDOM = {"dropout", "dropout_s128", "drop_path"}
_RECIPES = ("none", "current", "block", "delayed")
MATRIX = [
    (name, _RECIPES[i % len(_RECIPES)])
    for i, name in enumerate(n for n in cases.LAYER_CASES if n not in _RANDOM and "s128" not in n)
]


@pytest.mark.parametrize("case_name,recipe_name", MATRIX)
def test_layer_matches_eager(case_name, recipe_name, patched, monkeypatch):
    """Bit-identical with eager's rounding of the elementwise code between TE kernels."""
    check(case_name, recipe_name, monkeypatch)


@pytest.mark.parametrize("case_name,recipe_name", [("default", "none"), ("llama", "current")])
def test_layer_close_to_eager_with_inductor_defaults(case_name, recipe_name, patched, monkeypatch):
    """Inductor's defaults (fp32 intermediates in fused elementwise chains): the measured max
    relative error, within two bf16 ULPs of each tensor's largest magnitude."""
    check(case_name, recipe_name, monkeypatch, exact=False, inductor={})


def test_llama_layer_three_steps_delayed(patched, monkeypatch):
    """DelayedScaling state and weights evolving over 3 SGD steps, no recompile."""
    check("llama", "delayed", monkeypatch, n=3, lr=0.01)


# 64 tokens: eager TE's own compiled bias-dropout-add keeps the bias gradient's sum unsplit and
# fused with the dropout's gradient, so it sums that gradient unrounded; te-compile sums it as
# stored, as eager does at 256 tokens and more (modules/transformer_layer.py, session 50).
_TINY = pytest.mark.xfail(strict=True, reason="bias gradient 1 ulp: eager's fused tiny sum")


@pytest.mark.parametrize(
    "case_name", [pytest.param(n, marks=_TINY) if n == "dropout" else n for n in sorted(_RANDOM)]
)
def test_dropout_same_seed_as_eager(case_name, patched, monkeypatch):
    """hidden_dropout and attention_dropout 0.1 with inductor's fallback_random (inductor then
    calls aten's dropout, drawing from the same Philox stream as eager; the attention op draws
    where eager TE draws): bit-identical to eager under one seed (with eager's rounding, as
    test_layer_matches_eager). Without fallback_random, inductor generates its own dropout
    masks (random per step, reproducible under a seed, not eager's bits). At 64 tokens
    ("dropout") the bias gradients part by 1 ulp (session 50 on an H200: self_attention.proj's,
    up to 0.125): a known difference, docs/training.md."""
    inductor = {**EAGER_ROUNDING, "fallback_random": True}
    check(case_name, "none", monkeypatch, n=2, inductor=inductor)


@pytest.mark.parametrize(
    "case_name,recipe_name",
    [
        ("rope_s128", "current"),  # the issue's layer: split QKV parameters (TE's default)
        ("fused_qkv_s128", "none"),  # one QKV parameter: one packed QKV buffer
        ("rope_s128", "delayed"),  # DelayedScaling's state under CUDA graphs (session 48)
    ],
)
def test_reduce_overhead_no_cudagraph_skips(case_name, recipe_name, patched):
    """CUDA graphs over 4 steps: zero cudagraph skips, every step equal to eager (with eager's
    rounding, as test_layer_matches_eager). Sequences of 128: see the next test."""
    import torch._inductor.config as inductor_config

    ok, reason = supported(recipe_name)
    if not ok:
        pytest.skip(reason)
    with inductor_config.patch(EAGER_ROUNDING):
        want = steps(case_name, recipe_name, False, n=4, lr=0.01)
        skips = counters["inductor"]["cudagraph_skips"]
        got = steps(case_name, recipe_name, True, n=4, lr=0.01, mode="reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == skips
    assert_same(got, want)


def test_reduce_overhead_known_cudnn_graph_issue_named(patched):
    """cuDNN <= 9.15 runs training attention wrong inside a CUDA graph when max_seqlen_kv is not
    a multiple of 128 (wrong gradients, or an illegal memory access, on an H100; TE refuses it
    inside its own graphs). A sequence of 32 under reduce-overhead: with such a cuDNN, the named
    error with the ways out; with a newer one, equal to eager."""
    from te_compile.errors import UnsupportedUnderCompileError

    cudnn = te.get_cudnn_version()
    if cudnn > (9, 15, 0):
        want = steps("fused_qkv", "none", False, n=3)
        assert_same(steps("fused_qkv", "none", True, n=3, mode="reduce-overhead"), want)
        return
    with pytest.raises(UnsupportedUnderCompileError, match="multiple of 128"):
        steps("fused_qkv", "none", True, n=3, mode="reduce-overhead")


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_varying_sequence_length_matches_eager(recipe_name, dynamic, patched):
    """One layer over sequences of 64, 128, 96 and 64 tokens (a graph per length, the last
    reused; default mode and dynamic=True), compiled against eager TE on an identical layer,
    every output and gradient bit-identical (eager's rounding in inductor's kernels, as
    `check`)."""
    import torch._inductor.config as inductor_config

    case = cases.LAYER_CASES["causal"]
    seqs = (64, 128, 96, 64)

    def run(compiled):
        torch._dynamo.reset()
        FGS.reset()
        cases.reset_backend_choice()
        layer = fresh_layer(case)
        recipe = recipe_for(recipe_name)

        def fn(x):
            with te.autocast(recipe=recipe):
                return layer(x)

        fn = torch.compile(fn, fullgraph=True, dynamic=dynamic) if compiled else fn
        return cases.varying_length_records(fn, layer, seqs, case.dtype)

    with inductor_config.patch(EAGER_ROUNDING):
        want = run(False)
        got = run(True)
    assert_same(got, want)
