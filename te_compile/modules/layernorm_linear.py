"""te.LayerNormLinear under torch.compile: the patched `LayerNormLinear.forward`.

Not compiling: TE's own forward (a torch.compiler.disable'd autograd.Function), unchanged.
While dynamo traces: the checks of te.Linear's compiled path (gemm_common.py) plus this
module's own, the casts eager TE does inside its autograd.Function, and one
`te_compile::layernorm_linear_fwd` (TE's norm, fused with the GEMM input's quantization where
eager TE fuses it, then the GEMM layer te.Linear's ops run), whose autograd formula calls
`te_compile::layernorm_linear_bwd`.

Options: LayerNorm and RMSNorm, bias on/off, return_bias, return_layernorm_output,
return_layernorm_output_gathered (without tensor parallelism it gathers nothing; like eager TE
it then runs the norm unfused and sends no gradient of the returned norm output back),
zero_centered_gamma, parameters_split (the split weights are concatenated in the graph, as
TE's noop_cat), is_first_microbatch (FP8 weight caching) and fuse_wgrad_accumulation as
te.Linear; every recipe te.Linear supports.
"""

from __future__ import annotations

import torch

from .. import ops  # noqa: F401  (registers the te_compile ops)
from ..patching import Swap
from . import fp8_params, gemm_common
from . import linear as _linear  # DEVICE_TYPES: the devices every compiled path accepts

NAME = "te.LayerNormLinear"


def _unsupported(option: str, fix: str = ""):
    return gemm_common.unsupported(NAME, option, fix)


def _concat(tensors: list) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _check_input(m, inp: torch.Tensor, weight: torch.Tensor, fp8: bool) -> None:
    if gemm_common.is_quantized(inp):
        raise _unsupported("a quantized input tensor", "pass a high-precision tensor")
    gemm_common.check_device(_linear.DEVICE_TYPES, inp, weight, m.layer_norm_weight)
    if inp.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"te.LayerNormLinear: input's last dimension {inp.shape[-1]} does not match "
            f"in_features={weight.shape[1]}"
        )
    if fp8:
        gemm_common.check_fp8_dims(input=inp, weight=weight)


def compiled_forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    """The traceable te.LayerNormLinear forward (see the module docstring)."""
    fp8, recipe = gemm_common.autocast_recipe(NAME)
    cfg = gemm_common.quant_config(NAME, recipe)
    weights = [getattr(self, n) for n in self.weight_names]
    gemm_common.check_module_options(
        NAME,
        self,
        weights,
        is_first_microbatch=is_first_microbatch,
        fp8_output=fp8_output,
        fp8_grad=fp8_grad,
        cfg=cfg,
    )
    fp8_params.check(NAME, self, weights, cfg)
    if self.fuse_wgrad_accumulation and len(weights) > 1:
        raise _unsupported(
            "fuse_wgrad_accumulation with parameters_split", "use one weight parameter"
        )
    weight = _concat(weights)
    bias = _concat([getattr(self, n) for n in self.bias_names]) if self.use_bias else None
    _check_input(self, inp, weight, fp8)
    act_dtype = gemm_common.activation_dtype(self, inp)

    inp_shape = inp.shape
    x = inp.contiguous().view(-1, inp_shape[-1]).to(act_dtype)
    ln_weight = self.layer_norm_weight.to(act_dtype)
    ln_bias = self.layer_norm_bias
    ln_bias = ln_bias.to(act_dtype) if ln_bias is not None else None
    fused_bias = bias if (self.apply_bias and not self.gemm_bias_unfused_add) else None

    grad = torch.is_grad_enabled()
    # What backward reads, decided as eager TE decides it (from requires_grad at forward).
    norm_params = [p for p in (self.layer_norm_weight, self.layer_norm_bias) if p is not None]
    needs_norm_grads = inp.requires_grad or any(p.requires_grad for p in norm_params)
    save_input = grad and weight.requires_grad
    save_weight = grad and needs_norm_grads
    fwd_state, bwd_state = gemm_common.fp8_module_state(self, recipe, cfg)
    # An FP8 parameter enters as its gradient carrier and its parts (fp8_params.py).
    op_weight, weight_cache = fp8_params.gemm_weight(
        self, "weight", weight, cfg, fwd_state, is_first_microbatch
    )
    main_grad = weight.main_grad if self.fuse_wgrad_accumulation else None
    # fuse_wgrad_accumulation adds to main_grad, except on a first microbatch (TE's rule).
    accumulate = not is_first_microbatch if is_first_microbatch is not None else True
    gathered = self.return_layernorm_output_gathered
    outputs = torch.ops.te_compile.layernorm_linear_fwd(
        x,
        ln_weight,
        ln_bias,
        op_weight,
        fused_bias,
        gemm_common.forward_op_state(fwd_state),
        bwd_state,
        weight_cache,
        main_grad,
        self.normalization,
        float(self.eps),
        self.fwd_ln_sm_margin if grad else self.inf_ln_sm_margin,
        self.bwd_ln_sm_margin,
        bool(self.zero_centered_gamma),
        cfg.key,
        save_input,
        save_weight,
        # Eager TE skips the fused norm+quantize when the norm output is returned or gathered.
        self.return_layernorm_output or gathered,
        accumulate,
    )
    out = outputs[0].view(-1, *inp_shape[1:-1], outputs[0].shape[-1])
    gemm_common.merge_forward_amaxes(fwd_state, outputs[-1])
    if self.gemm_bias_unfused_add:  # row-parallel: TE adds the bias after the GEMM
        out = out + bias.to(act_dtype)
    ln_out = None
    if self.return_layernorm_output:
        ln_out = outputs[3].view(inp_shape)
        if gathered:  # eager TE adds no gradient of a gathered norm output to its backward
            ln_out = ln_out.detach()
    if self.return_bias:
        bias_out = bias.to(act_dtype) if bias is not None else None
        return (out, bias_out, ln_out) if self.return_layernorm_output else (out, bias_out)
    return (out, ln_out) if self.return_layernorm_output else out


def make_forward(original):
    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        if not torch.compiler.is_compiling():
            return original(self, inp, is_first_microbatch, fp8_output, fp8_grad)
        return compiled_forward(self, inp, is_first_microbatch, fp8_output, fp8_grad)

    forward.__doc__ = original.__doc__
    return forward


def swaps() -> list[Swap]:
    from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear

    return [Swap(LayerNormLinear, "forward", make_forward(vars(LayerNormLinear)["forward"]))]
