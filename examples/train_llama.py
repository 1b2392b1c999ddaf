"""A training-stack example: a Llama-style TE model trained the torchtitan way, with te-compile.

    python examples/train_llama.py [--steps 200] [--out DIR]

The stack, in torchtitan's order: each te.TransformerLayer wrapped in TE's FP8-aware activation
checkpointing (te.distributed.checkpoint), then each wrapped block compiled on its own with
torch.compile(fullgraph=True); te.autocast around the model in eager code; AdamW. On a GPU it
trains --steps steps per recipe (DelayedScaling, Float8CurrentScaling) compiled and, from the
same initial weights, eagerly with TE's own code, and prints final losses, the largest loss
difference, median step ms and peak memory, and writes llama-training-loss.png (both curves per
recipe) under --out when matplotlib is installed. Without a GPU it traces two compiled steps
under te_compile.simulate_gpu("hopper") and prints the graphs compiled (nothing runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS  # noqa: E402

import te_compile  # noqa: E402


def _load_models():
    path = Path(__file__).resolve().with_name("models.py")
    spec = importlib.util.spec_from_file_location("te_example_models", path)
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


M = _load_models()
RECIPES = {"DelayedScaling": R.DelayedScaling, "Float8CurrentScaling": R.Float8CurrentScaling}
LAYERS, BATCH, SEQ, LR = 4, 4, 128, 3e-3
ON_GPU = torch.cuda.is_available()  # asked before any simulate_gpu block (which answers True)


def build(compiled: bool, backend="inductor") -> torch.nn.Module:
    """Wrap (te.distributed.checkpoint per layer), then compile each wrapped block; the final
    norm and the LM head are compiled on their own too (TE modules, like the blocks)."""
    torch.manual_seed(0)
    model = M.Llama(M.LlamaConfig(max_seq_len=SEQ, num_layers=LAYERS, checkpoint="te")).cuda()
    if compiled:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)
        model.final_norm = torch.compile(model.final_norm, backend=backend, fullgraph=True)
        model.lm_head = torch.compile(model.lm_head, backend=backend, fullgraph=True)
    return model


def train(recipe, compiled: bool, data, backend="inductor"):
    """(losses, median step ms after the first, peak bytes) of AdamW steps over `data`."""
    torch._dynamo.reset()
    FGS.reset()
    model = build(compiled, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, times = [], []
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    for tokens, targets in data:
        start = time.perf_counter()
        with te.autocast(recipe=recipe):  # in eager code: the update runs at its exit
            logits = model(tokens)
        loss = M.lm_loss(logits, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ON_GPU:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach().float())
    if not ON_GPU:  # traced on meta tensors: there are no values
        return None, 0.0, 0
    peak = torch.cuda.max_memory_allocated()
    return torch.stack(losses).cpu(), 1e3 * statistics.median(times[1:]), peak


def trace_report() -> None:
    from te_compile_testing import JointRecorder

    print("No GPU: two steps traced as if on an H100 (te_compile.simulate_gpu; nothing runs).")
    for name, make in RECIPES.items():
        recorder = JointRecorder()
        with te_compile.simulate_gpu("hopper"):
            data = M.synthetic_batches(256, BATCH, SEQ, 2, device="cuda")
            train(make(), True, data, backend=recorder.backend)
        print(
            f"{name:<22}{len(recorder.fw)} forward + {len(recorder.bw)} backward graphs for "
            f"{LAYERS} checkpointed blocks (one shared), the final norm and the LM head"
        )


def gpu_report(steps: int, folder: str) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{LAYERS} x te.TransformerLayer (Llama-style), batch {BATCH} x {SEQ}, {steps} steps\n")
    print(f"{'recipe':<22}{'loss compiled':>14}{'loss eager':>11}{'max |diff|':>11}", end="")
    print(f"{'ms compiled':>12}{'ms eager':>9}{'GiB compiled':>13}{'GiB eager':>10}")
    data = M.synthetic_batches(256, BATCH, SEQ, steps, seed=0)
    curves = {}
    for name, make in RECIPES.items():
        loss_c, ms_c, mem_c = train(make(), True, data)
        loss_e, ms_e, mem_e = train(make(), False, data)
        curves[name] = (loss_c.tolist(), loss_e.tolist())
        diff = (loss_c - loss_e).abs().max().item()
        print(f"{name:<22}{loss_c[-1]:>14.4f}{loss_e[-1]:>11.4f}{diff:>11.3g}", end="")
        print(f"{ms_c:>12.2f}{ms_e:>9.2f}{mem_c / 2**30:>13.2f}{mem_e / 2**30:>10.2f}")
    title = f"Llama-style, checkpointed, FP8: {torch.cuda.get_device_name()}"
    path = M.plot_loss_curves(
        curves, os.path.join(folder, "llama-training-loss.png"), title, "compiled per block"
    )
    if path:
        print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = parser.parse_args()
    te_compile.patch()
    if ON_GPU:
        gpu_report(args.steps, args.out)
    else:
        trace_report()


if __name__ == "__main__":
    main()
