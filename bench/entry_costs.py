"""CPU microseconds per call of the building blocks a compiled te.Linear step is made of, on
the GPU, at a shape where kernels are negligible: what TE's C++ entry points cost against
aten's, and what each way of calling them costs.

    python bench/entry_costs.py [TOKENSxINxOUT ...]   (default 64x128x256 1024x1024x4096
                                                        1024x4096x1024)

One table: block, us per call (median of chunks of 20 calls, the GPU idle at each chunk's
start). Used to decide where the op core's per-call work goes (docs/perf/history.md).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from op_overhead import per_call_us  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402

import te_compile  # noqa: E402
from te_compile.kernels import extension as core  # noqa: E402
from te_compile.kernels.aten_gemm import scaled_mm  # noqa: E402
from te_compile.kernels.fp8_operands import _storage_classes, columnwise_count, quantizer  # noqa: E402
from te_compile.modules.linear import _quant_config  # noqa: E402
from te_compile.ops import registry  # noqa: E402
from te_compile.recipes import QuantConfig  # noqa: E402
from te_compile.spec import GemmGrads  # noqa: E402


@functools.cache
def _noop_op():
    def entry_costs_noop(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape)

    noop = registry.op()(entry_costs_noop)
    noop.fake(lambda a: a.x.new_empty(a.x.shape))
    return noop


def main() -> None:
    for shape in sys.argv[1:] or ["64x128x256", "1024x1024x4096", "1024x4096x1024"]:
        table(*(int(n) for n in shape.split("x")))


def table(tokens: int, k: int, n: int) -> None:
    dev = "cuda"
    x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    cfg = _quant_config(R.Float8CurrentScaling())
    q_in = quantizer(cfg, "input", rowwise=True, columnwise=True)
    q_w = quantizer(cfg, "weight", rowwise=True, columnwise=True, weight_shape=(n, k))
    tex = core.tex()
    xq, wq = tex.quantize(x, q_in), tex.quantize(w, q_w)
    F8, _ = _storage_classes()
    fp8_dtype = xq._fp8_dtype

    def light_storage(data, transpose, scale_inv):
        s = object.__new__(F8)
        s._data, s._transpose, s._scale_inv = data, transpose, scale_inv
        s._fp8_dtype, s._quantizer, s._dtype = fp8_dtype, None, torch.bfloat16
        s._transpose_invalid = transpose is None
        return s

    def quantize_into_fresh():
        out = light_storage(
            torch.empty(tokens, k, device=dev, dtype=torch.uint8),
            torch.empty(k, tokens, device=dev, dtype=torch.uint8),
            torch.empty(1, device=dev),
        )
        tex.quantize(x, q_in, out, None)
        return out

    cfg_d = _quant_config(R.DelayedScaling())
    q_d = quantizer(cfg_d, "input", rowwise=True, columnwise=True)
    scale, amax = torch.ones(1, device=dev), torch.zeros(1, device=dev)

    def quantize_delayed():
        with core.with_state(q_d, scale, amax):
            return tex.quantize(x, q_d)

    noop = _noop_op()

    blocks = {
        "aten mm bf16": lambda: torch.mm(x, w.t()),
        "aten empty": lambda: torch.empty(tokens, k, device=dev),
        "aten amax": lambda: x.abs().amax(),
        "Library op, empty body": lambda: noop(x),
        "tex.generic_gemm bf16": lambda: core.gemm(
            w, x, layout="TN", out_dtype=torch.bfloat16, split_accumulator=False, device_index=0
        ),
        # te_compile's default for per-tensor FP8: aten._scaled_mm (kernels/aten_gemm.py)
        "fp8 GEMM, aten _scaled_mm": lambda: scaled_mm(wq, xq, "TN", torch.bfloat16, False, None),
        "fp8 GEMM, tex.generic_gemm": _te_gemm(wq, xq),
        "tex.quantize current, new storage": lambda: tex.quantize(x, q_in),
        "tex.quantize current, into fresh light storage": quantize_into_fresh,
        "tex.bgrad_quantize current": lambda: tex.bgrad_quantize(x, q_in),
        "tex.quantize delayed (bound state), new storage": quantize_delayed,
        "Float8TensorStorage(...) kwargs": lambda: F8(
            data=xq._data,
            data_transpose=xq._transpose,
            fp8_scale_inv=xq._scale_inv,
            fp8_dtype=fp8_dtype,
            fake_dtype=torch.bfloat16,
        ),
        "Float8TensorStorage light (object.__new__)": lambda: light_storage(
            xq._data, xq._transpose, xq._scale_inv
        ),
        "3 x torch.empty (data, transpose, scale_inv)": lambda: (
            torch.empty(tokens, k, device=dev, dtype=torch.uint8),
            torch.empty(k, tokens, device=dev, dtype=torch.uint8),
            torch.empty(1, device=dev),
        ),
    }
    for name, recipe in (("current", R.Float8CurrentScaling()), ("bf16", None)):
        blocks.update(_op_blocks(name, recipe, x, w))
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, x [{tokens}, {k}], w [{n}, {k}]"
    )
    print("| block | us per call |\n|---|---|")
    for name, fn in blocks.items():
        print(f"| {name} | {per_call_us(fn):.1f} |", flush=True)


def _te_gemm(a, b):
    """TE's generic_gemm for two FP8 storages (te_compile.configure(aten_fp8_gemm=False))."""

    def call():
        previous = te_compile.configure().aten_fp8_gemm
        te_compile.configure(aten_fp8_gemm=False)
        try:
            return core.gemm(
                a, b, layout="TN", out_dtype=torch.bfloat16, split_accumulator=False, device_index=0
            )
        finally:
            te_compile.configure(aten_fp8_gemm=previous)

    return call


def _op_blocks(name, recipe, x, w) -> dict:
    """te_compile's linear ops at this shape, through torch.ops as compiled graphs call them."""
    n, k = w.shape
    key = _quant_config(recipe).key if recipe is not None else QuantConfig().key
    bias = torch.zeros(n, device=x.device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    fwd = dict(inp=xg, weight=w, bias=bias, delayed_state=[], weight_cache=[], main_grad=None,
               config=key, out_dtype=torch.bfloat16, save_input=True, save_weight=True,
               accumulate=False, parallel="")  # fmt: skip
    with torch.no_grad():
        out, *parts = te_compile.ops.linear.linear_fwd(**fwd)
    fp8 = recipe is not None
    n_input_parts = columnwise_count(QuantConfig.from_key(key)) if fp8 else 0
    hp = dict(inp=None, weight=None, bias=None) if fp8 else dict(inp=x, weight=w, bias=bias)
    bwd = dict(grad_out=torch.randn_like(out), **hp, parts=parts, bwd_state=[], main_grad=None,
               config=key, out_dtype=torch.bfloat16, in_features=k,
               grads=GemmGrads(True, True, True, False, n_input_parts).key,
               parallel="")  # fmt: skip
    return {
        f"te_compile linear_fwd {name} (grad mode on)": (
            lambda: torch.ops.te_compile.linear_fwd.default(**fwd)
        ),
        f"te_compile linear_bwd {name}": lambda: torch.ops.te_compile.linear_bwd.default(**bwd),
    }


if __name__ == "__main__":
    main()
