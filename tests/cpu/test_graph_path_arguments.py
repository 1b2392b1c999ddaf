"""A tripwire for the one edit docs/architecture.md's worked example cannot make follow by itself.

Small per-tensor GEMMs take the graph path (graph_fp8/) by default, in place of the GEMM ops:
an option added to a forward op's signature, or a field added to the op configuration
(QuantConfig, MLPSpec, MLPFlags), reaches TE's kernels but would be ignored, silently, for
small GEMMs only. The names below are those the graph path was checked against (it implements
them, or the module's graph-path check sends the call to the op). A new name fails here until
someone makes that choice: refuse it in `modules/linear.graph_path_applies` (te.Linear,
LayerNormLinear) or `modules/layernorm_mlp._graph_path_applies`, or implement it in graph_fp8/
with a GPU test against eager TE; then add it here.
"""

from __future__ import annotations

import dataclasses

import pytest

from te_compile.ops import layernorm_linear, layernorm_mlp, layernorm_mlp_layout, linear
from te_compile.recipes import QuantConfig

_COMMON = ("delayed_state", "main_grad", "config", "save_input", "save_weight", "accumulate")
REVIEWED_OP_ARGUMENTS = {
    linear.linear_fwd: {
        *_COMMON,
        *("inp", "weight", "bias", "weight_cache", "out_dtype", "parallel"),
    },
    layernorm_linear.layernorm_linear_fwd: {
        *_COMMON,
        *("inp", "ln_weight", "ln_bias", "weight", "bias", "weight_cache", "norm"),
        *("return_ln_out", "parallel"),
    },
    layernorm_mlp.layernorm_mlp_fwd: {
        *("inp", "ln_weight", "ln_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"),
        *("delayed_state", "fc1_cache", "fc2_cache", "fc1_main_grad", "fc2_main_grad"),
        *("config", "norm", "mlp", "out_dtype", "flags", "parallel"),
    },
}
# The norm's own configuration (NormSpec) is left out: both paths run it through TE's norm op.
REVIEWED_SPEC_FIELDS = {
    QuantConfig: {
        *("kind", "dtypes", "pow2", "amax_eps", "block_dims", "split_acc", "fp8_transpose"),
        *("rht", "stochastic_rounding", "amax_algo", "margin", "fused_update"),
        *("deferred_update", "amax_group"),
    },
    layernorm_mlp.MLPSpec: {"activation", "params", "bias_gelu", "return_ln"},
    layernorm_mlp_layout.MLPFlags: {
        *("save_norm", "save_fc1_input", "save_fc1_out", "save_fc2_input", "accumulate"),
    },
}


def _assert_reviewed(owner: str, names: set[str], reviewed: set[str]) -> None:
    new, gone = sorted(names - reviewed), sorted(reviewed - names)
    assert not new, (
        f"{owner} has new names {new}: decide what the graph path does with them (this file's "
        "docstring), then list them here"
    )
    assert not gone, f"{owner} no longer has {gone}: drop them here"


@pytest.mark.parametrize("op", list(REVIEWED_OP_ARGUMENTS), ids=lambda o: o.name)
def test_graph_path_was_checked_against_every_op_argument(op):
    _assert_reviewed(op.name, set(op.signature.parameters), REVIEWED_OP_ARGUMENTS[op])


@pytest.mark.parametrize("cls", list(REVIEWED_SPEC_FIELDS), ids=lambda c: c.__name__)
def test_graph_path_was_checked_against_every_config_field(cls):
    fields = {f.name for f in dataclasses.fields(cls)}
    _assert_reviewed(cls.__name__, fields, REVIEWED_SPEC_FIELDS[cls])
