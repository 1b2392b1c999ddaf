"""te.LayerNorm and te.RMSNorm under torch.compile: their patched `forward`.

Not compiling: TE's own forward (an OperationFuser around TE's LayerNorm/RMSNorm op),
unchanged. While dynamo traces: the same checks and casts as TE's op (`op_forward`), then one
`te_compile::norm_fwd` (TE's norm kernel, high-precision output: a standalone norm has no next
op whose quantizer it could fuse), whose autograd formula runs `te_compile::norm_bwd`.

Options: eps, zero_centered_gamma, sm_margin (an int or TE's per-stage dict, passed to the
kernels as TE passes it), any parameter dtype; the compute dtype is torch.autocast's if on,
else the weight's (the input is cast to it, as TE casts it). Extra inputs or keyword
arguments of TE's fusible-op interface are refused.
"""

from __future__ import annotations

import math

import torch

from .. import ops  # noqa: F401  (registers the te_compile ops)
from ..patching import Swap
from ..spec import NormSpec
from . import gemm_common


def compiled_forward(self, inp, *extra_inputs, normalization: str, **kwargs):
    """The traceable te.LayerNorm / te.RMSNorm forward (see the module docstring)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

    name = f"te.{normalization}"
    if extra_inputs or kwargs:
        raise gemm_common.unsupported(
            name, "extra inputs or keyword arguments (fusible-op channels)", "call it on one tensor"
        )
    if gemm_common.is_quantized(inp):
        raise gemm_common.unsupported(
            name, "a quantized input tensor", "pass a high-precision tensor"
        )
    weight = self.weight
    bias = self.bias if normalization == "LayerNorm" else None
    gemm_common.check_device(inp, weight)
    weight_dims, input_dims = tuple(weight.shape), tuple(inp.shape)
    if len(input_dims) < len(weight_dims) or input_dims[-len(weight_dims) :] != weight_dims:
        raise ValueError(
            f"Input tensor (shape={input_dims}) "
            f"and weight tensor (shape={weight_dims}) are not compatible"
        )
    inner = math.prod(weight_dims)
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight.dtype
    x = inp.contiguous().to(dtype).view(-1, inner)
    w = weight.to(dtype).view(inner)
    b = bias.to(dtype).view(inner) if bias is not None else None
    params = [weight] if bias is None else [weight, bias]
    # TE's fuser: backward runs if the input or a parameter needs grad (its margin choice too).
    requires_grad = torch.is_grad_enabled() and (
        inp.requires_grad or any(p.requires_grad for p in params)
    )
    margins = self._sm_margins
    norm = NormSpec(
        normalization=normalization,
        eps=float(self.eps),
        zero_centered_gamma=bool(self.zero_centered_gamma),
        fwd_sm_margin=margins["forward" if requires_grad else "inference"],
        bwd_sm_margin=margins["backward"],
    )
    out, _, _ = torch.ops.te_compile.norm_fwd(x, w, b, norm.key)
    if requires_grad:
        state.is_first_fp8_module()  # consumed as TE's fuser consumes it
    return out.view(input_dims)


def make_forward(original, normalization: str):
    def forward(self, inp, *extra_inputs, **kwargs):
        if not torch.compiler.is_compiling():
            return original(self, inp, *extra_inputs, **kwargs)
        return compiled_forward(self, inp, *extra_inputs, normalization=normalization, **kwargs)

    forward.__doc__ = original.__doc__
    return forward


def swaps() -> list[Swap]:
    from transformer_engine.pytorch.module.layernorm import LayerNorm
    from transformer_engine.pytorch.module.rmsnorm import RMSNorm

    return [
        Swap(cls, "forward", make_forward(cls.forward, cls.__name__))
        for cls in (LayerNorm, RMSNorm)
    ]
