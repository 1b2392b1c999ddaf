"""Arguments for the te_compile::linear_* ops, shared by the CPU (fake) and GPU opchecks."""

from __future__ import annotations

import torch

from te_compile.kernels.fp8_operands import weight_cache_specs
from te_compile.ops.linear import linear_fwd
from te_compile.recipes import QuantConfig
from te_compile.spec import GemmGrads

IN, OUT = 128, 256


def fwd_args(config: str, bias: bool, delayed: bool, cached_weight: bool = False) -> tuple:
    """linear_fwd arguments on "cuda" (fake CUDA inside a FakeTensorMode); `config` is a
    `QuantConfig.key`. DelayedScaling gets TE's initial state with some amax history. With
    `cached_weight` the weight comes from an FP8 weight cache filled by quantize_weight."""
    torch.manual_seed(0)
    x = torch.randn(64, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(OUT, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
    fwd_state, bwd_state = [], []
    if delayed:
        fwd_state = [torch.ones(3, device="cuda"), torch.rand(3, device="cuda")]
        bwd_state = [torch.ones(2, device="cuda"), torch.rand(4, 2, device="cuda")]
    cache = weight_cache_args(config, w, fwd_state)[1] if cached_weight else []
    delayed_state = [*fwd_state[:1], *bwd_state]  # the forward scale, the backward state
    return (
        *(x, w, b, delayed_state, cache, None, config, torch.bfloat16, True, True, True),
        "",  # parallel: no tensor parallelism
    )


def weight_cache_args(config: str, weight, fwd_state) -> tuple:
    """quantize_weight arguments filling a fresh cache for `weight` (refresh=True)."""
    cfg = QuantConfig.from_key(config)
    cache = [torch.zeros(s, dtype=d, device="cuda") for s, d in weight_cache_specs(cfg, OUT_IN)]
    valid = torch.zeros(1, device="cuda")
    scale, amax = fwd_state or [None, None]
    args = (weight.detach(), cache, valid, scale, amax, config, True)
    torch.ops.te_compile.quantize_weight(*args)
    return args, cache


OUT_IN = (OUT, IN)


def bwd_args(fwd: tuple) -> tuple:
    """linear_bwd arguments for the results of linear_fwd(*fwd)."""
    x, w, b, delayed_state, cache, main_grad, config, *_ = fwd
    with torch.no_grad():
        out, *parts = linear_fwd(*fwd)
    if delayed_state:
        parts = parts[:-1]  # the returned forward amaxes
    fp8 = QuantConfig.from_key(config).fp8

    def saved(t):  # without FP8 the forward inputs are what backward reads
        return None if fp8 or t is None else t.detach()

    return (
        torch.randn_like(out),
        saved(x),
        saved(w),
        saved(b),
        parts,
        delayed_state[1:],  # bwd_state
        main_grad,
        config,
        GemmGrads(b is not None, True, True, True, len(parts) // 2).key,
        torch.bfloat16,
        IN,
        "",  # parallel
    )
