"""GPU: activation checkpointing with FP8 under torch.compile(fullgraph=True), against eager TE's
own FP8-aware recompute (te.distributed.checkpoint), as a training stack runs it: a 4-layer
Llama-style model (examples/models.py) with every layer wrapped in te.distributed.checkpoint,
AdamW, 10 steps, the whole training step compiled or each checkpointed layer compiled on its own
(wrap, then compile: torchtitan's order).

The recompute must change nothing: per step the loss, and at the end every parameter and every
TE module's DelayedScaling state (amax history and scale, forward and backward; they must have
moved: FP8 really ran) are bit-identical to the same model compiled without checkpointing, and
the losses within 2.5e-2 of eager TE's te.distributed.checkpoint run (measured on an H100: 1.3e-2 at most) (the whole model's inductor
kernels round differently from eager's; see test_cudagraph_loops_gpu.py). A recompute that
quantized with the updated DelayedScaling scales, as plain torch.utils.checkpoint does, shows
as a difference (checked too). Peak memory: the checkpointed compiled model below the same
model compiled without checkpointing.

Run: `python -m pytest tests/gpu/test_checkpoint_gpu.py -m gpu`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import example_models, recipe_for, skip_unless_supported
from torch._dynamo.utils import counters
from transformer_engine.pytorch import quantization as q

pytestmark = pytest.mark.gpu

M = example_models()
FGS = q.FP8GlobalStateManager
RECIPES = ["none", "current", "block", "delayed"]
STEPS, BATCH, SEQ, LAYERS, LR = 10, 2, 128, 4, 1e-3


def build(checkpoint: str):
    torch.manual_seed(0)
    config = M.LlamaConfig(max_seq_len=SEQ, num_layers=LAYERS, checkpoint=checkpoint)
    return M.Llama(config).cuda()


@functools.cache
def batches():
    return M.synthetic_batches(256, BATCH, SEQ, STEPS, seed=0)


def te_modules(model):
    return [m for m in model.modules() if hasattr(m, "fp8_meta") and "scaling_fwd" in m.fp8_meta]


def delayed_state(model) -> list[torch.Tensor]:
    out = []
    for m in te_modules(model):
        for key in ("scaling_fwd", "scaling_bwd"):
            out += [m.fp8_meta[key].amax_history.clone(), m.fp8_meta[key].scale.clone()]
    return out


def train(model, recipe, compile_mode: str | None, where: str = "whole"):
    """STEPS AdamW steps; returns (losses, peak memory of the steps in bytes)."""
    step = M.train_step(model, recipe)
    if compile_mode is not None and where == "whole":
        step = torch.compile(step, fullgraph=True, mode=compile_mode)
    elif compile_mode is not None:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, fullgraph=True, mode=compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    torch.cuda.reset_peak_memory_stats()
    for tokens, targets in batches():
        if compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss = step(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    torch.cuda.synchronize()
    return torch.stack(losses), torch.cuda.max_memory_allocated()


@pytest.fixture
def eager_rounding(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "emulate_precision_casts", True)


@pytest.mark.parametrize("where", ["whole", "blocks"])
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_checkpointed_training_equals_eager_te_checkpoint(
    recipe_name, where, patched, eager_rounding
):
    skip_unless_supported(recipe_name)
    recipe = recipe_for(recipe_name)
    eager_losses, _ = train(build("te"), recipe, None)
    FGS.reset()
    reference = build("none")
    ref_losses, _ = train(reference, recipe, "default", where)
    FGS.reset()
    torch._dynamo.reset()
    counters.clear()
    compiled = build("te")
    losses, _ = train(compiled, recipe, "default", where)
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    assert (losses - eager_losses).abs().max() < 2.5e-2, (losses - eager_losses).abs().max()
    for a, b in zip(compiled.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    if recipe_name == "delayed":
        state, ref_state = delayed_state(compiled), delayed_state(reference)
        assert len(state) == len(ref_state) > 0
        for a, b in zip(state, ref_state, strict=True):
            assert torch.equal(a, b)
        scales = [m.fp8_meta["scaling_fwd"].scale for m in te_modules(compiled)]
        assert all((s != 1).any() for s in scales), "DelayedScaling scales never moved"


def test_plain_torch_checkpoint_with_delayed_scaling_differs(patched, eager_rounding):
    """The control: torch.utils.checkpoint (no FP8-aware policy) recomputes with the scales the
    autocast exit already updated, so the same training is not bit-identical any more."""
    recipe = recipe_for("delayed")
    ref_losses, _ = train(build("none"), recipe, "default", "blocks")
    FGS.reset()
    torch._dynamo.reset()
    losses, _ = train(build("torch"), recipe, "default", "blocks")
    assert not torch.equal(losses, ref_losses)


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_checkpointing_lowers_peak_memory(recipe_name, patched):
    skip_unless_supported(recipe_name)
    recipe = recipe_for(recipe_name)
    _, plain = train(build("none"), recipe, "default")
    FGS.reset()
    torch._dynamo.reset()
    _, checkpointed = train(build("te"), recipe, "default")
    assert checkpointed < plain, (checkpointed, plain)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_checkpointed_training_under_cuda_graphs(recipe_name, patched, eager_rounding):
    """reduce-overhead with checkpointed layers: no cudagraph skip, losses bit-identical to the
    same checkpointed model compiled in default mode."""
    skip_unless_supported(recipe_name)
    recipe = recipe_for(recipe_name)
    default_losses, _ = train(build("te"), recipe, "default")
    FGS.reset()
    torch._dynamo.reset()
    counters.clear()
    losses, _ = train(build("te"), recipe, "reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert torch.equal(losses, default_losses), (losses - default_losses).abs().max()
