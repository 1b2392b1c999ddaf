"""te.LayerNormMLP under torch.compile: the patched `LayerNormMLP.forward`.

Not compiling: TE's own forward, unchanged. While dynamo traces: reads the autocast state and
the module's configuration as trace-time constants, refuses what it does not implement
(naming the option), checks the input as TE does, and calls `te_compile::layernorm_mlp_fwd`
(whose autograd formula calls `te_compile::layernorm_mlp_bwd`), plus
`te_compile::quantize_weight` per GEMM weight for FP8 weight caching (is_first_microbatch).

Supported: LayerNorm and RMSNorm, every activation of TE's table (kernels/activation.py) with
activation_params, bias on/off, return_bias, return_layernorm_output, zero_centered_gamma,
set_parallel_mode without TP, fuse_wgrad_accumulation, is_first_microbatch, checkpoint=True
(te_compile.checkpoint around the forward), and the recipes of
te.Linear (none, Float8CurrentScaling, Float8BlockScaling, DelayedScaling, MXFP8BlockScaling,
NVFP4BlockScaling). DelayedScaling state is TE's own fp8_meta with two GEMMs.
"""

from __future__ import annotations

import torch

from .. import ops
from ..graph_fp8 import linear as graph_linear
from ..graph_fp8 import mlp as graph_mlp
from ..graph_fp8 import norm as graph_norm
from ..kernels import activation
from ..ops.layernorm_mlp import MLPSpec
from ..ops.layernorm_mlp_layout import MLPFlags
from ..patching import Swap
from ..recipes import QuantConfig
from ..spec import NormSpec
from . import (
    checkpointing,
    delayed_state,
    fp8_params,
    gemm_common,
    persistent_state,
    tensor_parallel,
)

NAME = "te.LayerNormMLP"


def _unsupported(option: str, fix: str = ""):
    return gemm_common.unsupported(NAME, option, fix)


def _bias_gelu_fusion(m) -> bool:
    """TE's bias-GeLU fusion switch as its forward leaves it: on for GELU unless
    NVTE_BIAS_GELU_NVFUSION=0, and turned off (for good, in eager TE) under non-reentrant
    activation recompute."""
    from transformer_engine.pytorch.distributed import use_reentrant_activation_recompute

    return bool(m.bias_gelu_nvfusion) and use_reentrant_activation_recompute()


def _check_mlp_options(m, cfg: QuantConfig) -> None:
    """The LayerNormMLP options beyond the shared ones (gemm_common) this path refuses."""
    if m.activation not in activation.ACTIVATIONS:
        raise NotImplementedError("Activation type " + m.activation + " is not supported!")
    if m.return_layernorm_output_gathered:
        raise _unsupported(
            "return_layernorm_output_gathered=True (a sequence-parallel option)",
            "use return_layernorm_output",
        )
    if cfg.fp8 and m.gemm_gelu_fusion:
        raise _unsupported(
            "NVTE_GEMM_GELU_FUSION=1 (GELU fused into the FP8 FC1 GEMM)",
            "unset NVTE_GEMM_GELU_FUSION",
        )
    if not cfg.fp8 and m.activation == "gelu" and not _bias_gelu_fusion(m):
        raise _unsupported(
            "GELU in cuBLAS GEMM epilogues (TE's choice without FP8 when its bias-GeLU fusion "
            "is off: NVTE_BIAS_GELU_NVFUSION=0 or non-reentrant activation recompute)",
            "leave NVTE_BIAS_GELU_NVFUSION unset and use reentrant activation recompute",
        )


def _check_input(m, inp: torch.Tensor, fp8: bool) -> None:
    if gemm_common.is_quantized(inp):
        raise _unsupported("a quantized input tensor", "pass a high-precision tensor")
    gemm_common.check_device(inp, m.fc1_weight, m.fc2_weight)
    hidden = m.layer_norm_weight.numel()
    if inp.shape[-1] != hidden:
        raise ValueError(
            f"{NAME}: input's last dimension {inp.shape[-1]} does not match hidden_size={hidden}"
        )
    if fp8:
        gemm_common.check_fp8_dims(
            input=inp.reshape(-1, hidden), fc1_weight=m.fc1_weight, fc2_weight=m.fc2_weight
        )


def _requires_grad(t) -> bool:
    return t is not None and t.requires_grad


def compiled_forward(self, inp, is_first_microbatch=None):
    """The traceable te.LayerNormMLP forward (see the module docstring)."""
    fp8, recipe = gemm_common.autocast_recipe(NAME)
    cfg = gemm_common.quant_config(NAME, recipe)
    parallel = tensor_parallel.mlp_parallel_key(NAME, self, cfg)
    w1, w2 = self.fc1_weight, self.fc2_weight
    gemm_common.check_module_options(
        NAME,
        self,
        [w1, w2],
        is_first_microbatch=is_first_microbatch,
        fp8_output=False,
        fp8_grad=False,
        cfg=cfg,
    )
    fp8_params.check(NAME, self, [w1], cfg)
    fp8_params.check(NAME, self, [w2], cfg)
    _check_mlp_options(self, cfg)
    _check_input(self, inp, fp8)
    act_dtype = gemm_common.activation_dtype(self, inp)
    inp = inp.contiguous()

    ln_w, ln_b = self.layer_norm_weight, self.layer_norm_bias
    b1 = self.fc1_bias if self.use_bias else None
    b2 = self.fc2_bias if self.use_bias else None
    b2_fused = b2 if self.apply_bias and not self.gemm_bias_unfused_add else None
    grad = torch.is_grad_enabled()
    fwd_state, bwd_state = delayed_state.fp8_module_state(self, recipe, cfg)

    if fp8 and is_first_microbatch is not None and not gemm_common.is_quantized(w2):
        # Both caches exist before either is read: dynamo keeps the cache dict as it first read
        # it, and would miss an entry created afterwards by the (untraced) ensure function.
        shape, prepared = tuple(w2.shape), persistent_state.is_prepared(self)
        persistent_state.ensure_weight_caches(cfg.key, "fc2_weight", shape, str(w2.dtype), prepared)
    # FP8 parameters enter as their gradient carriers and parts (fp8_params.py).
    op_w1, fc1_cache = fp8_params.gemm_weight(
        self, "fc1_weight", w1, cfg, fwd_state, is_first_microbatch, gemm=0
    )
    op_w2, fc2_cache = fp8_params.gemm_weight(
        self, "fc2_weight", w2, cfg, fwd_state, is_first_microbatch, gemm=1
    )
    fuse = self.fuse_wgrad_accumulation
    main1 = w1.main_grad if fuse and w1.requires_grad else None
    main2 = w2.main_grad if fuse and w2.requires_grad else None

    norm = NormSpec(
        normalization=self.normalization,
        eps=self.eps,
        zero_centered_gamma=self.zero_centered_gamma,
        fwd_sm_margin=self.fwd_ln_sm_margin if grad else self.inf_ln_sm_margin,
        bwd_sm_margin=self.bwd_ln_sm_margin,
    )
    plumbing = (op_w1, op_w2, main1, main2, parallel, is_first_microbatch)
    if _graph_path_applies(self, cfg, inp, act_dtype, plumbing):
        # The graph path: TE's norm kernel, then the MLP's FP8 as graph operations. Current
        # scaling quantizes the norm's bf16 output, as eager TE; DelayedScaling's fused norm
        # casts its float32 value, recomputed from TE's statistics (as LayerNormLinear's).
        x = inp.view(-1, inp.shape[-1])
        ln_w = ln_w.to(act_dtype)
        ln_b = ln_b.to(act_dtype) if ln_b is not None else None
        ln_out, mu, rsigma = torch.ops.te_compile.norm_fwd(x, ln_w, ln_b, norm.key)
        value = None
        if cfg.kind == "delayed":
            value = graph_norm.unrounded(x, ln_w, ln_b, mu, rsigma, norm)
        b1, b2_fused = (b.to(act_dtype) if b is not None else None for b in (b1, b2_fused))
        call = graph_mlp.MLPFP8(cfg, act_dtype)
        state = delayed_state.op_state(fwd_state, bwd_state) or None
        out, amaxes = graph_mlp.mlp(ln_out, w1, b1, w2, b2_fused, call, state, value)
        delayed_state.merge_forward_amaxes(fwd_state, amaxes)
        return _returned(self, out.view(*inp.shape[:-1], out.shape[-1]), b2, act_dtype, None)
    mlp = MLPSpec(
        activation=self.activation,
        params=activation.params_tuple(self.activation, self.activation_params),
        bias_gelu=not fp8 and self.activation == "gelu" and _bias_gelu_fusion(self),
        return_ln=self.return_layernorm_output,
    )
    outputs = ops.layernorm_mlp.layernorm_mlp_fwd(
        *(inp, ln_w, ln_b, op_w1, b1, op_w2, b2_fused),
        delayed_state=delayed_state.op_state(fwd_state, bwd_state),
        fc1_cache=fc1_cache,
        fc2_cache=fc2_cache,
        fc1_main_grad=main1,
        fc2_main_grad=main2,
        config=cfg.key,
        norm=norm.key,
        mlp=mlp.key,
        out_dtype=act_dtype,
        flags=_flags(grad, is_first_microbatch, (inp, ln_w, ln_b), w1, b1, w2).key,
        parallel=parallel,
    )
    delayed_state.merge_forward_amaxes(fwd_state, outputs[-1])
    ln_out = outputs[1] if self.return_layernorm_output else None
    return _returned(self, outputs[0], b2, act_dtype, ln_out)


def _flags(grad: bool, is_first_microbatch, norm_inputs, w1, b1, w2) -> MLPFlags:
    """What backward reads, decided as eager TE decides it (from requires_grad at forward, of
    the norm's input and parameters `norm_inputs` and the FC weights and FC1 bias), and whether
    fuse_wgrad_accumulation adds to main_grad (always, but on a first microbatch)."""
    save_norm = grad and any(_requires_grad(t) for t in norm_inputs)
    return MLPFlags(
        save_norm=save_norm,
        save_fc1_input=grad and w1.requires_grad,
        save_fc1_out=grad and (save_norm or w1.requires_grad or _requires_grad(b1)),
        save_fc2_input=grad and w2.requires_grad,
        accumulate=not is_first_microbatch if is_first_microbatch is not None else True,
    )


def _returned(m, out, b2, act_dtype, ln_out):
    """The forward's result as eager TE returns it (the unfused bias added, the bias and the
    norm output returned as asked)."""
    if m.gemm_bias_unfused_add:  # set_parallel_mode: TE adds the bias after the GEMM
        out = out + b2.to(act_dtype)
    if m.return_bias:
        bias_out = b2.to(act_dtype) if b2 is not None else None
        if m.return_layernorm_output:
            return out, bias_out, ln_out
        return out, bias_out
    if m.return_layernorm_output:
        return out, ln_out
    return out


def _graph_path_applies(m, cfg: QuantConfig, inp, act_dtype, plumbing) -> bool:
    """The graph path asked for (graph_fp8.linear.wanted), none of the plumbing the graph MLP
    leaves to TE's kernels (FP8 parameters, FP8 weight caching, main_grad, tensor parallelism),
    no returned norm output, and a recipe, activation and shapes graph_fp8.mlp takes."""
    op_w1, op_w2, main1, main2, parallel, is_first_microbatch = plumbing
    if m.return_layernorm_output or parallel:
        return False
    if not graph_linear.wanted(cfg, inp, m.fc1_weight, m.fc2_weight):
        return False
    if is_first_microbatch is not None:
        return False
    if op_w1 is not m.fc1_weight or op_w2 is not m.fc2_weight:  # an FP8 weight's carrier/cache
        return False
    if main1 is not None or main2 is not None:
        return False
    x = inp.view(-1, inp.shape[-1])
    return not graph_mlp.applies(cfg, m.activation, x, m.fc1_weight, m.fc2_weight, act_dtype)


def _checkpointed_forward(self, inp, is_first_microbatch):
    """checkpoint=True: the module's forward recomputed in backward (FC2 included, which eager
    TE skips; the values are the same), through te_compile.checkpoint's FP8-aware policy."""
    if is_first_microbatch is not None and gemm_common.autocast_recipe(NAME)[0]:
        raise _unsupported(
            "checkpoint=True with is_first_microbatch (FP8 weight caching inside a recompute)",
            "pass is_first_microbatch=None, or use checkpoint=False",
        )
    return checkpointing.checkpoint(compiled_forward, self, inp)


def make_forward(original):
    def forward(self, inp, is_first_microbatch=None):
        if not torch.compiler.is_compiling():
            return original(self, inp, is_first_microbatch)
        if self.checkpoint and torch.is_grad_enabled():
            return _checkpointed_forward(self, inp, is_first_microbatch)
        return compiled_forward(self, inp, is_first_microbatch)

    forward.__doc__ = original.__doc__
    return forward


def swaps() -> list[Swap]:
    from transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP

    return [Swap(LayerNormMLP, "forward", make_forward(vars(LayerNormMLP)["forward"]))]
