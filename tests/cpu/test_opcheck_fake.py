"""torch.library.opcheck for every te_compile op on fake CUDA tensors (no GPU).

On fake inputs the ops dispatch to their fake kernels, so this checks the schemas, the autograd
registration, and that the fake kernels run and trace through AOT dispatch; it cannot compare
fake with real kernels. The real kernels are opchecked in tests/gpu.
"""

from __future__ import annotations

import linear_cases
import pytest
import torch
from transformer_engine.common import recipe as R

import te_compile.ops  # noqa: F401  (registers the ops)
from te_compile.recipes import for_linear

RECIPES = {
    "none": (lambda: None, "hopper"),
    "current": (R.Float8CurrentScaling, "hopper"),
    "block": (R.Float8BlockScaling, "hopper"),
    "delayed": (R.DelayedScaling, "hopper"),
    "mxfp8": (R.MXFP8BlockScaling, "blackwell"),
    "nvfp4": (R.NVFP4BlockScaling, "blackwell"),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_ops_opcheck_on_fake(name, bias, fake_gpu, fake_cuda):
    fake_gpu(RECIPES[name][1])
    make, _ = RECIPES[name]
    args = linear_cases.fwd_args(
        for_linear(make(), fp8_transpose=True).key, bias, name == "delayed"
    )
    torch.library.opcheck(torch.ops.te_compile.linear_fwd.default, args)
    torch.library.opcheck(torch.ops.te_compile.linear_bwd.default, linear_cases.bwd_args(args))


def test_amax_and_scale_update_opcheck_on_fake(fake_cuda):
    histories = [torch.rand(4, 3, device="cuda"), torch.rand(4, 1, device="cuda")]
    scales = [torch.ones(3, device="cuda"), torch.ones(1, device="cuda")]
    torch.library.opcheck(
        torch.ops.te_compile.amax_and_scale_update.default,
        (histories, scales, "max", "e4m3", 0.0, True),
    )


@pytest.mark.parametrize("act", ["", "gelu"])
def test_graph_path_ops_opcheck_on_fake(act, fake_gpu, fake_cuda):
    """The ops graph_fp8 keeps out of inductor (ops/graph_path.py), DelayedScaling's fused
    dbias cast with and without the GELU gradient before it."""
    fake_gpu("hopper")
    grad = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    key = for_linear(R.DelayedScaling(), fp8_transpose=True).key
    act_input = torch.randn_like(grad) if act else None
    scale = torch.ones(1, device="cuda")
    torch.library.opcheck(
        torch.ops.te_compile.delayed_grad_quantize.default, (grad, act_input, scale, key, act)
    )
    torch.library.opcheck(torch.ops.te_compile.bias_grad.default, (grad,))
    data = torch.empty(64, 32, device="cuda", dtype=torch.float8_e4m3fn)
    torch.library.opcheck(torch.ops.te_compile.fp8_transpose.default, (data,))
    other, si = torch.empty(48, 32, device="cuda", dtype=torch.float8_e4m3fn), scale
    for transpose_b in (True, False):
        args = (data, si, other, si, None, torch.bfloat16, True, transpose_b)
        torch.library.opcheck(torch.ops.te_compile.scaled_mm_transposing.default, args)
        # called directly too: opcheck on these fake inputs also passed a call missing an
        # argument, which a direct call refuses
        y, copy = torch.ops.te_compile.scaled_mm_transposing(*args)
        assert (y.shape, y.dtype) == ((64, 48), torch.bfloat16)
        assert copy.shape == ((32, 48) if transpose_b else (32, 64))
