"""Arguments for the te_compile::linear_* ops, shared by the CPU (fake) and GPU opchecks."""

from __future__ import annotations

import torch

IN, OUT = 128, 256


def fwd_args(quant: tuple, bias: bool, delayed: bool) -> tuple:
    """linear_fwd arguments on "cuda" (fake CUDA inside a FakeTensorMode); `quant` is
    `QuantConfig.op_args()`. DelayedScaling gets TE's initial state with some amax history."""
    torch.manual_seed(0)
    x = torch.randn(64, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(OUT, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
    fwd_state, bwd_state, update = [], [], ""
    if delayed:
        fwd_state = [torch.ones(3, device="cuda"), torch.rand(3, device="cuda")]
        bwd_state = [torch.ones(2, device="cuda"), torch.rand(4, 2, device="cuda")]
        update = "max,0.0,1"
    return (x, w, b, torch.bfloat16, True, True, fwd_state, bwd_state, update, *quant)


def bwd_args(fwd: tuple) -> tuple:
    """linear_bwd arguments for the results of linear_fwd(*fwd)."""
    x, w, b, _, _, _, fwd_state, bwd_state, update, *quant = fwd
    with torch.no_grad():
        out, *parts = torch.ops.te_compile.linear_fwd(*fwd)
    if fwd_state:
        parts = parts[:-1]  # the returned forward amaxes
    n = len(parts) // 2
    fp8 = quant[0] != "none"
    scale, history = bwd_state or [None, None]

    def saved(t):  # without FP8 the forward inputs are what backward reads
        return None if fp8 or t is None else t.detach()

    return (
        torch.randn_like(out),
        saved(x),
        saved(w),
        saved(b),
        b is not None,
        parts[:n],
        parts[n:],
        scale,
        history,
        update,
        torch.bfloat16,
        IN,
        True,
        True,
        *quant,
    )
