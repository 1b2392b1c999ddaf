"""What dynamo's guards cost a compiled step on every call, measured without a GPU.

    python bench/guard_cost.py [--hidden 1024] [--layers 4] [--calls 500] [--gpu] [--dump DIR]

Each stack of bench/stacks.py is traced under te_compile.simulate_gpu("hopper") (meta tensors,
`backend="eager"`), and the compiled frame's guard check is timed on its own: the median of 5
runs of `--calls` checks, in microseconds, on this machine's CPU, and the median of single
checks each after writing 64 MiB (caches cold, as between two training steps: the tree's
thousands of nodes then cost cache misses, 3-6x the warm time). Under CUDA graphs a
small-shape TE step is CPU-bound and its guards are part of that (docs/perf/history.md,
session 16), so this is the CPU-side number to watch when a compile path reads more module
attributes. Rows: TE's TransformerLayer stack per recipe, the same with torch's
`skip_guard_on_all_nn_modules_unsafe` filter (what module-attribute guards cost at most), and
the plain PyTorch block. Counts are guard lines, NO_HASATTR among them (tests/cpu/test_guards.py).
`--gpu` builds the stacks on the machine's GPU instead (the guards a real step checks);
`--dump DIR` writes each guard tree to DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(__file__))

import stacks  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402

import te_compile  # noqa: E402

RECIPES = {"current": R.Float8CurrentScaling, "delayed": R.DelayedScaling, "bf16": None}
ROWS = [  # (stack, recipe, guard filter)
    ("te-transformer", "current", None),
    ("te-transformer", "delayed", None),
    ("te-transformer", "bf16", None),
    ("te-transformer", "current", "skip_guard_on_all_nn_modules_unsafe"),
    ("torch-transformer", "bf16", None),
]


def guard_cost(stack, recipe_name, guard_filter, hidden, layers, calls, real_gpu=False, dump=""):
    """(median us per guard check, guard lines, NO_HASATTR lines) of one compiled forward;
    `real_gpu`: on the machine's GPU instead of under simulate_gpu; `dump`: a folder to write
    the guard tree into."""
    torch._dynamo.reset()
    make_recipe = RECIPES[recipe_name]
    options = {"guard_filter_fn": getattr(torch.compiler, guard_filter)} if guard_filter else None
    with contextlib.nullcontext() if real_gpu else te_compile.simulate_gpu("hopper"):
        if stack.startswith("torch"):  # plain PyTorch modules: built on the default device
            torch.set_default_device("cuda")
        model = stacks.build(stack, hidden, layers)
        torch.set_default_device(None)
        x = torch.randn(512, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        recipe = make_recipe() if make_recipe else None

        def step(x):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return model(x)

        torch.compile(step, backend="eager", fullgraph=True, options=options)(x)
        # Checked inside simulate_gpu: its torch-function mode is part of what the guards check.
        (entry,) = _debug_get_cache_entry_list(step.__code__)
        check = entry.guard_manager.check
        frame_locals = {"x": x, "model": model, "recipe": recipe}  # locals and free variables
        assert check(frame_locals), entry.guard_manager.check_verbose(frame_locals)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                check(frame_locals)
            runs.append((time.perf_counter() - t0) / calls * 1e6)
        cold = []
        evict = bytearray(64 << 20)  # larger than the CPU's caches
        line = bytes(len(evict[::64]))
        for _ in range(min(calls, 100)):
            evict[::64] = line  # one write per cache line
            t0 = time.perf_counter()
            check(frame_locals)
            cold.append((time.perf_counter() - t0) * 1e6)
    tree = str(entry.guard_manager)
    if dump:
        name = f"guards-{stack}-{recipe_name}{'-filtered' if guard_filter else ''}.txt"
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, name), "w") as f:
            f.write(tree)
    lines = tree.splitlines()
    no_hasattr = sum("NO_HASATTR" in s and "_dynamo_dynamic_indices" not in s for s in lines)
    return statistics.median(runs), statistics.median(cold), len(lines), no_hasattr


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--gpu", action="store_true", help="build on this machine's GPU, not simulated")
    p.add_argument("--dump", default="", help="a folder for the guard trees")
    args = p.parse_args()
    stacks.HEAD_DIM = 64
    te_compile.patch()
    where = torch.cuda.get_device_name() if args.gpu else "simulate_gpu"
    print(f"{args.layers} layers, hidden {args.hidden}, torch {torch.__version__}, {where}:")
    print(
        "| stack | recipe | guard filter | us per check | us, caches cold | guard lines | NO_HASATTR |"
    )
    print("|---|---|---|---|---|---|---|")
    for stack, recipe, guard_filter in ROWS:
        us, cold, n, missing = guard_cost(
            stack, recipe, guard_filter, args.hidden, args.layers, args.calls, args.gpu, args.dump
        )
        print(
            f"| {stack} | {recipe} | {guard_filter or '-'} | {us:.1f} | {cold:.1f} | {n} | {missing} |"
        )


if __name__ == "__main__":
    main()
