"""CPU microseconds of te_compile's own Python in one te.Linear op call, on any machine (no GPU):
the op bodies of `linear_fwd` and `linear_bwd` with TE's C++ entry points replaced by stubs
that hand back prebuilt TE storages and GEMM outputs at once. What remains is the per-call
work the ops add around TE's kernels (config decoding, quantizer lookups, storages rebuilt
from saved parts, result packing): a cost every compiled step pays on the CPU, which bounds
the step at the shapes where the GPU waits (docs/performance.md).

    python bench/op_body_cost.py [--recipes block,current] [--rows 2048] [--hidden 2048]

Per-tensor recipes run with `aten_fp8_gemm=False` (their GEMMs would otherwise be aten's CPU
kernel, real work); `bench/op_overhead.py` times the same ops with TE's kernels on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")

RECIPES = ("block", "current")


class StubExtension:
    """transformer_engine_torch's entry points the GEMM ops call, returning at once."""

    def __init__(self, outputs: dict):
        self.outputs, self.made = outputs, {}

    def quantize(self, tensor, quantizer, out=None, noop=None):
        key = (tuple(tensor.shape), quantizer.rowwise_usage, quantizer.columnwise_usage)
        if key not in self.made:
            self.made[key] = _empty_storage(quantizer, tuple(tensor.shape))
        return self.made[key]

    def bgrad_quantize(self, tensor, quantizer):
        return tensor.new_zeros(tensor.shape[-1]), self.quantize(tensor, quantizer)

    def generic_gemm(self, a, transa, b, transb, *rest, **kwargs):
        return [self.outputs[(transa, transb)], None]


def _empty_storage(quantizer, shape):
    """An empty TE storage as `quantizer` would fill it, on the CPU."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
        Float8TensorStorage,
    )

    if isinstance(quantizer, Float8BlockQuantizer):
        return quantizer.make_empty(shape, dtype=torch.bfloat16, device="cpu")
    rowwise, columnwise = quantizer.rowwise_usage, quantizer.columnwise_usage
    return Float8TensorStorage(
        data=torch.empty(shape, dtype=torch.uint8) if rowwise else None,
        data_transpose=torch.empty([shape[-1], *shape[:-1]], dtype=torch.uint8)
        if columnwise
        else None,
        fp8_scale_inv=torch.ones(1),
        fp8_dtype=quantizer.dtype,
    )


def _per_call_us(fn, calls: int, rounds: int = 15) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def measure(recipe_name: str, rows: int, hidden: int, calls: int) -> dict:
    import transformer_engine.pytorch  # noqa: F401  (loads TE's extension)
    from transformer_engine.common import recipe as R

    import te_compile
    from te_compile.kernels import extension
    from te_compile.ops import linear as ops
    from te_compile.recipes import for_linear
    from te_compile.spec import GemmGrads

    recipe = {"block": R.Float8BlockScaling(), "current": R.Float8CurrentScaling()}[recipe_name]
    config = for_linear(recipe, fp8_transpose=True).key
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    w = torch.randn(hidden, hidden, dtype=torch.bfloat16)
    outputs = {
        layout: torch.empty(n, hidden, dtype=torch.bfloat16)
        for layout, n in (((True, False), rows), ((False, False), rows), ((False, True), hidden))
    }
    saved = (extension.tex, extension._workspace, te_compile.configure())
    stub = StubExtension(outputs)  # one: its storages are made once, on the first call
    extension.tex = lambda: stub
    extension._workspace = lambda device_index: torch.empty(1)
    te_compile.configure(aten_fp8_gemm=False)
    try:
        args = (x, w, None, [], [], None, config, torch.bfloat16, True, True, False, "")
        parts = ops.linear_fwd.impl(*args)[1:]
        grad = torch.randn(rows, hidden, dtype=torch.bfloat16)
        grads = GemmGrads(False, True, True, False, len(parts) // 2).key
        bwd_args = (grad, None, None, None, parts, [], None, config, grads, torch.bfloat16)
        return {
            "linear_fwd": _per_call_us(lambda: ops.linear_fwd.impl(*args), calls),
            "linear_bwd": _per_call_us(lambda: ops.linear_bwd.impl(*bwd_args, hidden, ""), calls),
        }
    finally:
        extension.tex, extension._workspace = saved[0], saved[1]
        te_compile.configure(aten_fp8_gemm=saved[2].aten_fp8_gemm)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--calls", type=int, default=200, help="calls per timed round")
    a = p.parse_args()
    rows = [(r, measure(r, a.rows, a.hidden, a.calls)) for r in a.recipes.split(",")]
    print(f"te.Linear {a.hidden}x{a.hidden}, {a.rows} rows; CPU us per op call, TE stubbed\n")
    print("| recipe | linear_fwd | linear_bwd |\n|---|---|---|")
    for recipe, us in rows:
        print(f"| {recipe} | {us['linear_fwd']:.1f} | {us['linear_bwd']:.1f} |")


if __name__ == "__main__":
    main()
