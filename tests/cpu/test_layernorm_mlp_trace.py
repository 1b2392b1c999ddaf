"""te.LayerNormMLP under torch.compile on fake CUDA tensors (no GPU): opcheck of its ops, and
fullgraph traces of the module, forward and joint backward, per recipe and option."""

from __future__ import annotations

import mlp_cases
import pytest
import torch
from transformer_engine.common import recipe as R

import te_compile.ops  # noqa: F401  (registers the ops)
from te_compile.ops import layernorm_mlp  # noqa: F401
from te_compile.recipes import for_linear

RECIPES = {
    "none": (lambda: None, "hopper"),
    "current": (R.Float8CurrentScaling, "hopper"),
    "block": (R.Float8BlockScaling, "hopper"),
    "delayed": (R.DelayedScaling, "hopper"),
    "mxfp8": (R.MXFP8BlockScaling, "blackwell"),
    "nvfp4": (R.NVFP4BlockScaling, "blackwell"),
}


def _config(name):
    make, generation = RECIPES[name]
    return for_linear(make(), fp8_transpose=generation == "hopper").key


OPCHECK_CASES = [
    # (recipe, activation, normalization, bias, return_ln)
    *[(name, "gelu", "LayerNorm", True, False) for name in RECIPES],
    *[(name, "swiglu", "RMSNorm", False, False) for name in RECIPES],
    ("none", "relu", "LayerNorm", True, True),
    ("current", "srelu", "RMSNorm", True, True),
    ("delayed", "clamped_swiglu", "LayerNorm", False, True),
]


@pytest.mark.parametrize("name,act,norm,bias,return_ln", OPCHECK_CASES)
def test_layernorm_mlp_ops_opcheck_on_fake(name, act, norm, bias, return_ln, fake_gpu, fake_cuda):
    fake_gpu(RECIPES[name][1])
    mlp = mlp_cases.mlp_key(act, norm, return_ln, bias_gelu=name == "none" and act == "gelu")
    args = mlp_cases.fwd_args(_config(name), mlp, bias, name == "delayed")
    torch.library.opcheck(torch.ops.te_compile.layernorm_mlp_fwd.default, args)
    torch.library.opcheck(torch.ops.te_compile.layernorm_mlp_bwd.default, mlp_cases.bwd_args(args))
