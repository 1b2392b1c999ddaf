"""Arguments for the te_compile::layernorm_mlp_* ops, shared by the CPU (fake) and GPU opchecks."""

from __future__ import annotations

import torch

from te_compile.ops import activation
from te_compile.ops.layernorm_mlp import MLPConfig
from te_compile.recipes import QuantConfig

HIDDEN, FFN, TOKENS = 128, 256, 64


def mlp_key(
    activation_name="gelu",
    normalization="LayerNorm",
    return_ln=False,
    bias_gelu=None,
    zero_centered_gamma=False,
) -> str:
    if bias_gelu is None:
        bias_gelu = False
    return MLPConfig(
        normalization=normalization,
        activation=activation_name,
        params=activation.params_tuple(activation_name, None),
        bias_gelu=bias_gelu,
        return_ln=return_ln,
        zero_centered_gamma=zero_centered_gamma,
    ).key


def fwd_args(config: str, mlp: str, bias: bool, delayed: bool, flags=(True,) * 4) -> tuple:
    """layernorm_mlp_fwd arguments on "cuda" (fake CUDA inside a FakeTensorMode)."""
    m = MLPConfig.from_key(mlp)
    fc1_out = 2 * FFN if activation.ACTIVATIONS[m.activation].gated else FFN
    torch.manual_seed(0)

    def param(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    x = param(2, TOKENS // 2, HIDDEN)
    ln_w, ln_b = param(HIDDEN), param(HIDDEN) if m.normalization == "LayerNorm" else None
    w1, b1 = param(fc1_out, HIDDEN), param(fc1_out) if bias else None
    w2, b2 = param(HIDDEN, FFN), param(HIDDEN) if bias else None
    fwd_state, bwd_state = [], []
    if delayed:
        fwd_state = [torch.ones(6, device="cuda"), torch.rand(6, device="cuda")]
        bwd_state = [torch.ones(4, device="cuda"), torch.rand(4, 4, device="cuda")]
    return (
        x,
        ln_w,
        ln_b,
        w1,
        b1,
        w2,
        b2,
        fwd_state,
        bwd_state,
        [],
        [],
        None,
        None,
        config,
        mlp,
        torch.bfloat16,
        *flags,
        True,
    )


def bwd_args(fwd: tuple) -> tuple:
    """layernorm_mlp_bwd arguments for the results of layernorm_mlp_fwd(*fwd) (no weight caches,
    no returned norm output without FP8: the saved list is what forward returned)."""
    x, ln_w, ln_b, w1, b1, w2, b2, fwd_state, bwd_state, *_ = fwd
    config, mlp = fwd[13], fwd[14]
    flags = list(fwd[16:20])
    m = MLPConfig.from_key(mlp)
    fp8 = QuantConfig.from_key(config).fp8
    with torch.no_grad():
        outputs = torch.ops.te_compile.layernorm_mlp_fwd(*fwd)
    n_out = 2 if m.return_ln else 1
    saved = list(outputs[n_out : len(outputs) - (1 if fwd_state else 0)])
    if m.return_ln and not fp8 and flags[1]:  # FC1's saved input is the returned norm output
        k = (2 if m.normalization == "LayerNorm" else 1) if flags[0] else 0
        saved = saved[:k] + [outputs[1].view(-1, HIDDEN)] + saved[k:]
    scale, history = bwd_state or [None, None]

    def hp(t):
        return None if fp8 or t is None else t.detach()

    return (
        torch.randn_like(outputs[0]),
        torch.randn_like(outputs[1]) if m.return_ln else None,
        x.detach(),
        ln_w.detach(),
        hp(w1),
        None if b1 is None else b1.detach(),
        hp(w2),
        None if b2 is None else b2.detach(),
        list(saved),
        scale,
        history,
        None,
        None,
        config,
        mlp,
        torch.bfloat16,
        w1.shape[0],
        flags,
        [True] * 7 if ln_b is not None else [True, True, False, True, True, True, True],
        True,
    )
