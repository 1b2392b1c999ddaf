"""Where a training step's peak memory is, with and without activation checkpointing: the
4-layer Llama-style model of tests/gpu/test_checkpoint_gpu.py, compiled whole in default mode,
per recipe. For the peak-memory test that failed in session 21 (docs/gpu.md): it compares the
two models' peaks over whole steps; this splits a step into forward, backward and optimizer and
prints each phase's peak and what stays allocated after it (MiB), on a CUDA GPU.

    python bench/checkpoint_memory.py [--recipes current,delayed] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import models as M  # noqa: E402
from profile_step import RECIPES  # noqa: E402  (bf16, current, block, delayed)
from transformer_engine.pytorch import quantization as q  # noqa: E402

import te_compile  # noqa: E402

MIB = 1 << 20


def phases(checkpoint: str, recipe_name: str, steps: int) -> dict[str, float]:
    """Per phase of the last of `steps` AdamW steps: its peak and what is allocated after it."""
    torch._dynamo.reset()
    q.FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    model = M.Llama(M.LlamaConfig(max_seq_len=128, num_layers=4, checkpoint=checkpoint)).cuda()
    step = torch.compile(M.train_step(model, RECIPES[recipe_name]()), fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {}

    def run(name: str, fn, *args):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result = fn(*args)
        torch.cuda.synchronize()
        out[f"{name} peak"] = torch.cuda.max_memory_allocated() / MIB
        out[f"after {name}"] = torch.cuda.memory_allocated() / MIB
        return result

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    for tokens, targets in M.synthetic_batches(256, 2, 128, steps, seed=0):
        out["start"] = torch.cuda.memory_allocated() / MIB
        loss = run("forward", step, tokens, targets)
        run("backward", loss.backward)
        run("optimizer", update)
    return out  # the last step's: each step overwrites the one before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="current,delayed")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    te_compile.patch()
    rows = []
    for recipe_name in args.recipes.split(","):
        for checkpoint in ("none", "te"):
            rows.append((recipe_name, checkpoint, phases(checkpoint, recipe_name, args.steps)))
    keys = list(rows[0][2])
    print("| recipe | checkpoint | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for recipe_name, checkpoint, values in rows:
        cells = " | ".join(f"{values[k]:.2f}" for k in keys)
        print(f"| {recipe_name} | {checkpoint} | {cells} |")


if __name__ == "__main__":
    main()
