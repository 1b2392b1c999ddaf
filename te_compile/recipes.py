"""Recipes flattened into plain values, so they can cross a custom-op boundary.

`QuantConfig` holds everything a GEMM layer's ops need to rebuild TE's quantizers and GEMM
arguments. It is built from a TE recipe at trace time (`for_linear`) and crosses the op
boundary as one human-readable string, `cfg.key` (for example
"kind=current;dtypes=e4m3,e4m3,e5m2;pow2=0,0,0;eps=0.0,0.0,0.0;blocks=1,2,1;acc=0,1,1;..."). The
op side decodes it with `QuantConfig.from_key`, cached by value: a step pays one dict lookup,
not a rebuild. This module reads TE recipe objects but never touches a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .spec import Spec, constant_number, labelled, spec

# Roles of the three quantized GEMM operands, in the order of the per-role lists below.
ROLES = ("input", "weight", "grad")
KINDS = ("none", "current", "block", "delayed", "mxfp8", "nvfp4")
# TE's recipe class of each FP8 kind (te_compile.check's recipe names, error messages).
RECIPE_CLASS_NAMES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "block": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
_DTYPES = ("e4m3", "e5m2", "e2m1")  # e2m1: NVFP4's FP4


@spec
class QuantConfig(Spec):
    """One layer's quantization setup. Per-role tuples follow `ROLES`; `split_acc` is
    (fprop, dgrad, wgrad)."""

    kind: str = "none"
    dtypes: tuple[str, str, str] = ("e4m3", "e4m3", "e5m2")
    pow2: tuple[bool, bool, bool] = (False, False, False)
    amax_eps: tuple[float, float, float] = labelled("eps", (0.0, 0.0, 0.0))
    # 1-D or 2-D block scaling per role: Float8BlockScaling's x/w/grad_block_scaling_dim,
    # MXFP8's and NVFP4's with_2d_quantization (2 = on). Unused by per-tensor kinds.
    block_dims: tuple[int, int, int] = labelled("blocks", (1, 2, 1))
    # TE's defaults when the recipe has no fp8_gemm_* fields (module/base.py)
    split_acc: tuple[bool, bool, bool] = labelled("acc", (False, True, True))
    # Per-tensor FP8 keeps column-wise data as a separate transpose unless the GPU runs
    # non-TN FP8 GEMMs (TE's is_non_tn_fp8_gemm_supported): decides saved-tensor shapes.
    fp8_transpose: bool = labelled("transpose", True)
    # NVFP4 only: random Hadamard transform (with post-RHT amax) and stochastic rounding.
    rht: tuple[bool, bool, bool] = (False, False, False)
    stochastic_rounding: tuple[bool, bool, bool] = labelled("sr", (False, False, False))
    # DelayedScaling only: the amax/scale update (amax_compute_algo, margin, TE's fused kernel
    # or its Python fallback), and whether backward ops leave theirs to the autocast exit
    # (`defers_backward_update`).
    amax_algo: str = labelled("algo", "max")
    margin: float = 0.0
    fused_update: bool = labelled("fused", True)
    deferred_update: bool = labelled("defer", False)
    # DelayedScaling with reduce_amax over > 1 rank: the name of the group a backward op's own
    # update reduces amaxes over (kernels/process_groups.py; Python fallback only); "" for none.
    amax_group: str = labelled("group", "")

    def __post_init__(self) -> None:
        # Checked where keys are decoded (op bodies, eager), not while dynamo traces the
        # decoders that build configs: reading these tables there guarded every entry.
        if torch.compiler.is_compiling():
            return
        if self.kind not in KINDS:
            raise ValueError(f"QuantConfig.kind must be one of {KINDS}, got {self.kind!r}")
        for dtype in self.dtypes:
            if dtype not in _DTYPES:
                raise ValueError(f"quantized dtype must be one of {_DTYPES}, got {dtype!r}")
        for dim in self.block_dims:
            if dim not in (1, 2):
                raise ValueError(f"block scaling dims must be 1 or 2, got {self.block_dims}")

    @property
    def fp8(self) -> bool:
        return self.kind != "none"

    @property
    def defers_backward_update(self) -> bool:
        """DelayedScaling under an eager autocast, with TE's fused update: backward ops only
        merge their amaxes into history row 0, and the next outermost autocast exit updates every
        module's backward state at once (te_compile/delayed_updates.py), as eager TE's one
        update per backward does. Otherwise each backward op updates its own state: TE's Python
        fallback rolls every history, and an autocast traced in the graph cannot update a state
        that the backward graph writes."""
        return self.kind == "delayed" and self.fused_update and self.deferred_update

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor (Float8TensorStorage operands)."""
        return self.kind in ("current", "delayed")


@torch.compiler.assume_constant_result
def unfused_update_requested() -> bool:
    """TE's NVTE_UNFUSED_FP8_UPDATE: DelayedScaling updates run TE's Python code instead of its
    fused kernel. Read once per trace (a constant for the compiled code)."""
    return bool(int(os.getenv("NVTE_UNFUSED_FP8_UPDATE", "0")))


def _dtype_name(recipe, fprop: bool) -> str:
    """TE's get_fp8_te_dtype rule: E4M3 everywhere, or HYBRID (E4M3 forward, E5M2 backward)."""
    from transformer_engine.common.recipe import Format

    if recipe.fp8_format == Format.E4M3 or (recipe.fp8_format == Format.HYBRID and fprop):
        return "e4m3"
    return "e5m2"


def _split_acc(recipe) -> tuple[bool, bool, bool]:
    # Looked up in the instance dict (TE's recipes are dataclasses): hasattr's miss on a
    # recipe without them leaves a guard that raises AttributeError on every call. The
    # defaults (QuantConfig.split_acc's) are literals: a module global is a guard per entry.
    fields = vars(recipe)
    return (
        fields["fp8_gemm_fprop"].use_split_accumulator if "fp8_gemm_fprop" in fields else False,
        fields["fp8_gemm_dgrad"].use_split_accumulator if "fp8_gemm_dgrad" in fields else True,
        fields["fp8_gemm_wgrad"].use_split_accumulator if "fp8_gemm_wgrad" in fields else True,
    )


def _qparams(recipe) -> tuple[tuple[bool, bool, bool], tuple[float, float, float]]:
    # Read from the instance: TE declares these as class attributes built from environment
    # defaults, but an instance may override them.
    params = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
    return (
        tuple(bool(p.power_2_scale) for p in params),
        tuple(float(constant_number(p.amax_epsilon)) for p in params),
    )


def for_linear(
    recipe,
    *,
    fp8_transpose: bool,
    fused_update: bool = True,
    deferred_update: bool = False,
    amax_group: str = "",
) -> QuantConfig:
    """The config te.Linear uses for `recipe` (None: no FP8). Only the recipe kinds in `KINDS`
    are handled here; the caller rejects the others first. `fused_update` is False where TE
    runs its Python amax/scale update (NVTE_UNFUSED_FP8_UPDATE=1); `deferred_update` is True
    under an autocast entered outside compiled code (QuantConfig.defers_backward_update); `amax_group` names
    DelayedScaling's amax reduction group."""
    from transformer_engine.common.recipe import (
        DelayedScaling,
        Float8BlockScaling,
        Float8CurrentScaling,
        MXFP8BlockScaling,
        NVFP4BlockScaling,
    )

    if recipe is None:
        return QuantConfig()
    fwd, bwd = _dtype_name(recipe, True), _dtype_name(recipe, False)
    if isinstance(recipe, DelayedScaling):
        if not isinstance(recipe.margin, (int, float)):
            # eager TE fails later, in its first scale update, with a TypeError about float()
            raise TypeError(
                f"DelayedScaling(margin={recipe.margin!r}): margin must be a number. Its first "
                "positional field is margin: pass the format by keyword, "
                "DelayedScaling(fp8_format=Format.HYBRID, ...)."
            )
        # Scales and amax histories are tensors (TE's fp8_meta), passed to the ops separately.
        return QuantConfig(
            kind="delayed",
            dtypes=(fwd, fwd, bwd),
            split_acc=_split_acc(recipe),
            fp8_transpose=fp8_transpose,
            amax_algo=recipe.amax_compute_algo,
            margin=float(constant_number(recipe.margin)),
            fused_update=fused_update,
            deferred_update=deferred_update,
            amax_group=amax_group,
        )
    if isinstance(recipe, MXFP8BlockScaling):
        # MXFP8BlockScalingRecipeState.make_quantizers (quantization.py:1529-1549): E4M3 or
        # HYBRID per direction; 2-D blocks only for Linear's weight, and only with
        # enable_2d_quantization. No fp8_gemm_* fields: TE's split-accumulator defaults.
        return QuantConfig(
            kind="mxfp8",
            dtypes=(fwd, fwd, bwd),
            block_dims=(1, 2 if recipe.enable_2d_quantization else 1, 1),
            split_acc=_split_acc(recipe),
            fp8_transpose=fp8_transpose,
        )
    if isinstance(recipe, NVFP4BlockScaling):
        # NVFP4BlockScalingRecipeState.make_quantizers (quantization.py:1670-1749): per role the
        # recipe's fp4_quant_fwd_inp / fp4_quant_fwd_weight / fp4_quant_bwd_grad (instance
        # attributes set in __post_init__ from the disable_* fields); with_post_rht_amax
        # follows RHT. The caller refuses row-scaled activations and 4over6.
        params = (recipe.fp4_quant_fwd_inp, recipe.fp4_quant_fwd_weight, recipe.fp4_quant_bwd_grad)
        return QuantConfig(
            kind="nvfp4",
            dtypes=("e2m1", "e2m1", "e2m1"),
            block_dims=tuple(2 if p.fp4_2d_quantization else 1 for p in params),
            split_acc=_split_acc(recipe),
            fp8_transpose=fp8_transpose,
            rht=tuple(bool(p.random_hadamard_transform) for p in params),
            stochastic_rounding=tuple(bool(p.stochastic_rounding) for p in params),
        )
    pow2, eps = _qparams(recipe)
    if isinstance(recipe, Float8CurrentScaling):
        # Linear overrides the recipe-state quantizers with the fp8_quant_* params
        # (Linear._customize_quantizers_float8_current_scaling).
        return QuantConfig(
            kind="current",
            dtypes=(fwd, fwd, bwd),
            pow2=pow2,
            amax_eps=eps,
            split_acc=_split_acc(recipe),
            fp8_transpose=fp8_transpose,
        )
    if isinstance(recipe, Float8BlockScaling):
        return QuantConfig(
            kind="block",
            dtypes=(fwd, fwd, bwd),
            pow2=pow2,
            amax_eps=eps,
            block_dims=tuple(
                constant_number(d)
                for d in (
                    recipe.x_block_scaling_dim,
                    recipe.w_block_scaling_dim,
                    recipe.grad_block_scaling_dim,
                )
            ),
            # TE's general_gemm forces the split accumulator for block-scaled operands.
            split_acc=(True, True, True),
            fp8_transpose=fp8_transpose,
        )
    raise TypeError(f"no QuantConfig for {type(recipe).__name__}")


@dataclass(frozen=True)
class DelayedFields:
    """The DelayedScaling fields that decide TE's fp8_meta state and its update, as plain
    values (equal recipes give equal fields, so a fresh recipe object does not recompile)."""

    margin: int
    fp8_format: str  # a Format member name
    amax_history_len: int
    amax_compute_algo: str
    reduce_amax: bool
    fp8_dpa: bool
    fp8_mha: bool

    @staticmethod
    def values_of(recipe) -> tuple:
        """The fields in declaration order, as a tuple: traced code builds no dataclass."""
        return (
            constant_number(recipe.margin),
            recipe.fp8_format.name,
            constant_number(recipe.amax_history_len),
            recipe.amax_compute_algo,
            recipe.reduce_amax,
            recipe.fp8_dpa,
            recipe.fp8_mha,
        )

    def recipe(self):
        """An equal DelayedScaling (same repr, so the same TE global-buffer key)."""
        from transformer_engine.common.recipe import DelayedScaling, Format

        return DelayedScaling(
            margin=self.margin,
            fp8_format=Format[self.fp8_format],
            amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
            reduce_amax=self.reduce_amax,
            fp8_dpa=self.fp8_dpa,
            fp8_mha=self.fp8_mha,
        )
