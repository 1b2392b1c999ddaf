"""GPU suite for te.LayerNorm and te.RMSNorm under torch.compile(fullgraph=True): compiled vs
eager TE on identical fresh modules, output and every gradient bit-identical; 10 steps without
a recompile; reduce-overhead parity; opcheck of the real te_compile::norm_* kernels.

Run: `python3 -m pytest tests -m gpu -k norm_gpu`.
"""

from __future__ import annotations

import contextlib

import norm_cases
import pytest
import torch
import transformer_engine.pytorch as te
from torch._dynamo.utils import counters
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

from te_compile_testing import InductorRecorder

pytestmark = pytest.mark.gpu

FGS = q.FP8GlobalStateManager
H, TOKENS = 256, 64
NORMS = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm}


def fresh(name, dtype, **kwargs):
    torch.manual_seed(0)
    m = NORMS[name](H, params_dtype=dtype, **kwargs)
    with torch.no_grad():  # TE initialises gamma to 1 (or 0) and beta to 0: make bugs visible
        for p in m.parameters():
            p.normal_(mean=0.5, std=0.3)
    return m


def train(m, data, *, compiled, mode=None, recipe=None):
    torch._dynamo.reset()
    FGS.reset()
    counters.clear()
    recorder = InductorRecorder()

    def step(x):
        with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            return m(x)

    fn = step
    if compiled:
        fn = torch.compile(
            step, fullgraph=True, **(dict(mode=mode) if mode else dict(backend=recorder))
        )
    records = []
    for x, dy in data:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        x = x.clone().requires_grad_()
        out = fn(x)
        out.backward(dy)
        record = {"out": out, "dgrad": x.grad}
        record |= {f"grad {n}": p.grad for n, p in m.named_parameters()}
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        record |= {f"param {n}": p for n, p in m.named_parameters()}
        records.append({k: v.detach().clone() for k, v in record.items()})
    return records, recorder


def batches(n, in_dtype, shape=(4, TOKENS // 4, H)):
    torch.manual_seed(1)
    return [
        (
            torch.randn(shape, device="cuda", dtype=in_dtype) * 3 + 1,
            torch.randn(shape, device="cuda"),
        )
        for _ in range(n)
    ]


def assert_same(got, want):
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for key in w:
            assert g[key].dtype == w[key].dtype, f"step {step}: {key} dtype"
            assert torch.equal(g[key], w[key]), f"step {step}: {key} differs from eager TE"


def compare(name, dtype, in_dtype, steps=1, mode=None, recipe=None, **kwargs):
    data = [(x, dy.to(dtype)) for x, dy in batches(steps, in_dtype)]
    want, _ = train(fresh(name, dtype, **kwargs), data, compiled=False, recipe=recipe)
    got, recorder = train(
        fresh(name, dtype, **kwargs), data, compiled=True, mode=mode, recipe=recipe
    )
    assert_same(got, want)
    return recorder


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_matches_eager(name, dtype, zero_centered_gamma, patched):
    compare(name, dtype, dtype, zero_centered_gamma=zero_centered_gamma)


@pytest.mark.parametrize("name", list(NORMS))
def test_bf16_input_fp32_params_match_eager(name, patched):
    compare(name, torch.float32, torch.bfloat16, eps=1e-3)


@pytest.mark.parametrize("name", list(NORMS))
def test_ten_steps_inside_fp8_autocast_without_recompile(name, patched):
    recorder = compare(
        name, torch.bfloat16, torch.bfloat16, steps=10, recipe=R.Float8CurrentScaling()
    )
    assert recorder.graphs == 1


@pytest.mark.parametrize("name", list(NORMS))
def test_reduce_overhead_matches_eager(name, patched):
    compare(name, torch.bfloat16, torch.bfloat16, steps=5, mode="reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("normalization", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_ops_opcheck(normalization, dtype, patched):
    args = norm_cases.norm_fwd_args(normalization, dtype)
    torch.library.opcheck(torch.ops.te_compile.norm_fwd.default, (), args)
    torch.library.opcheck(torch.ops.te_compile.norm_bwd.default, (), norm_cases.norm_bwd_args(args))
