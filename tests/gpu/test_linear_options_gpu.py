"""te.Linear options under compile on a GPU: frozen weight, return_bias; equal to eager TE."""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

pytestmark = pytest.mark.gpu
FGS = q.FP8GlobalStateManager
RECIPES = {
    "none": lambda: None,
    "current": R.Float8CurrentScaling,
    "delayed": lambda: R.DelayedScaling(amax_history_len=4),
}


def run(recipe_name: str, compiled: bool, *, freeze_weight=False, return_bias=False):
    torch._dynamo.reset()
    FGS.reset()
    torch.manual_seed(0)
    linear = te.Linear(128, 64, params_dtype=torch.bfloat16, return_bias=return_bias)
    with torch.no_grad():
        linear.bias.normal_()
    linear.weight.requires_grad_(not freeze_weight)
    recipe = RECIPES[recipe_name]()

    def fn(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return linear(x)

    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    torch.manual_seed(1)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    result = fn(x)
    out, bias = result if return_bias else (result, None)
    loss_grad = torch.randn_like(out)
    out.backward(loss_grad)
    return [out.detach(), bias, x.grad, linear.weight.grad, linear.bias.grad]


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("option", ["freeze_weight", "return_bias"])
def test_option_matches_eager(name, option, patched):
    got = run(name, True, **{option: True})
    want = run(name, False, **{option: True})
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a is None) == (b is None), f"result {i}: {a is None=} {b is None=}"
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), f"result {i} differs"
