"""GPU: the example GPT and Llama-style models (examples/models.py) train 50 steps compiled with
torch.compile(fullgraph=True), per Hopper recipe, with loss curves inside eager TE's run-to-run
noise, no recompile after the first step, and under mode="reduce-overhead" without a
cudagraph skip.

Noise: both models train with hidden and attention dropout 0.1 (the Llama tutorial's layers
use 0; here dropout gives eager training a run-to-run spread to measure). Eager TE trains from
the same initial weights on the same batches with dropout seed 0 (the reference) and seeds
1..3 (the noise runs): noise = the largest RMS over the 50 steps of (seed k - seed 0). The
compiled run (seed 0) draws at least its hidden-dropout masks in inductor's kernels, not in
eager's, so its curve is one more sample of that spread: its RMS distance to the reference must be within
1.5x the noise. For scale: on this task the loss falls from ln(256) = 5.5 to about 1.7 in 50
steps while dropout seeds move it by about 0.1 RMS (a plain-PyTorch model of the same shape on a
CPU), so a broken gradient or scale shows. FP8 really ran: each eager FP8 curve differs from
the bf16 one, and after compiled DelayedScaling training every TE module's forward scales have
moved from 1 (that each compiled GEMM op gets the recipe's FP8 config is checked on the traced
graphs in tests/cpu/test_models_trace.py). Sizes are small (H=256, 2 layers, S=128, B=4) to
keep the file under ~3 minutes on an H100, compile included.

Run: `python -m pytest tests/gpu/test_models_gpu.py -m gpu` (or `-k models` from tests/).
"""

from __future__ import annotations

import functools

import pytest
import torch
from attention_cases import reset_backend_choice
from conftest import example_models, recipe_for, skip_unless_supported
from torch._dynamo.utils import counters
from transformer_engine.pytorch import quantization as q

from te_compile_testing import InductorRecorder

pytestmark = pytest.mark.gpu

FGS = q.FP8GlobalStateManager
RECIPES = ["none", "current", "block", "delayed"]  # the Hopper ones
STEPS, BATCH, SEQ, LR = 50, 4, 128, 3e-3
DROPOUT = 0.1
NOISE_SEEDS = (1, 2, 3)
NOISE_FACTOR = 1.5


M = example_models()
BUILD = {
    "gpt": lambda: M.GPT(
        M.GPTConfig(max_seq_len=SEQ, hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
    ),
    "llama": lambda: M.Llama(
        M.LlamaConfig(max_seq_len=SEQ, hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
    ),
}
VOCAB = 256  # both configs' default


@functools.cache
def data():
    return M.synthetic_batches(VOCAB, BATCH, SEQ, STEPS, seed=0)


def train(model_name, recipe_name, *, seed=0, mode=None):
    """STEPS AdamW steps from the same initial weights: (losses [STEPS] float32 on the CPU,
    graphs dynamo compiled or None for eager, the trained model). `seed` seeds the dropout draws; `mode`: None
    for eager TE, "default" or "reduce-overhead" for torch.compile(fullgraph=True)."""
    torch._dynamo.reset()
    FGS.reset()
    reset_backend_choice()  # eager TE chooses its attention backend afresh, as the trace does
    torch.manual_seed(0)  # the initial weights
    model = BUILD[model_name]()
    assert model.config.vocab_size == VOCAB
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = M.train_step(model, recipe_for(recipe_name))
    recorder = InductorRecorder()
    graphs_before = counters["stats"]["unique_graphs"]
    if mode == "default":
        step = torch.compile(step, backend=recorder, fullgraph=True)
    elif mode is not None:
        step = torch.compile(step, mode=mode, fullgraph=True)
    torch.manual_seed(1000 + seed)  # the dropout draws
    losses = []
    for tokens, targets in data():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        loss = step(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())  # cudagraph outputs are reused next step
    graphs = None
    if mode == "default":
        graphs = recorder.graphs
    elif mode is not None:
        graphs = counters["stats"]["unique_graphs"] - graphs_before
    return torch.stack(losses).float().cpu(), graphs, model


@functools.cache
def eager(model_name, recipe_name, seed=0):
    return train(model_name, recipe_name, seed=seed)[0]


def rms(a, b) -> float:
    return (a - b).pow(2).mean().sqrt().item()


def noise(model_name, recipe_name) -> float:
    ref = eager(model_name, recipe_name)
    return max(rms(eager(model_name, recipe_name, s), ref) for s in NOISE_SEEDS)


def check_delayed_state(model):
    """DelayedScaling ran in FP8 in the compiled steps: every TE module's forward scales were
    updated from their amax histories (a bf16 run leaves TE's initial scale of 1)."""
    metas = [m.fp8_meta for m in model.modules() if "scaling_fwd" in getattr(m, "fp8_meta", {})]
    assert metas, "no TE module holds DelayedScaling state"
    for meta in metas:
        scale = meta["scaling_fwd"].scale
        assert not torch.equal(scale, torch.ones_like(scale)), "forward scales never updated"


def check_curve(model_name, recipe_name, losses):
    ref = eager(model_name, recipe_name)
    spread, dist = noise(model_name, recipe_name), rms(losses, ref)
    table = "\n".join(
        f"step {t:2d}: compiled {c:.4f} eager {e:.4f}"
        for t, (c, e) in enumerate(zip(losses.tolist(), ref.tolist(), strict=True))
        if t % 10 == 0 or t == STEPS - 1
    )
    print(f"\n{model_name}/{recipe_name}: RMS |compiled - eager| {dist:.4g}, noise {spread:.4g}")
    assert torch.isfinite(losses).all(), f"non-finite loss\n{table}"
    assert spread > 0, "eager runs with different dropout seeds agree: no noise to compare with"
    assert dist <= NOISE_FACTOR * spread, (
        f"compiled curve {dist:.4g} (RMS) from eager's, noise {spread:.4g}\n{table}"
    )
    assert losses[-5:].mean() < 0.7 * losses[0], f"did not learn\n{table}"
    if recipe_name != "none":  # FP8 really ran: not the bf16 curve
        assert not torch.equal(ref, eager(model_name, "none")), "FP8 eager curve equals bf16"


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("model_name", ["gpt", "llama"])
def test_compiled_training_within_eager_noise(model_name, recipe_name, patched):
    skip_unless_supported(recipe_name)
    losses, graphs, model = train(model_name, recipe_name, mode="default")
    assert graphs == 1, f"{graphs} graphs over {STEPS} steps: recompiled after the first"
    check_curve(model_name, recipe_name, losses)
    if recipe_name == "delayed":
        check_delayed_state(model)


@pytest.mark.parametrize("model_name,recipe_name", [("gpt", "delayed"), ("llama", "current")])
def test_reduce_overhead_training_no_cudagraph_skips(model_name, recipe_name, patched):
    skip_unless_supported(recipe_name)
    skips_before = counters["inductor"]["cudagraph_skips"]
    losses, graphs, model = train(model_name, recipe_name, mode="reduce-overhead")
    skips = counters["inductor"]["cudagraph_skips"] - skips_before
    assert skips == 0, "inductor skipped CUDA graphs (run with TORCH_LOGS=cudagraphs for why)"
    assert graphs == 1, f"{graphs} graphs over {STEPS} steps: recompiled after the first"
    check_curve(model_name, recipe_name, losses)
    if recipe_name == "delayed":
        check_delayed_state(model)
