"""torch.library.opcheck for every te_compile op on fake CUDA tensors (no GPU).

On fake inputs the ops dispatch to their fake kernels, so this checks the schemas, the autograd
registration, and that the fake kernels run and trace through AOT dispatch; it cannot compare
fake with real kernels. The real kernels are opchecked in tests/gpu.
"""

from __future__ import annotations

import pytest
import torch
from transformer_engine.common import recipe as R

import te_compile.ops  # noqa: F401  (registers the ops)
from te_compile.recipes import for_linear

IN, OUT = 128, 256
RECIPES = {
    "none": (lambda: None, "hopper"),
    "current": (R.Float8CurrentScaling, "hopper"),
    "block": (R.Float8BlockScaling, "hopper"),
    "delayed": (R.DelayedScaling, "hopper"),
    "mxfp8": (R.MXFP8BlockScaling, "blackwell"),
    "nvfp4": (R.NVFP4BlockScaling, "blackwell"),
}


def fwd_args(name, bias):
    make, _ = RECIPES[name]
    cfg = for_linear(make(), fp8_transpose=True)
    x = torch.randn(64, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(OUT, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
    fwd_state, bwd_state, update = [], [], ""
    if name == "delayed":
        fwd_state = [torch.ones(3, device="cuda"), torch.zeros(3, device="cuda")]
        bwd_state = [torch.ones(2, device="cuda"), torch.zeros(4, 2, device="cuda")]
        update = "max,0.0,1"
    return (x, w, b, torch.bfloat16, True, True, fwd_state, bwd_state, update, *cfg.op_args())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_ops_opcheck_on_fake(name, bias, fake_gpu, fake_cuda):
    fake_gpu(RECIPES[name][1])
    args = fwd_args(name, bias)
    torch.library.opcheck(torch.ops.te_compile.linear_fwd.default, args)
    with torch.no_grad():
        out, *parts = torch.ops.te_compile.linear_fwd(*args)
    if name == "delayed":
        parts = parts[:-1]  # the returned forward amaxes
    n = len(parts) // 2
    scale, history = args[7] or [None, None]
    fp8 = name != "none"
    x, w, b = (
        (None, None, None) if fp8 else (t.detach() if t is not None else None for t in args[:3])
    )
    bwd_args = (
        torch.randn_like(out),
        x,
        w,
        b,
        bias,
        parts[:n],
        parts[n:],
        scale,
        history,
        args[8],
        torch.bfloat16,
        IN,
        True,
        True,
        *args[9:],
    )
    torch.library.opcheck(torch.ops.te_compile.linear_bwd.default, bwd_args)


def test_amax_and_scale_update_opcheck_on_fake(fake_cuda):
    histories = [torch.rand(4, 3, device="cuda"), torch.rand(4, 1, device="cuda")]
    scales = [torch.ones(3, device="cuda"), torch.ones(1, device="cuda")]
    torch.library.opcheck(
        torch.ops.te_compile.amax_and_scale_update.default,
        (histories, scales, "max", "e4m3", 0.0, True),
    )
