"""CPU cost of one fwd+bwd training step of a te.Linear stack: issue time and a cProfile.

    python bench/profile_step.py [--hidden 1024] [--tokens 1024] [--layers 4]
                                 [--recipes bf16,current,block,delayed] [--out DIR]

Per recipe and mode (eager TE, compiled default mode): the median CPU time to issue one step
with the GPU idle at its start (synchronize, then time the Python call; the GPU work is not
waited for), and a cProfile of 20 steps whose top functions by own time go to
DIR/profile-<recipe>-<mode>.txt (then by cumulative time), and torch.profiler's table of 10
steps by own CPU time to DIR/torchprof-<recipe>-<mode>.txt. A table comes last.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(__file__))

import transformer_engine.pytorch as te  # noqa: E402
from stacks import build  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch import quantization as q  # noqa: E402

import te_compile  # noqa: E402

RECIPES = {
    "bf16": lambda: None,
    "current": R.Float8CurrentScaling,
    "block": R.Float8BlockScaling,
    "delayed": R.DelayedScaling,
}


def make_train_step(model, recipe, compiled: bool, x, grad):
    def fwd(inp):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return model(inp)

    fn = torch.compile(fwd, fullgraph=True) if compiled else fwd

    def step():
        model.zero_grad(set_to_none=True)
        fn(x).backward(grad)

    return step


def issue_ms(step, n: int = 30) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile(step, path: str, n: int = 20) -> None:
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    with open(path, "w") as f:
        f.write(f"{n} steps\n" + buf.getvalue())


def torch_profile(step, path: str, n: int = 10) -> None:
    """torch.profiler's CPU view of `n` steps: which ops and runtime calls (kernel launches,
    allocations) take the issue time, by own CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50)
    with open(path, "w") as f:
        f.write(f"{n} steps\n{table}\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = p.parse_args()
    te_compile.patch()
    rows = []
    for name in args.recipes.split(","):
        for mode in ("eager", "compile"):
            torch._dynamo.reset()
            q.FP8GlobalStateManager.reset()
            torch.manual_seed(0)
            model = build("te", args.hidden, args.layers)
            x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
            x.requires_grad_(True)
            grad = torch.randn_like(x)
            step = make_train_step(model, RECIPES[name](), mode == "compile", x, grad)
            for _ in range(5):
                step()
            ms = issue_ms(step)
            profile(step, os.path.join(args.out, f"profile-{name}-{mode}.txt"))
            torch_profile(step, os.path.join(args.out, f"torchprof-{name}-{mode}.txt"))
            rows.append((name, mode, ms))
            print(f"{name:8} {mode:8} issue {ms:.3f} ms", flush=True)
    print(
        f"\nCPU ms to issue one fwd+bwd step, {args.layers} x (te.Linear {args.hidden}->"
        f"{4 * args.hidden}, GELU, te.Linear), T={args.tokens}, {torch.cuda.get_device_name()}"
    )
    print("| recipe | eager TE | compiled |\n|---|---|---|")
    for name in args.recipes.split(","):
        e, c = (ms for n, m, ms in rows if n == name)
        print(f"| {name} | {e:.3f} | {c:.3f} |")


if __name__ == "__main__":
    main()
