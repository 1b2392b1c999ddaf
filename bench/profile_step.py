"""CPU cost of one fwd+bwd training step of a TE stack: issue time, a cProfile, and where the
GPU time goes.

    python bench/profile_step.py [--stack te] [--hidden 1024] [--tokens 1024] [--layers 4]
                                 [--batch 0] [--recipes bf16,current,block,delayed] [--out DIR]

`--stack`: a TE stack of bench/stacks.py (te, te-lnlinear, te-lnmlp, te-transformer);
`--batch B` > 0 makes the input [tokens, B, hidden] (sequence first), else [tokens, hidden].
`--off aten_fp8_gemm` turns te_compile options off and `--on graph_fp8` turns them on
(te_compile.configure), to measure what each saves.

`--inductor combo_kernels=1,guards=nn_modules` passes inductor options to torch.compile
(`options=`; reduce-overhead then adds `triton.cudagraphs`), `guards=` one of torch.compiler's
guard filters (`nn_modules`: skip_guard_on_all_nn_modules_unsafe, `globals`, `all`): what a
user's compile settings change. `--head-dim` sets the attention heads' width (default 128).

`--modes`: eager, compile (default mode), reduce-overhead (CUDA graphs: the step marks its
start with `torch.compiler.cudagraph_mark_step_begin`); `--autocast outside` compiles the
model alone, te.autocast eager around it (DelayedScaling's updates then run at the eager exit);
`--stack torch-transformer --recipes
bf16` profiles the plain PyTorch block for comparison.

Per recipe and mode: the median CPU time to issue one step
with the GPU idle at its start (synchronize, then time the Python call; the GPU work is not
waited for), and a cProfile of 20 steps whose top functions by own time go to
DIR/profile-<recipe>-<mode>.txt (then by cumulative time), and torch.profiler's table of 10
steps by own CPU time to DIR/torchprof-<recipe>-<mode>.txt, then by GPU time (the kernels).
A table comes last: CPU ms to issue a step, GPU ms of kernels per step, kernel launches per
step.
"""

from __future__ import annotations

import argparse
import collections
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

import stacks  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch import quantization as q  # noqa: E402

import te_compile  # noqa: E402
from te_compile_testing import compile_options  # noqa: E402

RECIPES = {
    "bf16": lambda: None,
    "current": R.Float8CurrentScaling,
    "block": R.Float8BlockScaling,
    "delayed": R.DelayedScaling,
}


def make_train_step(model, recipe, mode: str, x, grad, inductor: str = "", outside=False):
    """`outside`: compile the model alone and enter te.autocast in eager code around it (the
    form of regional compilation, where DelayedScaling's updates run at the eager exit)."""
    graphs = mode == "reduce-overhead"
    inner = model
    if mode != "eager":
        options = compile_options(inductor, graphs)
        graph_mode = "reduce-overhead" if graphs and options is None else None

        def compiled(fn):
            return torch.compile(fn, fullgraph=True, mode=graph_mode, options=options)

        if outside:
            inner = compiled(model)

    def fwd(inp):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return inner(inp)

    fn = fwd if mode == "eager" or outside else compiled(fwd)

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        # The input's gradient too: accumulating into last step's (a CUDA-graph output the
        # next replay overwrites) fails under reduce-overhead.
        x.grad = None
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
    stats.sort_stats("tottime").print_stats(150)
    stats.sort_stats("cumulative").print_stats(150)
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
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=50)
    gpu_table = averages.table(sort_by="self_device_time_total", row_limit=40)
    with open(path, "w") as f:
        f.write(f"{n} steps\n{table}\n\nBy GPU time:\n{gpu_table}\n")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3 / n
    # Calls that make the CPU wait for the GPU (the last is the profile's own synchronize;
    # cudaFree waits for the device, cudaMalloc is the caching allocator growing): a step whose
    # issue time grows with the shape while its launches do not is waiting somewhere.
    waits = collections.Counter(
        e.name
        for e in prof.events()
        if "Synchronize" in e.name or e.name in ("cudaMemcpy", "cudaFree", "cudaMalloc")
    )
    print(f"  CPU-GPU waits in {n} steps: {dict(waits) or 'none'}", flush=True)
    return gpu_ms, len(kernels) / n


def measure(args, name: str, mode: str) -> tuple[float, float, float]:
    """(issue ms, GPU ms, launches) of one recipe and mode, on a fresh model and dynamo; the
    cProfile and torch.profiler tables go to args.out."""
    torch._dynamo.reset()
    q.FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    model = stacks.build(args.stack, args.hidden, args.layers)
    shape = (args.tokens, args.batch) if args.batch else (args.tokens,)
    x = torch.randn(*shape, args.hidden, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    step = make_train_step(
        model, RECIPES[name](), mode, x, grad, args.inductor, args.autocast == "outside"
    )
    for _ in range(5):
        step()
    ms = issue_ms(step)
    profile(step, os.path.join(args.out, f"profile-{name}-{mode}.txt"))
    gpu_ms, launches = torch_profile(step, os.path.join(args.out, f"torchprof-{name}-{mode}.txt"))
    print(f"{name:8} {mode:8} issue {ms:.3f} ms, GPU {gpu_ms:.3f} ms", flush=True)
    return ms, gpu_ms, launches


def cuda_usable() -> bool:
    """False once a failure (a bad launch, a failed capture) has poisoned the CUDA context."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stack", default="te")
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--off", default="", help="te_compile options to turn off, comma-separated")
    p.add_argument("--on", default="", help="te_compile options to turn on, comma-separated")
    p.add_argument("--inductor", default="", help="torch.compile options, e.g. combo_kernels=1")
    p.add_argument("--head-dim", type=int, default=stacks.HEAD_DIM)
    p.add_argument(
        "--autocast",
        choices=("inside", "outside"),
        default="inside",
        help="te.autocast inside the compiled step, or eager around the compiled model",
    )
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stacks.HEAD_DIM = args.head_dim
    te_compile.patch()
    off = [name for name in args.off.split(",") if name]
    on = [name for name in args.on.split(",") if name]
    te_compile.configure(**dict.fromkeys(off, False), **dict.fromkeys(on, True))
    rows = []
    todo = [(name, mode) for name in args.recipes.split(",") for mode in args.modes.split(",")]
    for name, mode in todo:
        try:
            rows.append((name, mode, *measure(args, name, mode)))
        except Exception as e:  # noqa: BLE001 - one failing cell must not lose the others
            rows.append((name, mode, None, None, None))
            print(f"{name:8} {mode:8} failed: {str(e).splitlines()[0][:200]}", flush=True)
            if not cuda_usable():
                print("CUDA is unusable after that failure: stopping", flush=True)
                break
    x_shape = [args.tokens, *([args.batch] if args.batch else []), args.hidden]
    print(
        f"\n{args.layers} x {args.stack}, hidden {args.hidden}, input {x_shape}, "
        f"{torch.cuda.get_device_name()}, options off: {off or 'none'}, on: {on or 'none'}, inductor: {args.inductor or 'defaults'}, autocast {args.autocast}, heads of {args.head_dim}: CPU ms to issue one "
        "fwd+bwd step / GPU ms of its kernels / kernel launches"
    )
    modes = args.modes.split(",")
    print(f"| recipe | {' | '.join(modes)} |\n|---|{'---|' * len(modes)}")
    for name in args.recipes.split(","):
        cells = (
            "failed" if ms is None else f"{ms:.2f} / {g:.2f} / {k:.0f}"
            for r, _, ms, g, k in rows
            if r == name
        )
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
