"""The norm-family ops (te_compile::norm_*, layernorm_linear_*) checked without a GPU
(tests/meta_opcheck.py: call, fake kernel against the schema, autograd, symbolic trace). The real
kernels are opchecked in tests/gpu/test_norm_gpu.py."""

from __future__ import annotations

import norm_cases
import pytest
import torch
from meta_opcheck import opcheck_on_meta
from test_opcheck_fake import RECIPES

import te_compile.ops  # noqa: F401  (registers the ops)
from te_compile.recipes import for_linear

NORMS = ["LayerNorm", "RMSNorm"]


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_ops_opcheck_on_fake(normalization, dtype, fake_cuda):
    args = norm_cases.norm_fwd_args(normalization, dtype)
    opcheck_on_meta(torch.ops.te_compile.norm_fwd.default, (), args)
    opcheck_on_meta(torch.ops.te_compile.norm_bwd.default, (), norm_cases.norm_bwd_args(args))


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_ln_out", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
def test_layernorm_linear_ops_opcheck_on_fake(
    name, normalization, bias, return_ln_out, fake_gpu, fake_cuda
):
    make, generation = RECIPES[name]
    fake_gpu(generation)
    config = for_linear(make(), fp8_transpose=True).key
    args = norm_cases.lnl_fwd_args(config, normalization, bias, name == "delayed", return_ln_out)
    opcheck_on_meta(torch.ops.te_compile.layernorm_linear_fwd.default, (), args)
    opcheck_on_meta(
        torch.ops.te_compile.layernorm_linear_bwd.default, (), norm_cases.lnl_bwd_args(args)
    )


@pytest.mark.parametrize("name", ["current", "block", "delayed"])
def test_layernorm_linear_cached_weight_opcheck_on_fake(name, fake_gpu, fake_cuda):
    make, generation = RECIPES[name]
    fake_gpu(generation)
    config = for_linear(make(), fp8_transpose=True).key
    args = norm_cases.lnl_fwd_args(config, "LayerNorm", True, name == "delayed", cached_weight=True)
    opcheck_on_meta(torch.ops.te_compile.layernorm_linear_fwd.default, (), args)
    opcheck_on_meta(
        torch.ops.te_compile.layernorm_linear_bwd.default, (), norm_cases.lnl_bwd_args(args)
    )
