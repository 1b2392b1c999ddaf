"""GPU: te.Linear with parameters_split under torch.compile(fullgraph=True) vs eager TE on fresh,
identical modules: output, dgrad and every split parameter's gradient bit-identical over 3 SGD
steps, in default mode and with mode="reduce-overhead" (CUDA graphs). TE allocates the split
parameters as views of one buffer; the compiled path concatenates them in the graph (TE's
noop_cat gives the GEMM the same rows).

The reduce-overhead case also isolates a failure seen on an H100 (see docs/architecture.md,
"reduce-overhead and split parameters"): every TransformerLayer/MultiheadAttention run with
split QKV parameters went wrong from the first recorded step, every run without them matched.

Run: `python3 -m pytest tests -m gpu -k linear_split`.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import recipe_instances
from transformer_engine.pytorch import quantization as q

from te_compile_testing import recipe_supported as supported

pytestmark = pytest.mark.gpu

IN, TOKENS = 128, 64
SPLIT = {"query": 128, "key": 64, "value": 64}


def run(recipe_name, compiled, mode=None, n=3):
    torch._dynamo.reset()
    q.FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    m = te.Linear(IN, sum(SPLIT.values()), parameters_split=SPLIT, params_dtype=torch.bfloat16)
    with torch.no_grad():
        for name in m.bias_names:
            getattr(m, name).add_(0.1 * torch.randn_like(getattr(m, name)))
    recipe = None if recipe_name == "none" else recipe_instances()[recipe_name]

    def fn(x):
        with te.autocast(recipe=recipe) if recipe else contextlib.nullcontext():
            return m(x)

    if compiled:
        fn = torch.compile(fn, fullgraph=True, **({"mode": mode} if mode else {}))
    records = []
    for i in range(n):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        g = torch.Generator(device="cpu").manual_seed(10 + i)
        x = torch.randn(TOKENS, IN, generator=g).cuda().to(torch.bfloat16).requires_grad_()
        out = fn(x)
        out.backward(torch.randn(out.shape, generator=g).cuda().to(out.dtype))
        rec = {"out": out, "dgrad": x.grad} | {k: p.grad for k, p in m.named_parameters()}
        records.append({k: v.detach().clone() for k, v in rec.items()})
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    return records


@pytest.mark.parametrize(
    "recipe_name,mode",
    [
        ("none", None),
        ("current", None),
        ("none", "reduce-overhead"),
        ("current", "reduce-overhead"),
    ],
)
def test_split_linear_matches_eager(recipe_name, mode, patched):
    ok, reason = supported(recipe_name)
    if not ok:
        pytest.skip(reason)
    want = run(recipe_name, False)
    got = run(recipe_name, True, mode)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in w:
            assert torch.equal(g[key], w[key]), (
                f"step {i}: {key} differs (max abs diff "
                f"{(g[key].float() - w[key].float()).abs().max().item():.3g})"
            )
