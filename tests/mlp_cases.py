"""Arguments for the te_compile::layernorm_mlp_* ops, by name, shared by the CPU (fake) and GPU
opchecks."""

from __future__ import annotations

import torch

from te_compile.kernels import activation
from te_compile.ops.layernorm_mlp import MLPSpec, layernorm_mlp_fwd
from te_compile.ops.layernorm_mlp_layout import MLPFlags
from te_compile.recipes import QuantConfig
from te_compile.spec import NormSpec

HIDDEN, FFN, TOKENS = 128, 256, 64


def spec_keys(
    activation_name="gelu",
    normalization="LayerNorm",
    return_ln=False,
    bias_gelu=False,
    zero_centered_gamma=False,
) -> dict:
    """The `norm` and `mlp` arguments."""
    norm = NormSpec(normalization=normalization, zero_centered_gamma=zero_centered_gamma)
    mlp = MLPSpec(
        activation=activation_name,
        params=activation.params_tuple(activation_name, None),
        bias_gelu=bias_gelu,
        return_ln=return_ln,
    )
    return dict(norm=norm.key, mlp=mlp.key)


def fwd_args(config: str, keys: dict, bias: bool, delayed: bool, save=(True,) * 4) -> dict:
    """layernorm_mlp_fwd arguments on "cuda" (fake CUDA inside a FakeTensorMode); `keys` from
    `spec_keys`, `save` the four save flags."""
    m = MLPSpec.from_key(keys["mlp"])
    layer_norm = NormSpec.from_key(keys["norm"]).normalization == "LayerNorm"
    fc1_out = 2 * FFN if activation.ACTIVATIONS[m.activation].gated else FFN
    torch.manual_seed(0)

    def param(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    delayed_state = []  # forward scale, backward scale and amax history
    if delayed:
        delayed_state = [torch.ones(6, device="cuda"), torch.ones(4, device="cuda")]
        delayed_state.append(torch.rand(4, 4, device="cuda"))
    return dict(
        inp=param(2, TOKENS // 2, HIDDEN),
        ln_weight=param(HIDDEN),
        ln_bias=param(HIDDEN) if layer_norm else None,
        fc1_weight=param(fc1_out, HIDDEN),
        fc1_bias=param(fc1_out) if bias else None,
        fc2_weight=param(HIDDEN, FFN),
        fc2_bias=param(HIDDEN) if bias else None,
        delayed_state=delayed_state,
        fc1_cache=[],
        fc2_cache=[],
        fc1_main_grad=None,
        fc2_main_grad=None,
        config=config,
        **keys,
        out_dtype=torch.bfloat16,
        flags=MLPFlags(*save, accumulate=True).key,
        parallel="",
    )


def bwd_args(fwd: dict) -> dict:
    """layernorm_mlp_bwd arguments for the results of layernorm_mlp_fwd(**fwd) (no weight caches,
    no returned norm output without FP8: the saved list is what forward returned)."""
    m = MLPSpec.from_key(fwd["mlp"])
    layer_norm = NormSpec.from_key(fwd["norm"]).normalization == "LayerNorm"
    fp8 = QuantConfig.from_key(fwd["config"]).fp8
    with torch.no_grad():
        outputs = layernorm_mlp_fwd(**fwd)
    n_out = 2 if m.return_ln else 1
    saved = list(outputs[n_out : len(outputs) - (1 if fwd["delayed_state"] else 0)])
    flags = MLPFlags.from_key(fwd["flags"])
    if m.return_ln and not fp8 and flags.save_fc1_input:  # FC1's input: the returned norm output
        k = (2 if layer_norm else 1) if flags.save_norm else 0
        saved = saved[:k] + [outputs[1].view(-1, HIDDEN)] + saved[k:]

    def detached(name, high_precision_only=False):
        t = fwd[name]
        return None if t is None or (fp8 and high_precision_only) else t.detach()

    return dict(
        grad_out=torch.randn_like(outputs[0]),
        grad_ln_out=torch.randn_like(outputs[1]) if m.return_ln else None,
        **{name: detached(name) for name in ("inp", "ln_weight", "fc1_bias", "fc2_bias")},
        fc1_weight=detached("fc1_weight", high_precision_only=True),
        fc2_weight=detached("fc2_weight", high_precision_only=True),
        saved=saved,
        bwd_state=fwd["delayed_state"][1:],
        fc1_main_grad=None,
        fc2_main_grad=None,
        config=fwd["config"],
        norm=fwd["norm"],
        mlp=fwd["mlp"],
        fc1_features=fwd["fc1_weight"].shape[0],
        flags=fwd["flags"],
        needs_norm_grads=True,
        needs_fc1_wgrad=True,
        needs_fc1_dbias=True,
        needs_fc2_wgrad=True,
        parallel="",
    )
