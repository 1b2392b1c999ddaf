"""Where a compiled GPT's training departs from eager TE's: a bisection table, one GPU.

    python bench/gpt_parity.py [--recipes bf16,current,delayed] [--paths default,te]
        [--rounding defaults,eager] [--compile layer,attention,mlp] [--steps 30]

The example GPT (examples/models.py: 2 te.TransformerLayer with biases, LayerNorm, GELU,
causal attention, no dropout) trains `--steps` AdamW steps eager, then again from the same
weights on the same batches with a part of each layer compiled (`fullgraph=True`): the whole
TransformerLayer (`layer`), its attention block (`attention`: self_attention, i.e.
LayerNormLinear QKV, attention, projection) or its MLP (`mlp`: LayerNormMLP), the rest eager
TE. `--paths`: te_compile's default (small per-tensor GEMMs on the graph path) or `te`
(`graph_fp8=False`, TE's kernels). `--rounding eager` compiles (and lets eager TE's own
torch.compile'd fusions compile) with inductor's `emulate_precision_casts=True`. Attention
runs TE's deterministic backward, so eager TE repeats itself bit for bit.

Per row: the first step whose loss differs from eager TE's (- when none), the largest loss
difference, how many parameters differ after the last step, and the first backward whose
gradients differ, with which parameters' (and the largest difference): the module where the
run parts from eager TE. tests/gpu/test_gpt_blocks_gpu.py asserts what holds; this table says
where a run parts. Session 20's tables (H100): docs/perf/gpt_parity/session20-h100.md, read in
docs/graph_fp8.md ("Where a compiled model is not bit-identical").
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import models as M  # noqa: E402
from profile_step import RECIPES  # noqa: E402  (bf16, current, block, delayed)
from transformer_engine.pytorch import quantization as q  # noqa: E402

import te_compile  # noqa: E402

PARTS = {
    "layer": lambda layer: [layer],
    "attention": lambda layer: [layer.self_attention],
    "mlp": lambda layer: [layer.layernorm_mlp],
}


def train(recipe: str, part: str | None, steps: int, seq: int = 128):
    """(losses, parameters after the last step, [{name: gradient}] of every backward) of
    `steps` AdamW steps; `part`: what of each layer is compiled."""
    torch._dynamo.reset()
    q.FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    model = M.GPT(M.GPTConfig(max_seq_len=seq))
    for layer in model.layers if part else ():
        for module in PARTS[part](layer):
            module.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = M.train_step(model, RECIPES[recipe]())
    losses, grads = [], []
    for tokens, targets in M.synthetic_batches(256, 4, seq, steps, seed=0):
        loss = step(tokens, targets)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    params = [p.detach().clone() for p in model.parameters()]
    return torch.stack(losses).cpu(), params, grads


def grads_apart(got: list[dict], want: list[dict]) -> str:
    """The first backward whose gradients differ from eager TE's, and which parameters' (with
    the largest difference of each): where the run parts from eager TE. A loss that differs at
    step k after equal gradients up to k-1 parted in step k's forward."""
    for i, (got_i, want_i) in enumerate(zip(got, want, strict=True)):
        apart = [
            f"{name.removeprefix('layers.')} {(got_i[name].float() - g.float()).abs().max():.1e}"
            for name, g in want_i.items()
            if name not in got_i or not torch.equal(got_i[name], g)
        ]
        if apart:
            return f"step {i}: " + "; ".join(apart)
    return "-"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipes", default="bf16,current,delayed")
    p.add_argument("--paths", default="default,te")
    p.add_argument("--rounding", default="defaults,eager")
    p.add_argument("--compile", default="layer,attention,mlp")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    te_compile.patch()
    split = str.split
    print(f"GPT per-part compile vs eager TE, {args.steps} steps, {torch.cuda.get_device_name()}")
    print(
        "| rounding | recipe | compiled | path | first differing step | max loss diff "
        "| params differing | first gradients apart: step, params (max abs diff) | time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rounding, recipe in itertools.product(split(args.rounding, ","), split(args.recipes, ",")):
        patch = {"emulate_precision_casts": True} if rounding == "eager" else {}
        with inductor_config.patch(patch):
            ref, ref_params, ref_grads = train(recipe, None, args.steps)
            for part, path in itertools.product(split(args.compile, ","), split(args.paths, ",")):
                te_compile.configure(graph_fp8=False if path == "te" else None)
                started = time.perf_counter()
                try:
                    losses, params, grads = train(recipe, part, args.steps)
                except Exception as e:  # noqa: BLE001 (a row says it failed; the rest run)
                    print(
                        f"| {rounding} | {recipe} | {part} | {path} | failed: {e!s:.80} | | | | |"
                    )
                    continue
                finally:
                    te_compile.configure(graph_fp8=None)
                differs = (losses != ref).nonzero()
                first = str(differs[0].item()) if len(differs) else "-"
                params_off = sum(
                    not torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)
                )
                diff = (losses - ref).abs().max().item()
                print(
                    f"| {rounding} | {recipe} | {part} | {path} | {first} | {diff:.4f} "
                    f"| {params_off} of {len(params)} | {grads_apart(grads, ref_grads)} "
                    f"| {time.perf_counter() - started:.0f} s |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
