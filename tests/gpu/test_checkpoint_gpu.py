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
as a difference (checked too). Peak memory, at a larger batch and sequence, with each layer
compiled on its own: the checkpointed model's step peak well below the plain model's and within
2% of eager TE's checkpointed step; compiled whole, it holds under a quarter of the plain
model's activations between forward and backward.

Run: `python -m pytest tests/gpu/test_checkpoint_gpu.py -m gpu`.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import example_models, recipe_for, skip_unless_supported
from torch._dynamo.utils import counters
from transformer_engine.pytorch import quantization as q

import te_compile

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
    te_compile.flush_delayed_updates()  # what compiled modules left to the exit
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


# Peak memory at a shape where activations matter: at BATCH x SEQ the model's 3.3 M parameters,
# their gradients and AdamW's state dwarf its activations (about 10 MiB), and the two models'
# step peaks differed by 0.25 MiB either way (session 22, H100): the old test passed or failed
# on inductor's buffer choices. At this shape (H100, current scaling, MiB above the step's start;
# bench/step_memory.py): eager TE 397 plain, 234 checkpointed; each layer compiled on its own 384
# and 233; the whole step compiled 388 and 392, because torch 2.11's partitioner puts the whole
# model's recompute at the start of the compiled backward (docs/training.md).
MEMORY_BATCH, MEMORY_SEQ = 16, 512


def memory_profile(checkpoint: str, recipe, where: str) -> tuple[int, int]:
    """(bytes alive between forward and backward, peak bytes of the whole step), both above
    what is allocated before the step (weights, optimizer state), at the third AdamW step;
    `where`: "blocks" (each layer compiled), "whole" (the step compiled) or "eager"."""
    torch.manual_seed(0)
    config = M.LlamaConfig(max_seq_len=MEMORY_SEQ, num_layers=LAYERS, checkpoint=checkpoint)
    model = M.Llama(config).cuda()
    step = M.train_step(model, recipe)
    if where == "whole":
        step = torch.compile(step, fullgraph=True)
    elif where == "blocks":
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for tokens, targets in M.synthetic_batches(256, MEMORY_BATCH, MEMORY_SEQ, 3, seed=0):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = step(tokens, targets)
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    FGS.reset()
    torch._dynamo.reset()
    return held, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_checkpointing_lowers_peak_memory(recipe_name, patched):
    """Each checkpointed layer compiled on its own (the order docs/training.md gives): the
    step's peak below the same layers compiled without checkpointing, and within 2% of eager
    TE's te.distributed.checkpoint; the whole step compiled: (almost) nothing alive between
    forward and backward."""
    skip_unless_supported(recipe_name)
    recipe = recipe_for(recipe_name)
    plain_held, plain_peak = memory_profile("none", recipe, "blocks")
    held, peak = memory_profile("te", recipe, "blocks")
    _, eager_peak = memory_profile("te", recipe, "eager")
    whole_plain_held, _ = memory_profile("none", recipe, "whole")
    whole_held, _ = memory_profile("te", recipe, "whole")
    mib = {
        name: round(v / 2**20, 2)
        for name, v in dict(
            plain_held=plain_held,
            held=held,
            plain_peak=plain_peak,
            peak=peak,
            eager_peak=eager_peak,
            whole_plain_held=whole_plain_held,
            whole_held=whole_held,
        ).items()
    }
    assert held < plain_held / 4, mib
    assert peak < 0.75 * plain_peak, mib
    assert peak <= 1.02 * eager_peak, mib
    assert whole_held < whole_plain_held / 4, mib


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
