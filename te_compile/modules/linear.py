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

Tensor parallelism (tp_group, parallel_mode, sequence_parallel): the ops run TE's all-gathers
and reductions on the group they name (tensor_parallel.py); per-tensor FP8 gathers in FP8.

DelayedScaling's per-module amax/scale state is TE's own `fp8_meta`; FP8 weight caches
(is_first_microbatch) are tensors on the module. Both are created at trace time
(persistent_state.py) and mutated in place by the ops.
"""

from __future__ import annotations

import torch

from .. import ops
from ..graph_fp8 import linear as graph_linear
from ..patching import Swap
from . import delayed_state, fp8_params, gemm_common, tensor_parallel

NAME = "te.Linear"


def _quant_config(recipe):
    """te.Linear's QuantConfig of an FP8 `recipe` (also used by tests and benchmarks)."""
    return gemm_common.quant_config(NAME, recipe)


def compiled_forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    """The traceable te.Linear forward (see the module docstring)."""
    if self.save_original_input:
        raise gemm_common.unsupported(
            NAME, "save_original_input=True", "set save_original_input=False"
        )
    g = gemm_common.begin_forward(
        NAME,
        self,
        inp,
        is_first_microbatch=is_first_microbatch,
        fp8_output=fp8_output,
        fp8_grad=fp8_grad,
    )
    inp = inp.contiguous()
    grad = torch.is_grad_enabled()
    # What backward reads, decided as eager TE decides it (from requires_grad at forward).
    save_input = grad and g.weight.requires_grad
    save_weight = grad and inp.requires_grad
    s = gemm_common.gemm_state(self, g, is_first_microbatch)
    parallel = tensor_parallel.parallel_key(NAME, self, g.cfg)
    if not parallel and graph_path_applies(g, s, inp, is_first_microbatch):
        out, amaxes = graph_path_forward(g, s, inp)
        return _returned(self, g, gemm_common.end_forward(self, g, s, out, amaxes))
    outputs = ops.linear.linear_fwd(
        inp,
        s.op_weight,
        g.fused_bias,
        delayed_state.op_state(s.fwd_state, s.bwd_state),
        s.weight_cache,
        s.main_grad,
        g.cfg.key,
        g.act_dtype,
        save_input,
        save_weight,
        s.accumulate,
        parallel,
    )
    return _returned(self, g, gemm_common.end_forward(self, g, s, outputs[0], outputs[-1]))


def _returned(m, g, out):
    if m.return_bias:
        return out, (g.bias.to(g.act_dtype) if g.bias is not None else None)
    return out


def graph_path_applies(g, s, inp, is_first_microbatch) -> bool:
    """The graph path asked for (graph_fp8.linear.wanted) and a call it computes: no FP8 weight
    cache, FP8 parameter or main_grad, and a recipe and shapes graph_fp8.linear takes (`inp`:
    the GEMM's input)."""
    if s.main_grad is not None or not graph_linear.wanted(g.cfg, inp, g.weight):
        return False
    if is_first_microbatch is not None:  # FP8 weight caching
        return False
    if s.op_weight is not g.weight:  # an FP8 parameter's gradient carrier
        return False
    return not graph_linear.applies(g.cfg, inp, g.weight, g.act_dtype)


def graph_path_forward(g, s, inp, x_value=None):
    """(out, amaxes) of the GEMM on 2-D `inp` on the graph path (graph_fp8/linear.py), where
    `graph_path_applies`; te.Linear's and LayerNormLinear's (after its norm, whose float32
    value is `x_value` under DelayedScaling)."""
    call = graph_linear.LinearFP8(g.cfg, g.act_dtype)
    bias = None if g.fused_bias is None else g.fused_bias.to(g.act_dtype)
    delayed = tuple(delayed_state.op_state(s.fwd_state, s.bwd_state)) or None
    return graph_linear.linear(inp, g.weight, bias, call, delayed, x_value)


def make_forward(original, compiled=compiled_forward):
    """TE's `original` forward, `compiled` in its place under torch.compile (te.Linear's and
    LayerNormLinear's: the same arguments)."""

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        if not torch.compiler.is_compiling():
            return original(self, inp, is_first_microbatch, fp8_output, fp8_grad)
        return compiled(self, inp, is_first_microbatch, fp8_output, fp8_grad)

    forward.__doc__ = original.__doc__
    return forward


def swaps() -> list[Swap]:
    from transformer_engine.pytorch.module.linear import Linear

    # FP8 parameters: dynamo's guard on a Float8Tensor (fp8_params.py)
    return [Swap(Linear, "forward", make_forward(vars(Linear)["forward"])), *fp8_params.swaps()]
