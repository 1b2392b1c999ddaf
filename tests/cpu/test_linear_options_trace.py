"""te.Linear options traced on CPU (joint graphs on meta): frozen weight, return_bias."""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

from te_compile_testing import (
    JointRecorder,
    build_without_gpu,
    op_targets,
    recipe_state_on,
)

RECIPES = {"none": lambda: None, "current": R.Float8CurrentScaling, "delayed": R.DelayedScaling}


@pytest.fixture
def on_meta(patched, fake_gpu):
    fake_gpu("hopper")
    with recipe_state_on("meta"):
        yield


def trace(recipe_name, freeze_weight=False, **linear_kwargs):
    """Compile a te.Linear's forward under the recipe and run it on a meta input."""
    linear = build_without_gpu(
        lambda: te.Linear(64, 32, params_dtype=torch.bfloat16, device="meta", **linear_kwargs),
        "meta",
    )
    linear.weight.requires_grad_(not freeze_weight)
    recipe = RECIPES[recipe_name]()
    rec = JointRecorder()

    def fn(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return linear(x)

    x = torch.empty(32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    return linear, x, rec, torch.compile(fn, backend=rec.backend, fullgraph=True)(x)


@pytest.mark.parametrize("name", list(RECIPES))
def test_frozen_weight(name, on_meta, graph_breaks):
    linear, x, rec, out = trace(name, freeze_weight=True)
    out.sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert "te_compile.linear_bwd.default" in op_targets(rec.bw)
    assert linear.weight.grad is None and x.grad.shape == x.shape
    if name == "none":
        # As eager TE 2.20.2: without FP8, dbias comes only from the wgrad GEMM, which a frozen
        # weight skips, so the bias gets no gradient (tests/gpu compares with eager).
        assert linear.bias.grad is None
    else:
        assert linear.bias.grad.shape == (32,)


@pytest.mark.parametrize("name", list(RECIPES))
def test_return_bias(name, on_meta, graph_breaks):
    linear, x, rec, result = trace(name, return_bias=True)
    out, bias = result
    assert out.shape == (32, 32) and bias.shape == (32,) and bias.dtype == torch.bfloat16
    (out.sum() + bias.sum()).backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1
    assert linear.bias.grad.shape == (32,) and linear.weight.grad.shape == (32, 64)
