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
