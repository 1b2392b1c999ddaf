"""The training checks a graph-path option must pass on the GPU, on and off (`graph_dbias`,
`triton_history_update`): DelayedScaling modules with biases trained compiled with the option
set against eager TE, bit for bit. A test file takes them with

    option, test_a, test_b, test_c = option_training.tests("graph_dbias")

(the fixture `option` sets the option, True unless `value` says otherwise, for each test and
then restores it; pytest collects the three tests).
"""

from __future__ import annotations

import pytest
import test_graph_fp8_layers_gpu as layers
import test_transformer_layer_gpu as layer_tests

import te_compile
from te_compile_testing import graph_fp8


def tests(name: str, value: bool = True) -> tuple:
    @pytest.fixture(name="option")
    def option():
        before = getattr(te_compile.options.current(), name)
        te_compile.configure(**{name: value})
        yield
        te_compile.configure(**{name: before})

    def test_layernorm_mlp_trains_as_eager_te(patched, option):
        """LayerNormMLP with biases (two GEMMs, one backward history), 4 SGD steps against
        eager TE: outputs, gradients, histories and scales bit-identical."""
        want = layers._train_mlp(False, "LayerNorm", True, "delayed", steps=4)
        got = layers._train_mlp(True, "LayerNorm", True, "delayed", steps=4)
        layers._assert_identical(got, want)

    def test_layernorm_linear_trains_as_eager_te(patched, option):
        """LayerNormLinear with a bias on the graph path, 4 steps against eager TE."""
        want = layers._train_ln_linear(False, "LayerNorm", False, True)
        with graph_fp8():
            got = layers._train_ln_linear(True, "LayerNorm", False, True)
        layers._assert_identical(got, want)

    def test_transformer_layer_matches_eager(patched, option, monkeypatch):
        """Two steps of a causal TransformerLayer (three GEMM modules, biases) on the graph path."""
        with graph_fp8():
            layer_tests.check("causal", "delayed", monkeypatch, n=2, lr=0.01)

    return (
        option,
        test_layernorm_mlp_trains_as_eager_te,
        test_layernorm_linear_trains_as_eager_te,
        test_transformer_layer_matches_eager,
    )
