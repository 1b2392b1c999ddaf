"""te.Linear under torch.compile: the patched `Linear.forward`.

Not compiling: TE's own forward, unchanged. While dynamo traces: this module reads the autocast
state and the module's configuration (trace-time constants), refuses what it does not
implement, and calls `te_compile::linear_fwd`, whose autograd formula calls
`te_compile::linear_bwd`. It never calls TE's `prepare_forward` (which allocates and queries
the driver) and writes no module state, so a traced step is replayable as is.

Recipes: none (bf16/fp16/fp32), Float8CurrentScaling, Float8BlockScaling, DelayedScaling,
MXFP8BlockScaling and NVFP4BlockScaling (the last two on Blackwell, as in eager TE).
parameters_split: the split weights (and biases) are concatenated in the graph, as TE's
`noop_cat` gives them to its GEMM (a view when they tile one buffer, else a copy: the same
values either way); autograd sends each split parameter its slice of the gradient.

DelayedScaling's per-module amax/scale state is TE's own `fp8_meta`; FP8 weight caches
(is_first_microbatch) are tensors on the module. Both are created at trace time
(persistent_state.py) and mutated in place by the ops.
"""

from __future__ import annotations

import torch

from .. import ops  # noqa: F401  (registers the te_compile ops)
from ..patching import Swap
from . import fp8_params, gemm_common

# Devices the compiled path accepts. On "meta" tensors our ops run their fake kernels: that is how
# te_compile.simulate_gpu traces forward and backward without a GPU (the autograd engine asks the
# CUDA driver about every CUDA tensor, fake ones included).
DEVICE_TYPES = ("cuda", "meta")
NAME = "te.Linear"


def _unsupported(option: str, fix: str = ""):
    return gemm_common.unsupported(NAME, option, fix)


def _quant_config(recipe):
    """te.Linear's QuantConfig of an FP8 `recipe` (also used by tests and benchmarks)."""
    return gemm_common.quant_config(NAME, recipe)


def _check_linear_options(m) -> None:
    """te.Linear options on top of the shared ones (gemm_common.check_module_options)."""
    if m.save_original_input:
        raise _unsupported("save_original_input=True", "set save_original_input=False")
    if m.fuse_wgrad_accumulation and len(m.weight_names) > 1:
        raise _unsupported(
            "fuse_wgrad_accumulation with parameters_split", "use one weight parameter"
        )


def concat_split(tensors: list) -> torch.Tensor:
    """TE's noop_cat of split parameters, in the graph: one tensor of their rows."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _check_input(inp: torch.Tensor, weight: torch.Tensor, fp8: bool) -> None:
    if gemm_common.is_quantized(inp):
        raise _unsupported("a quantized input tensor", "pass a high-precision tensor")
    gemm_common.check_device(DEVICE_TYPES, inp, weight)
    if inp.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"te.Linear: input's last dimension {inp.shape[-1]} does not match "
            f"in_features={weight.shape[1]}"
        )
    if fp8:
        gemm_common.check_fp8_dims(input=inp, weight=weight)


def compiled_forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    """The traceable te.Linear forward (see the module docstring)."""
    fp8, recipe = gemm_common.autocast_recipe(NAME)
    cfg = _quant_config(recipe)
    _check_linear_options(self)
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

    weight = concat_split(weights)
    bias = concat_split([getattr(self, n) for n in self.bias_names]) if self.use_bias else None
    _check_input(inp, weight, fp8)
    act_dtype = gemm_common.activation_dtype(self, inp)
    inp = inp.contiguous()

    fused_bias = bias if (self.apply_bias and not self.gemm_bias_unfused_add) else None
    grad = torch.is_grad_enabled()
    # What backward reads, decided as eager TE decides it (from requires_grad at forward).
    save_input = grad and weight.requires_grad
    save_weight = grad and inp.requires_grad
    fwd_state, bwd_state = gemm_common.fp8_module_state(self, recipe, cfg)
    # An FP8 parameter enters as its gradient carrier and its parts (fp8_params.py).
    op_weight, weight_cache = fp8_params.gemm_weight(
        self, "weight", weight, cfg, fwd_state, is_first_microbatch
    )
    main_grad = weight.main_grad if self.fuse_wgrad_accumulation else None
    # fuse_wgrad_accumulation adds to main_grad, except on a first microbatch (TE's rule).
    accumulate = not is_first_microbatch if is_first_microbatch is not None else True
    outputs = torch.ops.te_compile.linear_fwd(
        inp,
        op_weight,
        fused_bias,
        gemm_common.forward_op_state(fwd_state),
        bwd_state,
        weight_cache,
        main_grad,
        cfg.key,
        act_dtype,
        save_input,
        save_weight,
        accumulate,
    )
    out = outputs[0]
    gemm_common.merge_forward_amaxes(fwd_state, outputs[-1])
    if self.gemm_bias_unfused_add:  # row-parallel: TE adds the bias after the GEMM
        out = out + bias.to(act_dtype)
    if self.return_bias:
        return out, (bias.to(act_dtype) if bias is not None else None)
    return out


def make_forward(original):
    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        if not torch.compiler.is_compiling():
            return original(self, inp, is_first_microbatch, fp8_output, fp8_grad)
        return compiled_forward(self, inp, is_first_microbatch, fp8_output, fp8_grad)

    forward.__doc__ = original.__doc__
    return forward


def swaps() -> list[Swap]:
    from transformer_engine.pytorch.module.linear import Linear

    # FP8 parameters: dynamo's guard on a Float8Tensor (fp8_params.py)
    return [Swap(Linear, "forward", make_forward(vars(Linear)["forward"])), *fp8_params.swaps()]
