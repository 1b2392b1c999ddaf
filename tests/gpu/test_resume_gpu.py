"""GPU tests: training resumed from a checkpoint, compiled, against eager TE.

A model of te.LayerNormLinear, te.Linear and te.LayerNormMLP trains a few AdamW steps, its
state_dict (TE's DelayedScaling scales and histories travel in each module's extra state) and
the optimizer's are saved, everything is dropped and TE's global FP8 state reset (a new
process, as far as TE can tell), and a freshly built model loads them and trains on, compiled.
Eager TE does the same sequence: losses, gradients, parameters and DelayedScaling's state must
be bit-identical. The saved run is eager or compiled: both must resume.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

import te_compile

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("patched")]

FGS = q.FP8GlobalStateManager
HIDDEN, FFN, TOKENS = 64, 128, 32
RECIPES = {
    "delayed": lambda: R.DelayedScaling(amax_history_len=4),
    "current": R.Float8CurrentScaling,
}


def build(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        te.LayerNormLinear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16),
        te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16),
        te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16),
    )


def delayed_state(model) -> list[torch.Tensor]:
    te_compile.flush_delayed_updates()  # what compiled modules left to the exit
    return [
        getattr(m.fp8_meta[d], name).clone()
        for m in model
        for d in ("scaling_fwd", "scaling_bwd")
        if hasattr(m.fp8_meta.get(d), "amax_history")
        for name in ("scale", "amax_history")
    ]


def train(model, opt, recipe, first: int, n: int, compiled: bool) -> list:
    """Steps first..first+n-1 (each step's batch from its own seed): per step the loss, the
    input's and every parameter's gradient."""

    def step(x):
        with te.autocast(recipe=recipe):
            return model(x)

    fn = torch.compile(step, fullgraph=True) if compiled else step
    records = []
    for i in range(first, first + n):
        g = torch.Generator(device="cpu").manual_seed(100 + i)
        x = torch.randn(TOKENS, HIDDEN, generator=g).to("cuda", torch.bfloat16).requires_grad_()
        loss = fn(x).float().square().mean()  # outside: inductor would sum in another order
        loss.backward()
        records.append([loss.detach(), x.grad, *(p.grad.clone() for p in model.parameters())])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records


def run(recipe_name: str, saved_compiled: bool, resumed_compiled: bool):
    torch._dynamo.reset()
    FGS.reset()
    recipe = RECIPES[recipe_name]()
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = train(model, opt, recipe, 0, 3, saved_compiled)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    del model, opt
    gc.collect()
    torch._dynamo.reset()
    FGS.reset()
    model = build(1)  # other weights, fresh FP8 state: all of it must come from the checkpoint
    model.load_state_dict(saved[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(saved[1])
    after = train(model, opt, recipe, 3, 3, resumed_compiled)
    return before + after, [p.detach().clone() for p in model.parameters()], delayed_state(model)


@pytest.mark.parametrize("saved_compiled", [False, True], ids=["saved_eager", "saved_compiled"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_resumed_training_matches_eager_te(recipe_name, saved_compiled, monkeypatch):
    # TE 2.20 refuses to unpickle DelayedScaling's extra state unless told the file is trusted
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    want = run(recipe_name, False, False)
    got = run(recipe_name, saved_compiled, True)
    for step, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(u, v), f"step {step}, tensor {i}: {(u - v).abs().max()}"
    for u, v in zip(got[1], want[1], strict=True):
        assert torch.equal(u, v)
    assert len(got[2]) == len(want[2]) == (12 if recipe_name == "delayed" else 0)
    for u, v in zip(got[2], want[2], strict=True):
        assert torch.equal(u, v)
    if recipe_name == "delayed":  # FP8 ran: DelayedScaling's scales moved off 1.0
        assert not torch.equal(want[2][0], torch.ones_like(want[2][0]))
