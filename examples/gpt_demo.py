"""te-compile demo, part 2: a small GPT of te.TransformerLayer blocks trained under
torch.compile(fullgraph=True) with FP8.

    python examples/gpt_demo.py [--out DIR] [--steps 50]

On a GPU: the GPT of examples/models.py (2 x te.TransformerLayer, H=256, causal attention,
learned positions, final te.LayerNorm, tied LM head) trains --steps AdamW steps on a synthetic
token stream (a noisy fixed bigram chain), per recipe (DelayedScaling, Float8CurrentScaling):
the training step (forward + loss, te.autocast inside) compiled with fullgraph=True, and a
fresh copy of the same initial weights eagerly. Prints losses (compiled vs eager), median step
times, the first step's seconds (compile), graphs and recompiles; saves gpt-loss-curves.png
with both curves per recipe under --out (default $OUT, else the current folder) when
matplotlib is installed.
Without a GPU: te_compile.check traces the GPT and the Llama-style model of examples/models.py
as if on an H100, forward + backward with fullgraph=True per Hopper recipe, for each model and
each of its TE modules.
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

import transformer_engine  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS  # noqa: E402

import te_compile  # noqa: E402
from te_compile_testing import InductorRecorder  # noqa: E402  (counts the graphs compiled)


def _load_models():
    path = Path(__file__).resolve().with_name("models.py")
    spec = importlib.util.spec_from_file_location("te_example_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


M = _load_models()
RECIPES = {"DelayedScaling": R.DelayedScaling, "Float8CurrentScaling": R.Float8CurrentScaling}
BATCH, SEQ, LR = 4, 128, 3e-3


# ---- without a GPU: te_compile.check -----------------------------------------------------------


def trace_report() -> None:
    te_compile.patch()
    print("No GPU: te_compile.check traces the example models as if on an H100 (nothing runs).")
    for name, factory in (("GPT", M.build_gpt), ("Llama-style", M.build_llama)):
        with te_compile.simulate_gpu("hopper"):
            model, inputs = factory()
        c = model.config
        print(f"\n{name}: {c.num_layers} x te.TransformerLayer(H={c.hidden_size}), vocab ", end="")
        print(f"{c.vocab_size}, tokens {tuple(inputs[0].shape)}")
        report = te_compile.check(model, *inputs, recipes=["none", "current", "block", "delayed"])
        print(report.table())


# ---- on a GPU: train compiled and eager --------------------------------------------------------


def train(recipe, compiled: bool, data):
    """AdamW steps on a fresh GPT (same initial weights every call): (losses, median step ms of
    steps 2.., first step s, graphs compiled or None)."""
    torch._dynamo.reset()
    FGS.reset()
    torch.manual_seed(0)
    model = M.GPT(M.GPTConfig(max_seq_len=SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = M.train_step(model, recipe)
    backend = InductorRecorder()
    if compiled:
        step = torch.compile(step, backend=backend, fullgraph=True)
    losses, times = M.timed_steps(step, opt, data)
    median_ms = 1e3 * statistics.median(times[1:])
    return (
        torch.stack(losses).float().cpu(),
        median_ms,
        times[0],
        backend.graphs if compiled else None,
    )


def gpu_report(steps: int, folder: str) -> None:
    te_compile.patch()
    c = M.GPTConfig(max_seq_len=SEQ)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, ", end="")
    print(f"TE {transformer_engine.__version__}")
    print(
        f"GPT: {c.num_layers} x te.TransformerLayer(H={c.hidden_size}, heads={c.num_heads}), ",
        end="",
    )
    print(f"vocab {c.vocab_size}, batch {BATCH} x {SEQ} tokens, AdamW lr {LR}, {steps} steps;")
    print("compiled: forward + loss with inductor, fullgraph=True, te.autocast inside.\n")
    print(
        f"{'recipe':<22}{'graphs':>7}{'recompiles':>11}{'loss compiled':>15}{'loss eager':>12}"
        f"{'max |diff|':>12}{'ms compiled':>13}{'ms eager':>10}{'1st step s':>12}"
    )
    data = M.synthetic_batches(c.vocab_size, BATCH, SEQ, steps, seed=0)
    curves = {}
    for name, make in RECIPES.items():
        side = "compiled"
        try:
            loss_c, ms_c, first_s, graphs = train(make(), True, data)
            side = "eager"
            loss_e, ms_e, _, _ = train(make(), False, data)
        except (RuntimeError, AssertionError) as e:  # TE's support checks assert
            print(f"{name:<22}{side} run raises: {str(e).splitlines()[0][:140]}")
            continue
        curves[name] = (loss_c.tolist(), loss_e.tolist())
        diff = (loss_c - loss_e).abs().max().item()
        print(
            f"{name:<22}{graphs:>7}{graphs - 1:>11}{loss_c[-1].item():>15.4f}"
            f"{loss_e[-1].item():>12.4f}{diff:>12.3g}{ms_c:>13.2f}{ms_e:>10.2f}{first_s:>12.1f}"
        )
    print(
        f"\nloss: the last step's; max |diff|: compiled vs eager over all {steps} steps (inductor fuses\n"
        "the embedding, residual adds and the loss, so last-bit differences appear and grow).\n"
        f"ms: median step (forward, backward, AdamW) of steps 2-{steps}; 1st step s: compile."
    )
    if curves:
        title = f"GPT, 2 x te.TransformerLayer, FP8: {torch.cuda.get_device_name()}"
        path = M.plot_loss_curves(
            curves, os.path.join(folder, "gpt-loss-curves.png"), title, "torch.compile fullgraph"
        )
        if path:
            print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for the PNG")
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    start = time.time()
    if torch.cuda.is_available():
        gpu_report(args.steps, args.out)
    else:
        trace_report()
    print(f"\ndone in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
