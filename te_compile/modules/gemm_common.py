"""What the compile paths of TE's GEMM modules (te.Linear, te.LayerNormLinear,
te.LayerNormMLP) share at trace time: the recipe as a `QuantConfig`, the options they refuse,
the activation dtype, DelayedScaling state, FP8 weight caches, and the one-GEMM modules' forward
skeleton (begin_forward, gemm_state, end_forward). Error messages name the module (`name`).

Everything here runs while dynamo traces a patched forward: it reads module attributes and the
autocast state as trace-time constants (each read a guard run every call: tests/cpu/test_guards.py)
and calls only traceable code (or `assume_constant_result` functions, see persistent_state.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..errors import UnsupportedUnderCompileError
from ..kernels.fp8_operands import CACHEABLE_KINDS
from ..kernels.process_groups import reduction_group_name
from ..recipes import QuantConfig, for_linear, unfused_update_requested
from . import delayed_state, persistent_state

WAY_OUT = "run this module outside torch.compile (or wrap the call in torch.compiler.disable)"


def unsupported(name: str, option: str, fix: str = "") -> UnsupportedUnderCompileError:
    """The error for a TE option the compiled path of module `name` does not implement."""
    fix = f"{fix}, or {WAY_OUT}" if fix else WAY_OUT
    return UnsupportedUnderCompileError(
        f"{name} with {option} is not supported under torch.compile by te_compile; {fix}."
    )


def is_quantized(t) -> bool:
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

    return isinstance(t, QuantizedTensorStorage)


# ---- recipe ------------------------------------------------------------------------------------


def quant_config(name: str, recipe) -> QuantConfig:
    """The QuantConfig of `recipe` (None: no FP8) for module `name`'s GEMMs; refuses recipes
    and recipe options the compiled path does not rebuild."""
    if recipe is None:
        return QuantConfig()
    from transformer_engine.common import recipe as R

    supported = (
        R.DelayedScaling,
        R.Float8CurrentScaling,
        R.Float8BlockScaling,
        R.MXFP8BlockScaling,
        R.NVFP4BlockScaling,
    )
    if not isinstance(recipe, supported):
        raise unsupported(
            name,
            f"the {type(recipe).__name__} recipe",
            "use DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling or "
            "NVFP4BlockScaling under compile",
        )
    if isinstance(recipe, R.DelayedScaling):
        _check_delayed(name, recipe)
    if isinstance(recipe, R.NVFP4BlockScaling):
        _check_nvfp4(name, recipe)
    if recipe.backward_override is not None:
        raise unsupported(
            name,
            f"backward_override={recipe.backward_override!r}",
            "use a recipe with backward_override=None (and NVTE_BACKWARD_OVERRIDE unset)",
        )
    amax_group, deferred = "", False
    if isinstance(recipe, R.DelayedScaling):
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

        amax_group = reduction_group_name(recipe.reduce_amax, state.get_fp8_group())
        deferred = persistent_state.autocast_is_eager()
        if deferred:
            persistent_state.note_deferred_update()
    return for_linear(
        recipe,
        fp8_transpose=fp8_transpose_layout(),
        fused_update=not unfused_update_requested(),
        deferred_update=deferred,
        amax_group=amax_group,
    )


@torch.compiler.assume_constant_result
def fp8_transpose_layout() -> bool:
    """Whether per-tensor FP8 keeps a separate transpose: TE's is_non_tn_fp8_gemm_supported
    rule, decided once at trace time from TE's cached capability (no driver call is traced;
    comparing the capability tuple in traced code trips dynamo on torch 2.11)."""
    from transformer_engine.pytorch import utils

    cc = utils.get_device_compute_capability()
    return not ((10, 0) <= cc < (12, 0) or cc >= (13, 0))


def _check_nvfp4(name: str, recipe) -> None:
    """NVFP4 options whose quantizers and storages the compiled path does not rebuild."""
    if recipe.row_scaled_activation:
        raise unsupported(
            name,
            "NVFP4BlockScaling(row_scaled_activation=True)",
            "use row_scaled_activation=False (NVTE_NVFP4_ROW_SCALED_ACTIVATION unset)",
        )
    if recipe.nvfp4_4over6 != "none":
        raise unsupported(
            name,
            f"NVFP4BlockScaling(nvfp4_4over6={recipe.nvfp4_4over6!r})",
            "use nvfp4_4over6='none' (NVTE_NVFP4_4OVER6 unset)",
        )


def _check_delayed(name: str, recipe) -> None:
    if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
        raise unsupported(
            name,
            "a DelayedScaling with a callable amax_compute_algo or scaling_factor_compute_algo",
            "use amax_compute_algo='max' or 'most_recent' and no scaling_factor_compute_algo",
        )


def autocast_recipe(name: str):
    """(fp8 enabled, recipe or None) of the current te.autocast, read at trace time."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as state

    fp8 = state.is_fp8_enabled()
    if state.is_fp8_calibration():
        raise unsupported(name, "te.autocast(calibrating=True)", "calibrate eagerly")
    return fp8, (state.get_fp8_recipe() if fp8 else None)


# ---- options -----------------------------------------------------------------------------------


def check_module_options(
    name: str,
    m,
    weights: list,
    *,
    is_first_microbatch,
    fp8_output: bool,
    fp8_grad: bool,
    cfg: QuantConfig,
) -> None:
    """The options every TE GEMM module shares that the compiled path does not implement:
    raise, naming them. `weights` are the module's GEMM weight parameters. (Tensor
    parallelism: tensor_parallel.py.)"""
    from transformer_engine.debug.pytorch.debug_state import TEDebugState
    from transformer_engine.pytorch import cpu_offload, distributed

    fp8 = cfg.fp8
    if m.fuse_wgrad_accumulation:
        for weight in weights:
            check_main_grad(name, weight)
    if fp8 and is_first_microbatch is not None and cfg.kind not in CACHEABLE_KINDS:
        raise unsupported(
            name,
            f"is_first_microbatch (FP8 weight caching) with {cfg.kind}",
            "pass is_first_microbatch=None",
        )
    # Without FP8 these are inert in eager TE (no quantizers), so only FP8 refuses them.
    if fp8 and fp8_output:
        raise unsupported(name, "fp8_output=True", "pass fp8_output=False")
    if fp8 and fp8_grad:
        raise unsupported(name, "fp8_grad=True", "pass fp8_grad=False")
    # The instance dict (TE sets them in __init__): a getattr miss would leave a guard running
    # nn.Module.__getattr__'s miss path every call (half a TransformerLayer's guard time).
    options = m.__dict__
    # Userbuffers: the names written here, as code constants; a module-global tuple read while
    # tracing puts a guard on each entry.
    for option in (
        "ub_overlap_rs_fprop",
        "ub_overlap_ag_fprop",
        "ub_overlap_rs_dgrad",
        "ub_overlap_ag_dgrad",
        "ub_overlap_rs",
        "ub_overlap_ag",
        "ub_bulk_dgrad",
        "ub_bulk_wgrad",
    ):
        if options.get(option, False):
            raise unsupported(name, f"userbuffers overlap ({option}=True)", f"set {option}=False")
    if m.fsdp_group is not None:
        raise unsupported(name, "TE-managed FSDP (fsdp_group)", "use FSDP2")
    if m.wgrad_store is not None and m.wgrad_store.delay_wgrad_compute():
        raise unsupported(name, "delay_wgrad_compute=True", "set delay_wgrad_compute=False")
    # FP8 parameters (quantized_model_init): fp8_params.check, called by each module.
    if TEDebugState.debug_enabled:
        raise unsupported(name, "TE debug mode (nvidia-dlfw-inspect)", "disable TE debug")
    if cpu_offload.is_cpu_offload_enabled():
        raise unsupported(name, "CPU activation offloading", "disable CPU offload")
    if distributed.is_fp8_activation_recompute_enabled():
        raise unsupported(name, "TE activation recompute (te.distributed.checkpoint) with FP8")


def check_main_grad(name: str, weight) -> None:
    if getattr(weight, "main_grad", None) is None:
        raise RuntimeError(
            f"{name}(fuse_wgrad_accumulation=True) needs weight.main_grad to be set "
            "before the forward (te_compile reads it when tracing)"
        )
    for attr in ("grad_added_to_main_grad", "overwrite_main_grad", "zero_out_wgrad"):
        if hasattr(weight, attr):
            raise unsupported(
                name,
                f"fuse_wgrad_accumulation with a weight carrying {attr!r} (Megatron-Core "
                "DDP's hook attributes)",
                "accumulate into weight.main_grad without those attributes",
            )


# ---- tensors -----------------------------------------------------------------------------------


def activation_dtype(m, inp: torch.Tensor) -> torch.dtype:
    """TE's set_activation_dtype, not writing to the module; its own parameters (TE's GEMM
    modules have none in submodules: recursing costs a fifth of a layer's guard time)."""
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    for pname, param in m.named_parameters(recurse=False):
        if param is not None and param.dtype != inp.dtype:
            raise TypeError(
                "Data types for parameters must match when outside of autocasted region. "
                f"Found input dtype: {inp.dtype} and {pname!r} dtype: {param.dtype}"
            )
    return inp.dtype


def check_device(*tensors: torch.Tensor) -> None:
    # On "meta" our ops run their fake kernels: simulate_gpu traces that way without a GPU (the
    # autograd engine asks the CUDA driver about every CUDA tensor). The devices are a literal,
    # not a module global, which dynamo would guard on every call.
    if any(t.device.type not in ("cuda", "meta") for t in tensors):
        devices = ", ".join(str(t.device) for t in tensors)
        raise RuntimeError(f"TransformerEngine needs CUDA: got tensors on {devices}.")


def check_fp8_dims(**tensors: torch.Tensor) -> None:
    """TE's assert_dim_for_fp8_exec, as a ValueError naming the tensor."""
    for tname, t in tensors.items():
        if math.prod(t.shape[:-1]) % 8 != 0 or t.shape[-1] % 16 != 0:
            msg = "product of all dimensions but the last divisible by 8, the last by 16, got"
            raise ValueError(f"FP8 execution requires the {tname}'s {msg} {list(t.shape)}")


# ---- persistent state --------------------------------------------------------------------------


def cached_weight(
    m, name: str, weight, cfg: QuantConfig, fwd_state: list, refresh: bool, gemm: int = 0
):
    """The module's FP8 cache of GEMM weight `name` (persistent_state.gemm_weight_spec) for
    `cfg`, refreshed as eager TE refreshes its weight workspace: always on a first
    microbatch, otherwise only while it holds nothing. `gemm` picks the GEMM's DelayedScaling
    slots (TE's 3 forward slots per GEMM)."""
    prepared = persistent_state.is_prepared(m)
    persistent_state.ensure_weight_caches(
        cfg.key, name, tuple(weight.shape), str(weight.dtype), prepared
    )
    caches = getattr(m, persistent_state.WEIGHT_CACHES_ATTR)
    valid, parts = caches[persistent_state.cache_key(name, cfg.key)]
    scale, amax = fwd_state or [None, None]
    if fwd_state and gemm:
        scale, amax = scale[3 * gemm : 3 * gemm + 3], amax[3 * gemm : 3 * gemm + 3]
    torch.ops.te_compile.quantize_weight(weight, parts, valid, scale, amax, cfg.key, refresh)
    return parts


# ---- the compiled forward's skeleton (te.Linear, te.LayerNormLinear) ---------------------------


def concat_split(tensors: list) -> torch.Tensor:
    """TE's noop_cat of split parameters, in the graph: one tensor of their rows."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class GemmInputs(NamedTuple):
    """A one-GEMM module's forward, as read at trace time (`begin_forward`)."""

    cfg: QuantConfig
    recipe: object  # None without FP8
    weight: torch.Tensor  # the split weights concatenated
    bias: torch.Tensor | None
    fused_bias: torch.Tensor | None  # the bias the GEMM adds (None when added after it)
    act_dtype: torch.dtype


class GemmState(NamedTuple):
    """What a one-GEMM module's forward op gets besides its inputs (`gemm_state`)."""

    fwd_state: list  # DelayedScaling: TE's [scale, amax_history[0]] (merged in `end_forward`)
    bwd_state: list
    op_weight: torch.Tensor  # the weight, or an FP8 parameter's gradient carrier
    weight_cache: list
    main_grad: torch.Tensor | None
    accumulate: bool


def begin_forward(
    name: str, m, inp, *, is_first_microbatch, fp8_output, fp8_grad, on_device=()
) -> GemmInputs:
    """The recipe, refusals and checks of a one-GEMM module's compiled forward. `on_device`:
    names of other module tensors that must be on the GPU (read here: reads order the graph)."""
    from . import fp8_params  # (it imports this module)

    fp8, recipe = autocast_recipe(name)
    cfg = quant_config(name, recipe)
    if m.fuse_wgrad_accumulation and len(m.weight_names) > 1:
        raise unsupported(
            name, "fuse_wgrad_accumulation with parameters_split", "use one weight parameter"
        )
    weights = [getattr(m, n) for n in m.weight_names]
    check_module_options(
        name,
        m,
        weights,
        is_first_microbatch=is_first_microbatch,
        fp8_output=fp8_output,
        fp8_grad=fp8_grad,
        cfg=cfg,
    )
    fp8_params.check(name, m, weights, cfg)
    weight = concat_split(weights)
    bias = concat_split([getattr(m, n) for n in m.bias_names]) if m.use_bias else None
    if is_quantized(inp):
        raise unsupported(name, "a quantized input tensor", "pass a high-precision tensor")
    check_device(inp, weight, *(getattr(m, n) for n in on_device))
    if inp.shape[-1] != weight.shape[1]:
        msg = f"input's last dimension {inp.shape[-1]} does not match in_features={weight.shape[1]}"
        raise ValueError(f"{name}: {msg}")
    if fp8:
        check_fp8_dims(input=inp, weight=weight)
    fused = bias if (m.apply_bias and not m.gemm_bias_unfused_add) else None
    return GemmInputs(cfg, recipe, weight, bias, fused, activation_dtype(m, inp))


def gemm_state(m, g: GemmInputs, is_first_microbatch) -> GemmState:
    """DelayedScaling state, the op's weight (an FP8 parameter enters as its gradient carrier
    and its parts, fp8_params.py; else the weight and its FP8 cache) and main_grad."""
    from . import fp8_params

    fwd_state, bwd_state = delayed_state.fp8_module_state(m, g.recipe, g.cfg)
    op_weight, weight_cache = fp8_params.gemm_weight(
        m, "weight", g.weight, g.cfg, fwd_state, is_first_microbatch
    )
    main_grad = g.weight.main_grad if m.fuse_wgrad_accumulation else None
    # fuse_wgrad_accumulation adds to main_grad, except on a first microbatch (TE's rule).
    accumulate = not is_first_microbatch if is_first_microbatch is not None else True
    return GemmState(fwd_state, bwd_state, op_weight, weight_cache, main_grad, accumulate)


def end_forward(m, g: GemmInputs, s: GemmState, out, amaxes) -> torch.Tensor:
    """`amaxes` (the op's last output) merged into TE's history; the bias added if unfused."""
    delayed_state.merge_forward_amaxes(s.fwd_state, amaxes)
    if m.gemm_bias_unfused_add:  # row-parallel: TE adds the bias after the GEMM
        out = out + g.bias.to(g.act_dtype)
    return out
