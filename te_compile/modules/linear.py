"""te.Linear under torch.compile: the patched `Linear.forward`.

Not compiling: TE's own forward, unchanged. While dynamo traces: this module reads the autocast
state and the module's configuration (trace-time constants), refuses what it does not
implement, and calls `te_compile::linear_fwd`, whose autograd formula calls
`te_compile::linear_bwd`. It never calls TE's `prepare_forward` (which allocates and queries
the driver) and writes no module state, so a traced step is replayable as is.

Recipes: none (bf16/fp16/fp32), Float8CurrentScaling, Float8BlockScaling, DelayedScaling,
MXFP8BlockScaling and NVFP4BlockScaling (the last two on Blackwell, as in eager TE).
DelayedScaling's per-module amax/scale state is TE's own `fp8_meta`; FP8 weight caches
(is_first_microbatch) are tensors on the module. Both are created at trace time
(persistent_state.py) and mutated in place by the ops.
"""

from __future__ import annotations

import math

import torch

from .. import ops  # noqa: F401  (registers the te_compile ops)
from ..errors import UnsupportedUnderCompileError
from ..ops.fp8_operands import CACHEABLE_KINDS
from ..patching import Swap
from ..recipes import DelayedFields, QuantConfig, for_linear, unfused_update_requested
from . import persistent_state

# Devices the compiled path accepts. Tests add "meta" to trace backward without a GPU (the
# autograd engine queries the CUDA driver for fake CUDA tensors).
DEVICE_TYPES = ("cuda",)
_WAY_OUT = "run this module outside torch.compile (or wrap the call in torch.compiler.disable)"


def _unsupported(option: str, fix: str = "") -> UnsupportedUnderCompileError:
    fix = f"{fix}, or {_WAY_OUT}" if fix else _WAY_OUT
    return UnsupportedUnderCompileError(
        f"te.Linear with {option} is not supported under torch.compile by te_compile; {fix}."
    )


def _check_module(m, is_first_microbatch, fp8_output, fp8_grad, cfg: QuantConfig) -> None:
    """Every te.Linear option eager TE honours that this path does not: raise, naming it."""
    from transformer_engine.debug.pytorch.debug_state import TEDebugState
    from transformer_engine.pytorch import cpu_offload, distributed

    fp8 = cfg.fp8
    if m.fuse_wgrad_accumulation:
        weight = getattr(m, m.weight_names[0])
        if getattr(weight, "main_grad", None) is None:
            raise RuntimeError(
                "te.Linear(fuse_wgrad_accumulation=True) needs weight.main_grad to be set "
                "before the forward (te_compile reads it when tracing)"
            )
        for attr in ("grad_added_to_main_grad", "overwrite_main_grad", "zero_out_wgrad"):
            if hasattr(weight, attr):
                raise _unsupported(
                    f"fuse_wgrad_accumulation with a weight carrying {attr!r} (Megatron-Core "
                    "DDP's hook attributes)",
                    "accumulate into weight.main_grad without those attributes",
                )
    if fp8 and is_first_microbatch is not None and cfg.kind not in CACHEABLE_KINDS:
        raise _unsupported(
            f"is_first_microbatch (FP8 weight caching) with {cfg.kind}",
            "pass is_first_microbatch=None",
        )
    # Without FP8 these are inert in eager TE (no quantizers), so only FP8 refuses them.
    if fp8 and fp8_output:
        raise _unsupported("fp8_output=True", "pass fp8_output=False")
    if fp8 and fp8_grad:
        raise _unsupported("fp8_grad=True", "pass fp8_grad=False")
    for name in (
        "ub_overlap_rs_fprop",
        "ub_overlap_ag_fprop",
        "ub_overlap_rs_dgrad",
        "ub_overlap_ag_dgrad",
        "ub_bulk_dgrad",
        "ub_bulk_wgrad",
    ):
        if getattr(m, name, False):
            raise _unsupported(f"userbuffers overlap ({name}=True)", f"set {name}=False")
    if m.tp_size > 1 or m.sequence_parallel:
        raise _unsupported(
            "tensor/sequence parallelism (tp_size > 1 or sequence_parallel=True)",
            "use tp_size=1 and sequence_parallel=False",
        )
    if m.fsdp_group is not None:
        raise _unsupported("TE-managed FSDP (fsdp_group)", "use FSDP2")
    if m.wgrad_store is not None and m.wgrad_store.delay_wgrad_compute():
        raise _unsupported("delay_wgrad_compute=True", "set delay_wgrad_compute=False")
    if m.save_original_input:
        raise _unsupported("save_original_input=True", "set save_original_input=False")
    if len(m.weight_names) != 1:
        raise _unsupported("parameters_split", "use one weight parameter")
    if m.primary_weights_in_fp8 or _is_quantized(getattr(m, m.weight_names[0])):
        raise _unsupported(
            "FP8 parameters (quantized_model_init)", "create the module with high-precision weights"
        )
    if TEDebugState.debug_enabled:
        raise _unsupported("TE debug mode (nvidia-dlfw-inspect)", "disable TE debug")
    if cpu_offload.is_cpu_offload_enabled():
        raise _unsupported("CPU activation offloading", "disable CPU offload")
    if distributed.is_fp8_activation_recompute_enabled():
        raise _unsupported("TE activation recompute (te.distributed.checkpoint) with FP8")


def _is_quantized(t) -> bool:
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

    return isinstance(t, QuantizedTensorStorage)


def _quant_config(recipe) -> QuantConfig:
    from transformer_engine.common import recipe as R

    supported = (
        R.DelayedScaling,
        R.Float8CurrentScaling,
        R.Float8BlockScaling,
        R.MXFP8BlockScaling,
        R.NVFP4BlockScaling,
    )
    if not isinstance(recipe, supported):
        raise _unsupported(
            f"the {type(recipe).__name__} recipe",
            "use DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling or "
            "NVFP4BlockScaling under compile",
        )
    if isinstance(recipe, R.DelayedScaling):
        _check_delayed(recipe)
    if isinstance(recipe, R.NVFP4BlockScaling):
        _check_nvfp4(recipe)
    if recipe.backward_override is not None:
        raise _unsupported(
            f"backward_override={recipe.backward_override!r}",
            "use a recipe with backward_override=None (and NVTE_BACKWARD_OVERRIDE unset)",
        )
    return for_linear(
        recipe, fp8_transpose=_fp8_transpose_layout(), fused_update=not unfused_update_requested()
    )


@torch.compiler.assume_constant_result
def _fp8_transpose_layout() -> bool:
    """Whether per-tensor FP8 keeps a separate transpose: TE's is_non_tn_fp8_gemm_supported
    rule, decided once at trace time from TE's cached capability (no driver call is traced;
    comparing the capability tuple in traced code trips dynamo on torch 2.11)."""
    from transformer_engine.pytorch import utils

    cc = utils.get_device_compute_capability()
    return not ((10, 0) <= cc < (12, 0) or cc >= (13, 0))


def _check_nvfp4(recipe) -> None:
    """NVFP4 options whose quantizers and storages the compiled path does not rebuild."""
    if recipe.row_scaled_activation:
        raise _unsupported(
            "NVFP4BlockScaling(row_scaled_activation=True)",
            "use row_scaled_activation=False (NVTE_NVFP4_ROW_SCALED_ACTIVATION unset)",
        )
    if recipe.nvfp4_4over6 != "none":
        raise _unsupported(
            f"NVFP4BlockScaling(nvfp4_4over6={recipe.nvfp4_4over6!r})",
            "use nvfp4_4over6='none' (NVTE_NVFP4_4OVER6 unset)",
        )


def _check_delayed(recipe) -> None:
    if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
        raise _unsupported(
            "a DelayedScaling with a callable amax_compute_algo or scaling_factor_compute_algo",
            "use amax_compute_algo='max' or 'most_recent' and no scaling_factor_compute_algo",
        )
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

    group = state.get_fp8_group()
    if group is not None and recipe.reduce_amax:
        raise _unsupported(
            "DelayedScaling amax reduction over te.autocast(amax_reduction_group=...)",
            "set reduce_amax=False",
        )


def _delayed_state(m, recipe, grad_needed: bool) -> tuple[list, list]:
    """TE's fp8_meta tensors for the ops, created at trace time (see persistent_state.py)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

    fields = DelayedFields.values_of(recipe)
    persistent_state.ensure_delayed_states(fields, 1)
    if getattr(m, persistent_state.DELAYED_ATTR, None) != fields:
        persistent_state.reinit_delayed_state(id(m), fields, 1)  # made for another recipe
    fwd, bwd = m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]
    # Eager TE lets the first FP8 module of an autocast (by forward order, with grad) run the
    # backward update of every registered state; each compiled module updates its own state at
    # the end of its backward instead (linear_bwd). The flag is still consumed, as TE does.
    if grad_needed:
        state.is_first_fp8_module()
    return [fwd.scale, fwd.amax_history[0]], [bwd.scale, bwd.amax_history]


def _cached_weight(m, weight, cfg: QuantConfig, fwd_state: list, refresh: bool) -> list:
    """The module's FP8 weight cache for `cfg`, refreshed as eager TE refreshes its weight
    workspace: always on a first microbatch, otherwise only while it holds nothing."""
    persistent_state.ensure_weight_caches(cfg.key, tuple(weight.shape), str(weight.dtype))
    valid, parts = getattr(m, persistent_state.WEIGHT_CACHES_ATTR)[cfg.key]
    scale, amax = fwd_state or [None, None]
    torch.ops.te_compile.quantize_weight(weight, parts, valid, scale, amax, cfg.key, refresh)
    return parts


def _activation_dtype(m, inp: torch.Tensor) -> torch.dtype:
    """TE's set_activation_dtype, without writing it to the module."""
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    for name, param in m.named_parameters():
        if param is not None and param.dtype != inp.dtype:
            raise TypeError(
                "Data types for parameters must match when outside of autocasted region. "
                f"Found input dtype: {inp.dtype} and {name!r} dtype: {param.dtype}"
            )
    return inp.dtype


def _check_input(inp: torch.Tensor, weight: torch.Tensor, fp8: bool) -> None:
    if _is_quantized(inp):
        raise _unsupported("a quantized input tensor", "pass a high-precision tensor")
    if inp.device.type not in DEVICE_TYPES or weight.device.type not in DEVICE_TYPES:
        raise RuntimeError(
            "TransformerEngine needs CUDA: got input on "
            f"{inp.device} and weight on {weight.device}."
        )
    if inp.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"te.Linear: input's last dimension {inp.shape[-1]} does not match "
            f"in_features={weight.shape[1]}"
        )
    if fp8:
        for name, t in (("input", inp), ("weight", weight)):
            if math.prod(t.shape[:-1]) % 8 != 0 or t.shape[-1] % 16 != 0:
                raise ValueError(
                    f"FP8 execution requires the {name}'s product of all dimensions except "
                    "the last to be divisible by 8 and its last dimension to be divisible by "
                    f"16, got {list(t.shape)}"
                )


def compiled_forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
    """The traceable te.Linear forward (see the module docstring)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

    fp8 = state.is_fp8_enabled()
    if state.is_fp8_calibration():
        raise _unsupported("te.autocast(calibrating=True)", "calibrate eagerly")
    recipe = state.get_fp8_recipe() if fp8 else None
    cfg = _quant_config(recipe) if fp8 else QuantConfig()
    _check_module(self, is_first_microbatch, fp8_output, fp8_grad, cfg)

    weight = getattr(self, self.weight_names[0])
    bias = getattr(self, self.bias_names[0]) if self.use_bias else None
    _check_input(inp, weight, fp8)
    act_dtype = _activation_dtype(self, inp)
    inp = inp.contiguous()

    fused_bias = bias if (self.apply_bias and not self.gemm_bias_unfused_add) else None
    grad = torch.is_grad_enabled()
    # What backward reads, decided as eager TE decides it (from requires_grad at forward).
    save_input = grad and weight.requires_grad
    save_weight = grad and inp.requires_grad
    grad_needed = grad and (
        inp.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    fwd_state, bwd_state = [], []
    if cfg.kind == "delayed":
        fwd_state, bwd_state = _delayed_state(self, recipe, grad_needed)
    elif fp8 and grad_needed:
        state.is_first_fp8_module()  # consumed as eager TE consumes it (no state to update)
    weight_cache = []
    if fp8 and is_first_microbatch is not None:
        weight_cache = _cached_weight(self, weight, cfg, fwd_state, bool(is_first_microbatch))
    main_grad = weight.main_grad if self.fuse_wgrad_accumulation else None
    # fuse_wgrad_accumulation adds to main_grad, except on a first microbatch (TE's rule).
    accumulate = not is_first_microbatch if is_first_microbatch is not None else True
    outputs = torch.ops.te_compile.linear_fwd(
        inp,
        weight,
        fused_bias,
        fwd_state,
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
    if fwd_state:  # the forward amaxes the quantizers recorded, into TE's history (row 0)
        fwd_state[1].copy_(outputs[-1])
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

    return [Swap(Linear, "forward", make_forward(vars(Linear)["forward"]))]
