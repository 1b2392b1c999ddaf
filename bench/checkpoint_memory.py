"""Where a training step's peak memory is, with and without activation checkpointing: the
4-layer Llama-style model of tests/gpu/test_checkpoint_gpu.py, compiled whole in default mode,
per recipe. For the peak-memory test that failed in session 21 (docs/gpu.md): it compares the
two models' peaks over whole steps; this splits a step into forward, backward and optimizer and
prints each phase's peak and what stays allocated after it (MiB), on a CUDA GPU.

    python bench/checkpoint_memory.py [--recipes current,delayed] [--steps 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def models():
    spec = importlib.util.spec_from_file_location("te_example_models", ROOT / "examples/models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def phases(checkpoint: str, recipe_name: str, steps: int) -> dict[str, float]:
    """Per phase of the last of `steps` AdamW steps: its peak and what is allocated after it."""
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch import quantization as q

    M = models()
    torch._dynamo.reset()
    q.FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    model = M.Llama(M.LlamaConfig(max_seq_len=128, num_layers=4, checkpoint=checkpoint)).cuda()
    recipe = {"current": R.Float8CurrentScaling, "delayed": R.DelayedScaling}[recipe_name]()
    step = torch.compile(M.train_step(model, recipe), fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = M.synthetic_batches(256, 2, 128, steps, seed=0)
    out = {}
    for i, (tokens, targets) in enumerate(batches):
        last = i == steps - 1
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out["start"] = torch.cuda.memory_allocated() / MIB
        loss = step(tokens, targets)
        torch.cuda.synchronize()
        if last:
            out["forward peak"] = torch.cuda.max_memory_allocated() / MIB
            out["after forward"] = torch.cuda.memory_allocated() / MIB
            torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        if last:
            out["backward peak"] = torch.cuda.max_memory_allocated() / MIB
            out["after backward"] = torch.cuda.memory_allocated() / MIB
            torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if last:
            out["optimizer peak"] = torch.cuda.max_memory_allocated() / MIB
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="current,delayed")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    import te_compile

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
