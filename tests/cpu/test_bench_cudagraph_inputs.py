"""bench/cudagraph_inputs.py on a traced TransformerLayer: under CUDA graphs the compiled
step's graphs copy only the step's input (forward) and the incoming gradient (backward), as a
plain PyTorch block's do. DelayedScaling's state tensors must stay static (registered buffers):
a path that handed them to the graph as plain tensors would add a copy to every replay."""

from __future__ import annotations

import pytest
from conftest import file_module


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_only_the_step_input_and_its_gradient_are_copied(recipe, patched):
    bench = file_module("cudagraph_inputs", "bench/cudagraph_inputs.py")
    graphs = bench.non_static_inputs("te-transformer", recipe, hidden=256, layers=1)
    assert [kind for kind, *_ in graphs] == ["forward", "backward"]
    (_, fwd_n, fwd_static, fwd_copied), (_, bwd_n, bwd_static, bwd_copied) = graphs
    assert fwd_copied == [("primals_1", (512, 1, 256), "bfloat16")]
    assert bwd_copied == [("tangents_1", (512, 1, 256), "bfloat16")]
    assert fwd_static == fwd_n - 1 and bwd_static == bwd_n - 1
    # 12 parameters (a TransformerLayer with bias) and the input; DelayedScaling's state
    # tensors come on top, as static inputs
    assert fwd_n == 13 if recipe == "current" else fwd_n > 13
