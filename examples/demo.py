"""te-compile demo: te.autocast inside torch.compile(fullgraph=True), for every TE recipe.

On a GPU: each recipe the GPU supports is compiled with inductor, and the state TE modules read
inside the compiled region (FP8 on, recipe) is checked against eager TE; a te.Linear then runs
eagerly between two compiled regions. Without a GPU: the same functions are traced on the CPU as
if on Hopper and on Blackwell, and a trace report is printed (graphs, graph breaks, state seen).
"""

from __future__ import annotations

import re
import time
import warnings

import torch

warnings.filterwarnings("ignore")

import transformer_engine.pytorch as te  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402  (demo only: counts graph breaks)
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS  # noqa: E402

import te_compile  # noqa: E402
from te_compile.testing import RecordingBackend, pretend_gpu  # noqa: E402

RECIPES = {
    "DelayedScaling": (R.DelayedScaling, "hopper"),
    "Float8CurrentScaling": (R.Float8CurrentScaling, "hopper"),
    "Float8BlockScaling": (R.Float8BlockScaling, "hopper"),
    "MXFP8BlockScaling": (R.MXFP8BlockScaling, "blackwell"),
    "NVFP4BlockScaling": (R.NVFP4BlockScaling, "blackwell"),
    "default (recipe=None)": (lambda: None, "hopper"),
    "default on Blackwell": (lambda: None, "blackwell"),
}
NAMES = list(RECIPES)


def seen_state() -> int:
    """What a TE module sees: 1000 if FP8 is on, plus the index of the recipe class."""
    recipe = FGS.get_fp8_recipe()
    index = next(i for i, cls in enumerate(RECIPES.values()) if type(recipe) is cls[0])
    return 1000 * int(FGS.is_fp8_enabled()) + index


def step_fn(recipe):
    def step(x):
        with te.autocast(recipe=recipe):
            return x * 2 + seen_state()

    return step


def describe(code: int) -> str:
    return f"fp8={'on' if code >= 1000 else 'off'}, recipe={NAMES[code % 1000]}"


def trace_report() -> None:
    te_compile.patch()
    print("No GPU: tracing on the CPU as if on the named GPU (TE's support answers pinned).\n")
    print(f"{'recipe':<24}{'as if on':<11}{'graphs':>7}{'breaks':>8}  state inside the trace")
    for name, (make, generation) in RECIPES.items():
        torch._dynamo.reset()
        counters.clear()
        backend = RecordingBackend()
        with pretend_gpu(generation):
            out = torch.compile(step_fn(make()), backend=backend, fullgraph=True)(torch.zeros(1))
        breaks = sum(counters["graph_break"].values())
        code = int(out.item())
        print(f"{name:<24}{generation:<11}{len(backend.graphs):>7}{breaks:>8}  {describe(code)}")


def gpu_report() -> None:
    te_compile.patch()
    print(te_compile.doctor(), "\n")
    print(
        f"{'recipe':<24}{'graphs':>7}  {'state inside compiled fn':<40}{'= eager':>8}{'linear = eager':>16}"
    )
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    for name, (make, _) in RECIPES.items():
        if name == "default on Blackwell":
            continue  # a CPU-trace row: on a real GPU the default is that GPU's
        recipe = make()
        torch._dynamo.reset()
        backend = RecordingBackend()
        step = step_fn(recipe)
        try:
            compiled = torch.compile(step, backend=backend, fullgraph=True)
            got = int(compiled(torch.zeros(1, device="cuda")).item())
        except RuntimeError as e:
            reason = re.search(r"cannot run on this GPU: ([^'\n]*)", str(e))
            print(f"{name:<24}{'-':>7}  not supported here: {reason[1] if reason else e}")
            continue
        want = int(step(torch.zeros(1, device="cuda")).item())
        same_linear = linear_between_compiled(recipe, x)
        print(
            f"{name:<24}{len(backend.graphs):>7}  {describe(got):<40}{str(got == want):>8}{str(same_linear):>16}"
        )


def linear_between_compiled(recipe, x) -> bool:
    """A te.Linear run eagerly between two inductor-compiled regions equals all-eager."""

    def run(pre, post):
        torch.manual_seed(0)
        linear = te.Linear(256, 256, params_dtype=torch.bfloat16)
        FGS.reset()
        with te.autocast(recipe=recipe):
            return post(linear(pre(x)))

    def pre(t):
        return t * 3

    def post(t):
        return t.float() * 0.5

    eager = run(pre, post)
    compiled = run(torch.compile(pre, fullgraph=True), torch.compile(post, fullgraph=True))
    return torch.equal(eager, compiled)


if __name__ == "__main__":
    start = time.time()
    if torch.cuda.is_available():
        gpu_report()
    else:
        trace_report()
    print(f"\ndone in {time.time() - start:.1f} s")
