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
te.Linear; every recipe te.Linear supports. Column tensor parallelism with and without
sequence parallelism (TE has no row-parallel LayerNormLinear): the norm runs on this rank's
rows, its (FP8) output is all-gathered, dgrad reduced before the norm backward.
"""

from __future__ import annotations

import torch

from .. import ops
from ..graph_fp8 import norm as graph_norm
from ..patching import Swap
from ..spec import NormSpec
from . import delayed_state, gemm_common, tensor_parallel
from .linear import graph_path_applies, graph_path_forward, make_forward

NAME = "te.LayerNormLinear"


def compiled_forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    """The traceable te.LayerNormLinear forward (see the module docstring)."""
    g = gemm_common.begin_forward(
        NAME,
        self,
        inp,
        is_first_microbatch=is_first_microbatch,
        fp8_output=fp8_output,
        fp8_grad=fp8_grad,
        on_device=("layer_norm_weight",),
    )
    act_dtype = g.act_dtype
    inp_shape = inp.shape
    x = inp.contiguous().view(-1, inp_shape[-1]).to(act_dtype)
    ln_weight = self.layer_norm_weight.to(act_dtype)
    ln_bias = self.layer_norm_bias
    ln_bias = ln_bias.to(act_dtype) if ln_bias is not None else None

    grad = torch.is_grad_enabled()
    # What backward reads, decided as eager TE decides it (from requires_grad at forward).
    norm_params = [p for p in (self.layer_norm_weight, self.layer_norm_bias) if p is not None]
    needs_norm_grads = inp.requires_grad or any(p.requires_grad for p in norm_params)
    save_input = grad and g.weight.requires_grad
    save_weight = grad and needs_norm_grads
    s = gemm_common.gemm_state(self, g, is_first_microbatch)
    norm = NormSpec(
        normalization=self.normalization,
        eps=float(self.eps),
        zero_centered_gamma=bool(self.zero_centered_gamma),
        fwd_sm_margin=self.fwd_ln_sm_margin if grad else self.inf_ln_sm_margin,
        bwd_sm_margin=self.bwd_ln_sm_margin,
    )
    gathered = self.return_layernorm_output_gathered
    parallel = tensor_parallel.parallel_key(NAME, self, g.cfg)
    if gathered and self.sequence_parallel:
        raise gemm_common.unsupported(
            NAME,
            "return_layernorm_output_gathered=True with sequence_parallel=True",
            "return the local norm output (return_layernorm_output_gathered=False)",
        )
    if not parallel and not gathered and graph_path_applies(g, s, x, is_first_microbatch):
        # The graph path: TE's norm kernel, then te.Linear's FP8 GEMMs as graph operations.
        # Current scaling quantizes the norm's bf16 output, as eager TE does; DelayedScaling's
        # fused norm casts the unrounded float32 value, recomputed here from TE's statistics
        # (unless the norm output is returned: eager TE then quantizes its bf16 values too).
        ln_out_2d, mu, rsigma = torch.ops.te_compile.norm_fwd(x, ln_weight, ln_bias, norm.key)
        value = None
        if g.cfg.kind == "delayed" and not self.return_layernorm_output:
            value = graph_norm.unrounded(x, ln_weight, ln_bias, mu, rsigma, norm)
        out, amaxes = graph_path_forward(g, s, ln_out_2d, value)
    else:
        outputs = ops.layernorm_linear.layernorm_linear_fwd(
            x,
            ln_weight,
            ln_bias,
            s.op_weight,
            g.fused_bias,
            delayed_state.op_state(s.fwd_state, s.bwd_state),
            s.weight_cache,
            s.main_grad,
            norm.key,
            g.cfg.key,
            save_input,
            save_weight,
            # Eager TE skips the fused norm+quantize when its output is returned or gathered.
            self.return_layernorm_output or gathered,
            s.accumulate,
            parallel,
        )
        out, amaxes = outputs[0], outputs[-1]
        ln_out_2d = outputs[3] if self.return_layernorm_output else None
    out = out.view(-1, *inp_shape[1:-1], out.shape[-1])
    out = gemm_common.end_forward(self, g, s, out, amaxes)
    ln_out = None
    if self.return_layernorm_output:
        ln_out = ln_out_2d.view(inp_shape)
        if gathered:  # eager TE adds no gradient of a gathered norm output to its backward
            ln_out = ln_out.detach()
    if self.return_bias:
        bias_out = g.bias.to(g.act_dtype) if g.bias is not None else None
        return (out, bias_out, ln_out) if self.return_layernorm_output else (out, bias_out)
    return (out, ln_out) if self.return_layernorm_output else out


def swaps() -> list[Swap]:
    from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear

    return [
        Swap(
            LayerNormLinear,
            "forward",
            make_forward(vars(LayerNormLinear)["forward"], compiled_forward),
        )
    ]
