"""The example GPT and Llama-style models (examples/models.py) traced without a GPU: the
training step a loop compiles (forward, cross-entropy loss, te.autocast inside) under
torch.compile(fullgraph=True), forward + AOTAutograd backward, per Hopper recipe, on the meta
tensors of te_compile.simulate_gpu("hopper").

Each case checks: one forward and one backward graph (fullgraph: a graph break raises), a
second step reuses them (no recompile), every TE GEMM op in the forward graph carries the
recipe's QuantConfig (FP8 is in the graph, not bf16), and the op families of a
TransformerLayer (attention included) appear forward and backward."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import example_models
from transformer_engine.common import recipe as R

import te_compile
from te_compile_testing import JointRecorder, te_op_nodes

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing"),
    # the loss's backward on meta tensors (AOTAutograd's trace): torch warns, nothing runs
    pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered:UserWarning"),
]


M = example_models()
RECIPES = {
    "none": lambda: None,
    "current": R.Float8CurrentScaling,
    "block": R.Float8BlockScaling,
    "delayed": R.DelayedScaling,
}
BATCH, SEQ = 2, 64
MODELS = {
    "gpt": lambda: M.GPT(M.GPTConfig(max_seq_len=SEQ)),
    "gpt-rotary-untied-rmsnorm": lambda: M.GPT(
        M.GPTConfig(
            max_seq_len=SEQ, positions="rotary", tie_embeddings=False, normalization="RMSNorm"
        )
    ),
    "gpt-dropout": lambda: M.GPT(
        M.GPTConfig(max_seq_len=SEQ, hidden_dropout=0.1, attention_dropout=0.1)
    ),
    "llama": lambda: M.Llama(M.LlamaConfig(max_seq_len=SEQ)),
}
# Every recipe for the two models of the issue; the GPT's variants under one FP8 recipe.
CASES = [
    *[("gpt", r) for r in RECIPES],
    *[("llama", r) for r in RECIPES],
    ("gpt-rotary-untied-rmsnorm", "current"),
    ("gpt-dropout", "delayed"),
]
GEMM_OPS = ("linear_fwd", "layernorm_linear_fwd", "layernorm_mlp_fwd")


def quant_kinds(node) -> set[str]:
    args = [*node.args, *node.kwargs.values()]
    return {a.split(";")[0] for a in args if isinstance(a, str) and a.startswith("kind=")}


def trace_training(model_name: str, recipe_name: str, steps: int = 2) -> JointRecorder:
    recorder = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        torch.manual_seed(0)
        model = MODELS[model_name]()
        vocab = model.config.vocab_size
        step = torch.compile(
            M.train_step(model, RECIPES[recipe_name]()), backend=recorder.backend, fullgraph=True
        )
        for _ in range(steps):
            tokens = torch.randint(vocab, (BATCH, SEQ), device="cuda")
            targets = torch.randint(vocab, (BATCH, SEQ), device="cuda")
            loss = step(tokens, targets)
            assert loss.shape == () and loss.dtype == torch.float32
            loss.backward()
            for p in model.parameters():
                assert p.grad is not None and p.grad.shape == p.shape, "a parameter has no grad"
                p.grad = None
    return recorder


@pytest.mark.parametrize("model_name,recipe_name", CASES)
def test_training_step_traces_fullgraph(model_name, recipe_name, patched):
    rec = trace_training(model_name, recipe_name)
    assert (len(rec.fw), len(rec.bw)) == (1, 1), "expected 1 forward + 1 backward graph"
    fw, bw = te_op_nodes(rec.fw), te_op_nodes(rec.bw)
    fw_names, bw_names = {n for n, _ in fw}, {n for n, _ in bw}
    # TransformerLayer: LayerNormLinear (QKV), Linear (proj), LayerNormMLP; final TE norm.
    assert {"layernorm_linear_fwd", "linear_fwd", "layernorm_mlp_fwd"} <= fw_names, fw_names
    assert {"layernorm_linear_bwd", "linear_bwd", "layernorm_mlp_bwd"} <= bw_names, bw_names
    assert "norm_fwd" in fw_names and "norm_bwd" in bw_names
    assert any("attn" in n or "attention" in n for n in fw_names), f"no attention op: {fw_names}"
    assert any("attn" in n or "attention" in n for n in bw_names), f"no attention op: {bw_names}"
    gemms = [node for name, node in fw if name in GEMM_OPS]
    for node in gemms:
        assert quant_kinds(node) == {f"kind={recipe_name}"}, f"{node}: {quant_kinds(node)}"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def test_cli_check_passes_on_the_rotary_untied_gpt():
    """`python -m te_compile check examples/models.py:build_gpt_rotary_untied`, as a user runs
    it: the model and each TE module (te.Linear LM head included), every Hopper recipe."""
    run = _run("-m", "te_compile", "check", "examples/models.py:build_gpt_rotary_untied")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "20 of 20 cases passed" in run.stdout, run.stdout
    assert "fused_rope, fused_attn" in run.stdout, run.stdout


def test_gpt_demo_prints_the_trace_report_without_a_gpu():
    """README's demo, second part, on a CPU: te_compile.check on the GPT and the Llama model."""
    run = _run("examples/gpt_demo.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "16 of 16 cases passed" in run.stdout, run.stdout  # GPT: model + 3 TE modules, x 4
    assert "20 of 20 cases passed" in run.stdout, run.stdout  # Llama: model + 4 TE modules, x 4
    for row in ("layers.1    TransformerLayer  delayed  ok", "lm_head     Linear            block"):
        assert row in run.stdout, run.stdout


def test_models_build_under_simulation():
    """Both models construct as on a GPU, with the TE modules the issue names; rotary tables
    are TE's RotaryPositionEmbedding output, [seq, 1, 1, head_dim] float32."""
    import transformer_engine.pytorch as te

    with te_compile.simulate_gpu("hopper"):
        llama, gpt = MODELS["llama"](), MODELS["gpt-rotary-untied-rmsnorm"]()
    layer = llama.layers[0]
    assert isinstance(layer, te.TransformerLayer)
    assert isinstance(llama.final_norm, te.RMSNorm) and isinstance(llama.lm_head, te.Linear)
    assert llama.rope.shape == (SEQ, 1, 1, 256 // 4) and llama.rope.dtype == torch.float32
    names = {n for n, _ in layer.named_parameters()}
    assert not any("bias" in n for n in names), "Llama layers have no bias"
    assert any("query_weight" in n for n in names), f"fuse_qkv_params=False: {sorted(names)}"
    assert gpt.rope.shape == (SEQ, 1, 1, 256 // 4) and isinstance(gpt.lm_head, te.Linear)
    with te_compile.simulate_gpu("hopper"):
        tied = MODELS["gpt"]()
    assert not hasattr(tied, "lm_head"), "tied head: no LM head module of its own"


def test_synthetic_batches_are_learnable_and_reproducible():
    a = M.synthetic_batches(64, 4, 16, 2, seed=3, device="cpu")
    b = M.synthetic_batches(64, 4, 16, 2, seed=3, device="cpu")
    assert all(
        torch.equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True)
    )
    tokens, targets = a[0]
    assert tokens.shape == targets.shape == (4, 16)
    assert torch.equal(tokens[:, 1:], targets[:, :-1]), "targets are the next tokens"
    # Mostly a fixed successor: the most common successor of each token dominates.
    pairs = torch.stack([tokens.flatten(), targets.flatten()], 1)
    agree = sum(
        (pairs[pairs[:, 0] == t][:, 1].mode().values == pairs[pairs[:, 0] == t][:, 1]).sum()
        for t in pairs[:, 0].unique()
    )
    assert agree / len(pairs) > 0.8
