"""The graph path's scaled GEMMs get pointers cuBLASLt takes: every scale_inv handed to
`_scaled_mm`, in the forward and (saved) in the backward, starts at a multiple of 512 bytes
into its buffer, and every FP8 operand and bf16 bias at a multiple of 16 bytes (cuBLASLt's
alignment). cuBLASLt refuses a scale 4 bytes into a buffer (CUBLAS_STATUS_NOT_SUPPORTED on the
H100, for DelayedScaling's per-module reciprocals before graph_fp8.delayed.Scales padded them),
which no CPU trace would show without reading inductor's generated code, as this does."""

from __future__ import annotations

import re

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile.tools.check_inductor import InductorRecorder
from te_compile_testing import graph_fp8

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")

ALIGNED = 128  # float32 elements: 512 bytes
_VIEW = re.compile(r"reinterpret_tensor\((\w+), \([^)]*\), \([^)]*\), (\d+)\)")
_GEMM = re.compile(r"extern_kernels\._scaled_mm\((.+?), out_dtype")


def _args(text: str) -> list[str]:
    """Top-level comma-separated arguments of `text`."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def _call_body(source: str) -> str:
    return source[source.index("    def call(self, args):") :]


def _offset(expr: str) -> int:
    """Element offset of a scale argument: a reinterpreted view's, else 0 (a buffer of its own,
    or a graph input)."""
    view = _VIEW.fullmatch(expr)
    return int(view.group(2)) if view else 0


def gemm_offsets(forward: str, backward: str) -> tuple[list[int], list[int], list[int]]:
    """Element offsets of the FP8 operands, the scales and the biases of the graphs'
    `_scaled_mm` calls; a backward argument that is a saved tensor is followed to the forward's
    return value."""
    fwd, bwd = _call_body(forward), _call_body(backward)
    returned = _args(re.search(r"\n        return \((.*), \)\n", fwd).group(1))
    inputs = _args(re.search(r"\n        (.*) = args\n", bwd).group(1))
    saved = [n for n in inputs if not n.startswith("tangents")]
    saved_values = dict(zip(saved, returned[len(returned) - len(saved) :], strict=True))
    operands, scales, biases = [], [], []
    for body, lookup in ((fwd, {}), (bwd, saved_values)):
        for call in _GEMM.finditer(body):
            offsets = [_offset(lookup.get(a, a)) for a in _args(call.group(1))]
            operands += offsets[:2]
            scales += offsets[2:4]
            biases += offsets[4:5]  # the fifth positional argument, where there is a bias
    return operands, scales, biases


def _layer():
    return te.TransformerLayer(
        128,
        512,
        2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        self_attn_mask_type="causal",
    )


def _rms_mlp():
    return te.LayerNormMLP(
        128, 512, bias=False, normalization="RMSNorm", params_dtype=torch.bfloat16
    )


def _linear():
    return te.Linear(128, 256, params_dtype=torch.bfloat16)


# module, input shape, GEMMs forward + backward on the graph path (those with a bias in the
# GEMM's epilogue), forward kwargs
MODULES = {
    "transformer_layer": (_layer, (64, 1, 128), (12, 2), {}),  # proj, FC2: bias added after
    "rmsnorm_mlp_no_bias": (_rms_mlp, (64, 128), (6, 0), {}),
    "linear_3d": (_linear, (16, 4, 128), (3, 1), {}),
}


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("recipe", [R.DelayedScaling, R.Float8CurrentScaling])
def test_scaled_gemm_pointers_are_aligned(recipe, module, patched):
    """A TE module under the default graph_fp8 (its GEMMs all small), compiled by inductor."""
    make, shape, (gemms, with_bias), kwargs = MODULES[module]
    rec = InductorRecorder("hopper")
    with te_compile.simulate_gpu("hopper"), graph_fp8(None), rec.context():
        m = make().cuda()
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step(x):
            with te.autocast(recipe=recipe()):
                return m(x, **kwargs)

        torch.compile(step, backend=rec.backend, fullgraph=True)(x).float().sum().backward()
    forward, backward = rec.sources
    operands, scales, biases = gemm_offsets(forward, backward)
    assert (len(scales), len(biases)) == (2 * gemms, with_bias), (scales, biases)
    assert all(o % ALIGNED == 0 for o in scales), scales
    assert all(o % 16 == 0 for o in operands), operands  # 1-byte elements
    assert all(o % 8 == 0 for o in biases), biases  # bfloat16
    if recipe is R.DelayedScaling:  # the padded layout is what this checks
        assert any(o > 0 for o in scales), scales
