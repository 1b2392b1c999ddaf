"""The graph path's Triton kernels keep names that inductor's static launcher can find.

Triton saves a kernel's cubin under its name cut to 150 characters (triton/compiler/compiler.py,
`src.name[:150]`); inductor looks for the whole name, and a kernel it does not find goes
through Triton's Python launcher, which costs more CPU per launch in default mode. Inductor
names a fused kernel after the aten operations in it, so the quantization arithmetic is written
with few distinct operations (graph_fp8/quantize.py). Session 46's H200 log showed the bypass
("Cubin path not found") for the names this test measured at 167-178 characters before.
Checked on one TransformerLayer step per per-tensor recipe (simulated Hopper, nothing runs).
"""

from __future__ import annotations

import os
import sys

import pytest

from te_compile_testing import graph_fp8

TRITON_NAME_CUT = 150


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_transformer_layer_kernel_names_fit_the_cubin_name(recipe, patched):
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import kernel_count

    with graph_fp8(None):  # te_compile's default (CPU traces pin False): the graph path
        sources = kernel_count.generated_sources(recipe, 1024, 512)
    launched = [name for source in sources for name in kernel_count.launches(source)]
    assert len(launched) > 30  # the forward's and backward's quantization kernels were seen
    assert any("amax" in name for name in launched)
    too_long = sorted({name for name in launched if len(name) > TRITON_NAME_CUT}, key=len)
    assert not too_long, [f"{len(name)}: {name}" for name in too_long]
