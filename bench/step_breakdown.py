"""Where the CPU time of one compiled fwd+bwd step goes, measured inside the step itself (no
profiler: a profiler's own per-call cost distorts small calls): every call into TE's C++
extension is timed with perf_counter, and so are the op bodies around them.

    python bench/step_breakdown.py [--hidden 1024] [--tokens 1024] [--layers 4]
                                   [--recipes bf16,current,block,delayed,torch]

(`torch`: the same stack of plain nn.Linear in bf16, for PyTorch's own runtime cost.)

Per recipe: the CPU ms to issue forward and backward (GPU idle at the start of each step), then
per TE entry point its calls per step and microseconds per call, and what is left for our op
bodies' own Python (inside gemm_layer's forward/backward) and for the rest: op dispatch and the
ops' code around gemm_layer, PyTorch's runtime (guards, AOT wrappers, inductor's wrapper,
autograd engine), inductor's own kernels, zero_grad. (Wrapping the ops themselves is not an
option: dynamo guards on `torch.ops.te_compile.<op>`, so a wrapper recompiles the step.)
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import transformer_engine.pytorch as te  # noqa: E402
from profile_step import RECIPES  # noqa: E402
from stacks import build  # noqa: E402
from transformer_engine.pytorch import quantization as q  # noqa: E402

import te_compile  # noqa: E402
from te_compile.kernels import extension as core  # noqa: E402
from te_compile.kernels import gemm_layer  # noqa: E402

TIMES: dict[str, list[float]] = collections.defaultdict(list)


SYNC_BEFORE_TEX = False


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        if SYNC_BEFORE_TEX and name.startswith("tex."):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - t0)

    return wrapper


class TimedTex:
    """transformer_engine_torch with every function call timed."""

    def __init__(self, tex):
        self._tex = tex

    def __getattr__(self, name):
        attr = getattr(self._tex, name)
        return timed(f"tex.{name}", attr) if callable(attr) else attr


def instrument() -> None:
    real = core.tex()
    proxy = TimedTex(real)
    core.tex = lambda: proxy
    gemm_layer.forward = timed("gemm_layer.forward (body)", gemm_layer.forward)
    gemm_layer.backward = timed("gemm_layer.backward (body)", gemm_layer.backward)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--sync-before-tex",
        action="store_true",
        help="synchronize before each TE call (its time with an idle GPU; step times then "
        "mean nothing)",
    )
    args = p.parse_args()
    global SYNC_BEFORE_TEX
    SYNC_BEFORE_TEX = args.sync_before_tex
    te_compile.patch()
    instrument()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.recipes.split(","):
        torch._dynamo.reset()
        q.FP8GlobalStateManager.reset()
        torch.manual_seed(0)
        model = build("torch" if name == "torch" else "te", args.hidden, args.layers)
        x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        x.requires_grad_(True)
        grad = torch.randn_like(x)
        recipe = RECIPES.get(name, lambda: None)()

        def fwd(inp, recipe=recipe, model=model):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return model(inp)

        fn = torch.compile(fwd, fullgraph=True)
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            fn(x).backward(grad)
        TIMES.clear()
        f_ms, b_ms = [], []
        for _ in range(args.steps):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = fn(x)
            t1 = time.perf_counter()
            y.backward(grad)
            t2 = time.perf_counter()
            f_ms.append((t1 - t0) * 1e3)
            b_ms.append((t2 - t1) * 1e3)
        n = args.steps
        fm, bm = statistics.median(f_ms), statistics.median(b_ms)
        print(f"\n{name}: forward {fm:.3f} ms, backward {bm:.3f} ms, step {fm + bm:.3f} ms")
        print("| call | per step | us per call | ms per step |\n|---|---|---|---|")
        tex_ms = 0.0
        for key, ts in sorted(TIMES.items()):
            per_step = sum(ts) / n * 1e3
            if key.startswith("tex."):
                tex_ms += per_step
            print(
                f"| {key} | {len(ts) / n:.0f} | {statistics.median(ts) * 1e6:.1f} | {per_step:.3f} |"
            )
        bodies = sum(sum(TIMES[k]) for k in TIMES if "(body)" in k) / n * 1e3
        print(f"| all tex calls | | | {tex_ms:.3f} |")
        print(f"| op bodies without tex (gemm_layer only) | | | {bodies - tex_ms:.3f} |")
        print(f"| rest of the step | | | {fm + bm - bodies:.3f} |")


if __name__ == "__main__":
    main()
