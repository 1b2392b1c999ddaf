"""Float8CurrentScaling GEMM weights quantized in the graph (graph_fp8/weight.py, the opt-in
`te_compile.configure(graph_weight_quantize=True)`) on the TE-kernel path: the forward ops
receive the weight's FP8 parts ([data, transpose, scale_inv])
computed by aten ops, for te.Linear, LayerNormLinear and both LayerNormMLP GEMMs; other recipes,
and the option turned off, leave weight quantization to the ops (TE's quantize). Bit-for-bit
agreement with TE's quantizer: tests/gpu/test_graph_fp8_gpu.py; in training: the GPU module
tests, which compare with eager TE.
"""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile_testing import JointRecorder, op_args

MODULES = {
    "linear": lambda: te.Linear(64, 32, params_dtype=torch.bfloat16),
    "layernorm_linear": lambda: te.LayerNormLinear(64, 32, params_dtype=torch.bfloat16),
    "layernorm_mlp": lambda: te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16),
}
CACHES = {"linear": ("weight_cache",), "layernorm_linear": ("weight_cache",)}
CACHES["layernorm_mlp"] = ("fc1_cache", "fc2_cache")


@pytest.fixture(autouse=True)
def graph_weights():
    te_compile.configure(graph_weight_quantize=True)
    yield
    te_compile.configure(graph_weight_quantize=False)


def _forward_op(name, recipe, *, grad=True):
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        module = MODULES[name]().cuda()

        def fn(x):
            with te.autocast(recipe=recipe):
                return module(x)

        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            torch.compile(fn, backend=rec.backend, fullgraph=True)(x)
    node = next(n for n in rec.fw[0].graph.nodes if str(n.target).endswith(f"{name}_fwd.default"))
    return rec, op_args(node)


@pytest.mark.parametrize("name", list(MODULES))
def test_current_scaling_weights_arrive_quantized(name, patched, graph_breaks):
    rec, args = _forward_op(name, R.Float8CurrentScaling())
    assert graph_breaks() == 0
    for cache in CACHES[name]:
        parts = [p.meta["val"] for p in args[cache]]
        (out_f, in_f) = parts[0].shape
        assert [(tuple(p.shape), p.dtype) for p in parts] == [
            ((out_f, in_f), torch.uint8),
            ((in_f, out_f), torch.uint8),  # the transposed copy backward's dgrad reads
            ((1,), torch.float32),
        ]
    # the amax reductions and casts are graph operations, before the op
    targets = rec.targets(rec.fw)
    assert any("amax" in t for t in targets) and not any("quantize_weight" in t for t in targets)


def test_no_transpose_without_grad(patched, graph_breaks):
    _, args = _forward_op("linear", R.Float8CurrentScaling(), grad=False)
    assert [p.meta["val"].dtype for p in args["weight_cache"]] == [torch.uint8, torch.float32]


@pytest.mark.parametrize("recipe", [R.DelayedScaling, R.Float8BlockScaling])
def test_other_recipes_quantize_in_the_op(recipe, patched, graph_breaks):
    _, args = _forward_op("linear", recipe())
    assert args["weight_cache"] == []


def test_option_off_quantizes_in_the_op(patched, graph_breaks):
    te_compile.configure(graph_weight_quantize=False)
    _, args = _forward_op("linear", R.Float8CurrentScaling())
    assert args["weight_cache"] == []
