"""te.Linear fwd+bwd: eager TE vs torch.compile (default and reduce-overhead), per recipe.

    python bench/linear.py [--iters 50] [--shapes 1024x1024,4096x8192]

Prints a table of milliseconds per fwd+bwd step (H = hidden size, T = tokens): the median over 5
runs of `--iters` steps issued back to back (CUDA events around each run), so CPU work overlaps
the GPU as in training. Each cell uses a
fresh module and fresh compile; a cell that fails is numbered and its error printed below.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

warnings.filterwarnings("ignore")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch import quantization as q  # noqa: E402

import te_compile  # noqa: E402

RECIPES = {
    "bf16": lambda: None,
    "delayed": R.DelayedScaling,
    "current": R.Float8CurrentScaling,
    "block": R.Float8BlockScaling,
}
MODES = ("eager", "compile", "reduce-overhead")
ERRORS: list[str] = []
REPEATS = 5


def make_step(model, recipe):
    def step(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return model(x)

    return step


def time_cell(hidden: int, tokens: int, recipe_name: str, mode: str, iters: int) -> str:
    recipe = RECIPES[recipe_name]()
    if recipe is not None:
        ok, why = (
            q.check_fp8_block_scaling_support() if recipe_name == "block" else q.check_fp8_support()
        )
        if not ok:
            return "n/a"
    torch._dynamo.reset()
    q.FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    model = te.Linear(hidden, hidden, params_dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    step = make_step(model, recipe)
    if mode != "eager":
        step = torch.compile(step, fullgraph=True, mode=None if mode == "compile" else mode)

    def train_step():
        if mode == "reduce-overhead":  # a new CUDA-graph step: last step's outputs are done
            torch.compiler.cudagraph_mark_step_begin()
        x.grad = None
        model.zero_grad(set_to_none=True)
        step(x).backward(grad)

    try:
        for _ in range(5):  # compile, warm up, CUDA-graph capture
            train_step()
        torch.cuda.synchronize()
        times = []
        for _ in range(REPEATS):  # each: `iters` steps back to back, as in training
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                train_step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / iters)
    except Exception as e:  # noqa: BLE001  (a failing cell is reported, not fatal)
        ERRORS.append(f"H={hidden} T={tokens} {recipe_name} {mode}: {type(e).__name__}: {e}")
        return f"error {len(ERRORS)}"
    return f"{statistics.median(times):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", default="1024x1024,4096x8192", help="HxT,HxT,...")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/linear.py needs a CUDA GPU")
        return
    te_compile.patch()
    print(
        f"te.Linear fwd+bwd, ms per step (median of {REPEATS} x {args.iters} steps), "
        f"{torch.cuda.get_device_name()}"
    )
    import transformer_engine

    print(f"torch {torch.__version__}, TE {transformer_engine.__version__}")
    header = f"| {'H':>5} | {'T':>5} | {'recipe':<8} | " + " | ".join(f"{m:>16}" for m in MODES)
    print(header)
    print("|" + "|".join("-" * (len(c) + 0) for c in header.split("|")[1:-1]) + "|")
    for shape in args.shapes.split(","):
        hidden, tokens = (int(v) for v in shape.split("x"))
        for name in args.recipes.split(","):
            cells = [time_cell(hidden, tokens, name, mode, args.iters) for mode in MODES]
            print(
                f"| {hidden:>5} | {tokens:>5} | {name:<8} | "
                + " | ".join(f"{c:>16}" for c in cells)
            )


if __name__ == "__main__":
    main()
