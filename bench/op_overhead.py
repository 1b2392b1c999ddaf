"""CPU microseconds per call of te_compile's linear ops on the GPU: through the dispatcher
(torch.ops, as compiled graphs call them) and as the plain Python function under it, per recipe.

    python bench/op_overhead.py

The difference between the two columns is the custom-op machinery's cost (dispatch, alias
checks); the second column is our op body plus TE's kernels' CPU time.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import linear_cases  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402

import te_compile  # noqa: E402
from te_compile.modules.linear import _quant_config  # noqa: E402
from te_compile.ops import linear as ops  # noqa: E402
from te_compile.recipes import QuantConfig  # noqa: E402

RECIPES = {
    "bf16": None,
    "current": R.Float8CurrentScaling(),
    "block": R.Float8BlockScaling(),
    "delayed": R.DelayedScaling(),
}


def per_call_us(fn, n=400, chunk=20) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n // chunk):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        times.append((time.perf_counter() - t0) / chunk * 1e6)
    return statistics.median(times)


def main() -> None:
    te_compile.patch()
    print(
        "| recipe | linear_fwd via torch.ops | its Python body | linear_bwd via torch.ops "
        "| its Python body |\n|---|---|---|---|---|"
    )
    for name, recipe in RECIPES.items():
        key = (QuantConfig() if recipe is None else _quant_config(recipe)).key
        fwd = linear_cases.fwd_args(key, True, name == "delayed")
        bwd = linear_cases.bwd_args(fwd)
        with torch.no_grad():
            cells = [
                per_call_us(lambda a=fwd: torch.ops.te_compile.linear_fwd.default(*a)),
                per_call_us(lambda a=fwd: ops.linear_fwd.impl(*a)),
                per_call_us(lambda a=bwd: torch.ops.te_compile.linear_bwd.default(*a)),
                per_call_us(lambda a=bwd: ops.linear_bwd.impl(*a)),
            ]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
