"""Activation checkpointing of TE layers under torch.compile(fullgraph=True), traced without a GPU
(te_compile.simulate_gpu): torch.utils.checkpoint, TE's te.distributed.checkpoint,
te_compile.checkpoint and selective checkpointing, around each of 4 TransformerLayers, the whole
model compiled or each checkpointed block compiled on its own (torchtitan's order: wrap, then
compile), te.autocast inside or outside the compiled code, every Hopper recipe.

What each case checks: 0 graph breaks (fullgraph), the recompute really happens (the GEMM
forward ops appear again in the backward graph), and for DelayedScaling the FP8-aware policy
holds: the scale snapshot the forward quantized with is saved, never recomputed from the scales
the autocast exit updates (the backward graph has no scale_snapshot)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformer_engine.pytorch as te
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformer_engine.common import recipe as R

import te_compile
from te_compile_testing import JointRecorder

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

RECIPES = {
    "none": lambda: None,
    "current": R.Float8CurrentScaling,
    "block": R.Float8BlockScaling,
    "delayed": R.DelayedScaling,
}
H, S, B, LAYERS = 128, 64, 2, 4
GEMM_FWD = ("linear_fwd", "layernorm_linear_fwd", "layernorm_mlp_fwd")


def te_ops(graphs) -> list[str]:
    return [t.split(".")[1] for t in JointRecorder.targets(graphs) if t.startswith("te_compile.")]


def sac_context(policy):
    return functools.partial(create_selective_checkpoint_contexts, policy)


def save_gemms(ctx, op, *args, **kwargs):
    if op in te_compile.gemm_forward_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


WRAPPERS = {
    "torch": lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False),
    "te": lambda f, x: te.distributed.checkpoint(f, x),
    "te_compile": lambda f, x: te_compile.checkpoint(f, x),
    "sac_save_gemms": lambda f, x: torch.utils.checkpoint.checkpoint(
        f,
        x,
        use_reentrant=False,
        context_fn=sac_context(te_compile.checkpoint_policy(save_gemms)),
    ),
}


class Checkpointed(torch.nn.Module):
    def __init__(self, layer, wrap: str):
        super().__init__()
        self.layer, self.wrap = layer, wrap

    def forward(self, x):
        return WRAPPERS[self.wrap](self.layer, x)


def make_layers():
    return [
        te.TransformerLayer(
            H, 4 * H, 4, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0
        ).cuda()
        for _ in range(LAYERS)
    ]


def trace(recipe_name, wrap, *, where="whole", autocast="outside", partition="default", steps=2):
    """Train `steps` steps of 4 checkpointed TransformerLayers; returns the recorder."""
    rec = JointRecorder(partition)
    with te_compile.simulate_gpu("hopper"):
        torch.manual_seed(0)
        blocks = [Checkpointed(layer, wrap) for layer in make_layers()]
        recipe = RECIPES[recipe_name]()
        compile_ = functools.partial(torch.compile, backend=rec.backend, fullgraph=True)

        def body(x):
            for block in blocks:
                x = block(x)
            return x

        def under_autocast(fn):
            def run(x):
                with te.autocast(enabled=recipe is not None, recipe=recipe):
                    return fn(x)

            return run

        if where == "blocks":
            blocks = [compile_(b) for b in blocks]
            step = under_autocast(body)
        elif autocast == "inside":
            step = compile_(under_autocast(body))
        else:
            step = under_autocast(compile_(body))
        for _ in range(steps):
            x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            step(x).float().sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape
    return rec


CASES = [
    *[("te", r, "whole", "outside") for r in RECIPES],
    *[("te", r, "whole", "inside") for r in RECIPES],
    *[("te", r, "blocks", "outside") for r in RECIPES],
    *[
        ("torch", r, w, "outside")
        for r in ("none", "current", "block")
        for w in ("whole", "blocks")
    ],
    ("te_compile", "delayed", "whole", "inside"),
    ("te_compile", "current", "blocks", "outside"),
]


@pytest.mark.parametrize("wrap,recipe_name,where,autocast", CASES)
def test_checkpointed_layers_recompute(wrap, recipe_name, where, autocast, patched, graph_breaks):
    rec = trace(recipe_name, wrap, where=where, autocast=autocast)
    assert graph_breaks() == 0
    expected = 1 if where == "whole" else 1  # blocks: one graph shared by the 4 blocks
    assert (len(rec.fw), len(rec.bw)) == (expected, expected), (len(rec.fw), len(rec.bw))
    fw, bw = te_ops(rec.fw), te_ops(rec.bw)
    recomputed = [op for op in bw if op in GEMM_FWD]
    assert recomputed, f"no GEMM forward recomputed in backward: {bw}"
    if recipe_name == "delayed":
        assert "scale_snapshot" in fw
        assert "scale_snapshot" not in bw, "the forward's scale snapshot must be saved"


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_delayed_snapshot_saved_under_both_partitioners(partition, patched):
    rec = trace("delayed", "te", autocast="inside", partition=partition)
    bw = te_ops(rec.bw)
    assert "scale_snapshot" not in bw and any(op in GEMM_FWD for op in bw), bw


def test_selective_policy_can_save_the_gemm_forwards(patched):
    """te_compile.gemm_forward_ops() in a policy: the GEMMs are not recomputed in backward."""
    rec = trace("current", "sac_save_gemms")
    bw = te_ops(rec.bw)
    assert not any(op in GEMM_FWD for op in bw), bw


def test_plain_torch_checkpoint_recomputes_delayed_with_current_scale(patched):
    """Documented behaviour: plain torch.utils.checkpoint has no FP8-aware policy, so the scale
    snapshot is recomputed in backward (from the scales as they are then)."""
    rec = trace("delayed", "torch", where="blocks")
    assert "scale_snapshot" in te_ops(rec.bw)


def _mlp_model(**kw):
    return te.LayerNormMLP(H, 4 * H, params_dtype=torch.bfloat16, **kw).cuda()


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_layernorm_mlp_checkpoint_option(recipe_name, patched, graph_breaks):
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        mlp = _mlp_model(checkpoint=True)
        recipe = RECIPES[recipe_name]()
        step = torch.compile(mlp, backend=rec.backend, fullgraph=True)
        x = torch.randn(S * B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = step(x)
        out.float().sum().backward()
    assert graph_breaks() == 0
    assert "layernorm_mlp_fwd" in te_ops(rec.bw), "checkpoint=True recomputes the MLP"


def test_layernorm_mlp_checkpoint_refuses_weight_caching(patched):
    with te_compile.simulate_gpu("hopper"):
        mlp = _mlp_model(checkpoint=True)
        step = torch.compile(mlp, backend="eager", fullgraph=True)
        x = torch.randn(S * B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(recipe=R.Float8CurrentScaling()):
            with pytest.raises(Exception, match="checkpoint=True with is_first_microbatch"):
                step(x, is_first_microbatch=True)


def test_checkpoint_core_attention(patched, graph_breaks):
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        layer = te.TransformerLayer(
            H, 4 * H, 4, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.1
        ).cuda()
        step = torch.compile(
            lambda x: layer(x, checkpoint_core_attention=True), backend=rec.backend, fullgraph=True
        )
        x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(recipe=R.DelayedScaling()):
            out = step(x)
        out.float().sum().backward()
    assert graph_breaks() == 0
    # The core attention is recomputed in backward, with the forward's RNG state (its dropout),
    # and nothing else: no GEMM forward in the backward graph. (Without the option the forward
    # calls te_compile::fused_attn_fwd itself and the backward has no RNG replay.)
    assert "run_with_rng_state" in rec.targets(rec.bw), "core attention not recomputed"
    assert "te_compile.fused_attn_fwd.default" not in rec.targets(rec.fw)
    assert not any(op in GEMM_FWD for op in te_ops(rec.bw)), "only the core attention"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"distribute_saved_activations": True}, "distribute_saved_activations"),
        ({"get_rng_state_tracker": object}, "get_rng_state_tracker"),
    ],
)
def test_te_checkpoint_refuses_what_it_cannot_do(kwargs, match, patched):
    with te_compile.simulate_gpu("hopper"):
        layer = make_layers()[0]
        step = torch.compile(
            lambda x: te.distributed.checkpoint(layer, x, **kwargs), backend="eager", fullgraph=True
        )
        x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(recipe=R.Float8CurrentScaling()):
            with pytest.raises(Exception, match=f"te.distributed.checkpoint\\({match}"):
                step(x)


def test_unpatch_restores_te_checkpoint():
    from transformer_engine.pytorch import distributed

    original = distributed.checkpoint
    te_compile.patch()
    try:
        assert distributed.checkpoint is not original and te.checkpoint is distributed.checkpoint
    finally:
        te_compile.unpatch()
    assert distributed.checkpoint is original and te.checkpoint is original


def test_train_llama_example_traces_without_a_gpu():
    """examples/train_llama.py, as a user runs it on a CPU machine: checkpointed blocks compiled
    one by one share one graph (3 = blocks + final norm + LM head), both recipes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [sys.executable, "examples/train_llama.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for recipe in ("DelayedScaling", "Float8CurrentScaling"):
        assert f"{recipe:<22}3 forward + 3 backward graphs" in run.stdout, run.stdout
