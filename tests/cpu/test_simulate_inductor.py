"""torch.compile's default backend (inductor) under te_compile.simulate_gpu: the graphs a GPU
would compile, forward and backward, on meta tensors. DelayedScaling's backward GEMM op
mutates the backward scale and amax history (auto_functionalized_v2 in the graph), which
inductor must decompose: on meta inputs it used to refuse ("auto_functionalized_v2 was not
removed" on torch 2.14), though on a GPU the same graph compiles."""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

MODULES = {
    "linear": lambda: te.Linear(128, 128, params_dtype=torch.bfloat16),
    "layernorm_mlp": lambda: te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("recipe", [R.DelayedScaling, R.Float8CurrentScaling])
@pytest.mark.parametrize("module", list(MODULES))
def test_inductor_compiles_forward_and_backward(module, recipe, patched):
    with te_compile.simulate_gpu("hopper"):
        m = MODULES[module]().cuda()
        step = torch.compile(m, fullgraph=True)  # inductor
        x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2):
            with te.autocast(recipe=recipe()):
                out = step(x)
            out.float().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
