"""FP8 primary weights (`te.quantized_model_init`) in the compiled GEMM modules.

A module built under `te.quantized_model_init(recipe=...)` holds its GEMM weights as TE
QuantizedTensors: Float8Tensor (DelayedScaling, Float8CurrentScaling) or Float8BlockwiseQTensor
(Float8BlockScaling); the optimizer keeps the high-precision master weights and re-quantizes
the parameters after each step. Dynamo cannot pass a QuantizedTensor to an op (making its fake
tensor fails), but it traces reads of the plain tensors it holds. So each FP8 weight enters the
GEMM op as two things:

- Its parts, in the layout of an FP8 weight cache (kernels/fp8_operands.py): the op reads them
  instead of quantizing, as eager TE's GEMM reads the parameter (TE's `quantize_weight` hands a
  QuantizedTensor parameter over as it is, with its own scale_inv), and backward saves their
  column-wise half. Per-tensor FP8 with a separate transpose (Hopper) reads the parameter's
  transpose whenever TE considers it valid, as eager TE does; otherwise (none, or
  `_transpose_invalid`) the graph makes it from the data: a byte transpose, the bytes
  `tex.fp8_transpose` writes. Unlike eager TE, that transpose is not stored on the parameter.
- A gradient carrier as the op's `weight` argument: a plain leaf tensor with the weight's shape
  and dtype but stride 0 (one element of storage), made once per parameter at trace time
  (`ensure_grad_carriers`, an assume_constant_result function as in persistent_state.py). The
  op's autograd formula gives it the weight gradient; its post-accumulate-grad hook hands that
  gradient to the parameter through `torch.autograd.backward(param, grad)`, so the
  parameter's own AccumulateGrad sets or adds `param.grad` exactly as in eager TE, and hooks
  registered on the parameter run as in eager TE. (Cost: when `param.grad` is None autograd
  copies the gradient instead of taking it over, since the hook still holds it.)

Dynamo guards a Float8Tensor parameter on its `__tensor_flatten__` context, which it deep-copies
and compares with `==`. That context holds the parameter's quantizer; DelayedScaling's
Float8Quantizer compares by identity, so the copy never equals it and dynamo fails with "Guard
failed on the same frame it was created". While patched, a Float8Tensor's context
(`FlattenContext`) keeps its quantizer by reference when copied and compares a
Float8Quantizer by its configuration (type, FP8 dtype, usages): no compiled path reads more of
a parameter's quantizer, and identical layers compiled one by one share one graph.

DelayedScaling: the weight's amax comes from the optimizer's cast (TE's FusedAdam writes it into
the module's amax history), as in eager TE; the forward op quantizes no weight, so its amax for
the weight slot is 0 and the max-merge into TE's history keeps the optimizer's amax.
"""

from __future__ import annotations

import copy
import weakref

import torch

from ..graph_fp8 import weight as graph_weight
from ..kernels.te_dtypes import te_fp8_dtype
from ..patching import Swap
from ..recipes import RECIPE_CLASS_NAMES, QuantConfig
from . import gemm_common, persistent_state

CARRIER_ATTR = "_te_compile_grad_carrier"  # on an FP8 parameter: its GradCarrier
KINDS = ("current", "delayed", "block")  # recipes whose FP8 parameters the compiled path reads


def _quantizer_class(kind: str) -> type:
    """The TE quantizer class an FP8 parameter made for recipe kind `kind` carries."""
    from transformer_engine.pytorch.tensor import float8_blockwise_tensor as block
    from transformer_engine.pytorch.tensor import float8_tensor as per_tensor

    if kind == "block":
        return block.Float8BlockQuantizer
    if kind == "delayed":
        return per_tensor.Float8Quantizer
    return per_tensor.Float8CurrentScalingQuantizer


class GradCarrier:
    """An FP8 parameter's gradient carrier (see the module docstring). `owner` is a weak
    reference to the parameter: a carrier copied with its parameter (deepcopy) still points
    at the original, so `ensure_grad_carriers` replaces it."""

    def __init__(self, param):
        shape = tuple(param.shape)
        self.tensor = torch.empty_strided(
            shape, [0] * len(shape), dtype=param.dtype, device=param.device, requires_grad=True
        )
        self.owner = weakref.ref(param)
        self.tensor.register_post_accumulate_grad_hook(self._hand_over)

    def _hand_over(self, carrier: torch.Tensor) -> None:
        grad, carrier.grad = carrier.grad, None
        if grad is None:  # autograd runs this hook for an undefined gradient too
            return
        param = self.owner()
        if param is None or getattr(param, CARRIER_ATTR, None) is not self:
            raise RuntimeError(
                "te_compile: a gradient for an FP8 parameter that no longer exists (or was "
                "copied after compiling); compile the model again"
            )
        torch.autograd.backward(param, grad)


def fp8_weight_names(module) -> tuple[str, ...]:
    """The GEMM weight parameters of a TE GEMM module (te.Linear and te.LayerNormLinear:
    `weight_names`; te.LayerNormMLP: fc1_weight, fc2_weight)."""
    names = getattr(module, "weight_names", None)
    return tuple(names) if names else ("fc1_weight", "fc2_weight")


@torch.compiler.assume_constant_result
def ensure_grad_carriers(prepared: bool = False) -> bool:
    """A GradCarrier on every FP8 GEMM weight of every live TE GEMM module (`prepared`: every
    prepared one, no scan) that has none of its own. Takes no module (see persistent_state.py:
    nothing in a trace names an instance)."""
    for module in persistent_state._modules(prepared):
        for name in fp8_weight_names(module):
            param = getattr(module, name, None)
            if not gemm_common.is_quantized(param):
                continue
            carrier = param.__dict__.get(CARRIER_ATTR)
            if carrier is None or carrier.owner() is not param:
                setattr(param, CARRIER_ATTR, GradCarrier(param))
    return True


# ---- checks ------------------------------------------------------------------------------------


def check(name: str, m, weights: list, cfg: QuantConfig) -> None:
    """Refuse, naming the option, what the compiled path does not read of FP8 parameters;
    raise TE's own errors where eager TE raises."""
    fp8_weights = [w for w in weights if gemm_common.is_quantized(w)]
    if not fp8_weights:
        if m.primary_weights_in_fp8 and cfg.kind in ("mxfp8", "nvfp4"):
            # eager TE then quantizes the weight without pre-swizzled scales
            raise gemm_common.unsupported(
                name, f"primary_weights_in_fp8=True with {cfg.kind}", "create the module normally"
            )
        return
    if len(weights) > 1:
        raise RuntimeError("Splitting QuantizedTensor into multiple params is not supported")
    if not cfg.fp8:
        raise gemm_common.unsupported(
            name,
            "FP8 parameters (quantized_model_init) outside an FP8 te.autocast",
            "run the module under te.autocast(enabled=True, recipe=...) with the recipe the "
            "parameters were made for",
        )
    if cfg.kind not in KINDS:
        raise gemm_common.unsupported(
            name,
            f"FP8 parameters (quantized_model_init) with {cfg.kind}",
            "use high-precision weights with that recipe",
        )
    for w in fp8_weights:
        _check_weight(name, w, cfg)


def _check_weight(name: str, w, cfg: QuantConfig) -> None:
    quantizer = w._quantizer
    if quantizer is not None and not isinstance(quantizer, _quantizer_class(cfg.kind)):
        # TE's _check_weight_tensor_recipe_correspondence raises for the same mismatch
        raise RuntimeError(
            f"{name}: recipe mismatch: the FP8 parameter's quantizer is a "
            f"{type(quantizer).__name__}, which {RECIPE_CLASS_NAMES[cfg.kind]} (the autocast's "
            "recipe) does not use; check the recipes of quantized_model_init() and te.autocast()"
        )
    if _dtype_value(w._fp8_dtype) != _dtype_value(te_fp8_dtype(cfg.dtypes[1])):
        raise gemm_common.unsupported(
            name,
            "an FP8 parameter whose FP8 dtype is not the autocast recipe's weight dtype",
            "use the same fp8_format in quantized_model_init and te.autocast",
        )
    if cfg.per_tensor and w._data is None:
        raise gemm_common.unsupported(
            name, "a column-wise-only FP8 parameter", "keep the parameter's row-wise data"
        )
    if cfg.kind == "block":
        if w._is_2D_scaled != (cfg.block_dims[1] == 2):
            raise gemm_common.unsupported(
                name,
                "an FP8 block-scaled parameter whose block dims are not the recipe's "
                "w_block_scaling_dim",
                "use the same Float8BlockScaling in quantized_model_init and te.autocast",
            )
        if w._rowwise_data is None or w._columnwise_data is None:
            raise gemm_common.unsupported(
                name,
                "an FP8 block-scaled parameter without both row-wise and column-wise data",
                "create the parameters with grad enabled (both usages); under FSDP2, which "
                "gathers them row-wise only for forward, keep this recipe's weights in "
                "high precision",
            )


def _dtype_value(dtype) -> int:
    """A TE dtype's integer value, the same for TE's `DType` (IntEnum: what TE 2.20 stores as
    a parameter's `_fp8_dtype`) and `transformer_engine_torch.DType` (pybind11 enum: what
    te_fp8_dtype returns, and older TE's `_fp8_dtype`). Compared as ints because dynamo may
    compare the two enums wrongly: torch 2.11's dynamo skips DType's `__eq__`/`__ne__`
    (which compare by integer value) and finds `DType.kFloat8E4M3 != tex.DType.kFloat8E4M3`
    true, and `int()` of a pybind11 enum does not trace there; `.value` traces for both."""
    return dtype.value


# ---- operands ----------------------------------------------------------------------------------


def operands(w, cfg: QuantConfig, prepared: bool = False) -> tuple[torch.Tensor, list]:
    """(the op's weight argument, the FP8 parameter's parts as an FP8 weight cache) for FP8
    parameter `w` (checked by `check`) of a module te_compile.prepare() registered or not."""
    ensure_grad_carriers(prepared)
    carrier = getattr(w, CARRIER_ATTR).tensor
    if not w.requires_grad:
        carrier = carrier.detach()  # a frozen weight gets no gradient, as in eager TE
    if cfg.kind == "block":
        parts = [w._rowwise_data, w._rowwise_scale_inv, w._columnwise_data]
        return carrier, [*parts, w._columnwise_scale_inv]
    parts = [w._data]
    if cfg.fp8_transpose:
        transpose = w._transpose
        if transpose is None or w._transpose_invalid:
            transpose = byte_transpose(w._data)
        parts.append(transpose)
    return carrier, [*parts, w._scale_inv]


def byte_transpose(data: torch.Tensor) -> torch.Tensor:
    """FP8 data's transpose as TE lays it out ([last, *leading]): tex.fp8_transpose's bytes."""
    last = data.shape[-1]
    return data.reshape(-1, last).t().contiguous().view(last, *data.shape[:-1])


def gemm_weight(
    m, name: str, weight, cfg: QuantConfig, fwd_state: list, is_first_microbatch, gemm=0
):
    """(the op's weight argument, its weight_cache list) for GEMM weight `name`: an FP8
    parameter's carrier and parts; otherwise the weight and, for FP8 weight caching
    (is_first_microbatch), its cache (gemm_common.cached_weight), else a current-scaling
    weight's FP8 parts computed in the graph (graph_fp8/weight.py), else []. Eager TE keeps no
    workspace for an FP8 parameter either."""
    if gemm_common.is_quantized(weight):
        return operands(weight, cfg, persistent_state.is_prepared(m))
    if cfg.fp8 and is_first_microbatch is not None:
        refresh = bool(is_first_microbatch)
        return weight, gemm_common.cached_weight(m, name, weight, cfg, fwd_state, refresh, gemm)
    if graph_weight.applies(m, weight, cfg):
        return weight, graph_weight.current_weight_parts(weight, cfg)
    return weight, []


# ---- dynamo's guard on a Float8Tensor parameter ------------------------------------------------


class FlattenContext(dict):
    """A Float8Tensor's `__tensor_flatten__` context while patched (see the module docstring):
    the same dict, copied with its quantizer kept by reference and compared with a
    Float8Quantizer's configuration in place of its identity."""

    def __deepcopy__(self, memo):
        quantizer = self["nontensor_kwargs"].get("quantizer")
        memo[id(quantizer)] = quantizer
        return FlattenContext(copy.deepcopy(dict(self), memo))

    def __eq__(self, other) -> bool:
        if not isinstance(other, dict) or self.keys() != other.keys():
            return False
        mine, theirs = self["nontensor_kwargs"], other["nontensor_kwargs"]
        if mine.keys() != theirs.keys():
            return False
        if any(mine[k] != theirs[k] for k in mine if k != "quantizer"):
            return False
        if not _same_quantizer(mine.get("quantizer"), theirs.get("quantizer")):
            return False
        return all(self[k] == other[k] for k in self if k != "nontensor_kwargs")

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = None


def _same_quantizer(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or a is None:
        return False
    if a == b:  # TE's value quantizers (current scaling, block scaling) compare by value
        return True
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    def config(q):
        return (int(q.dtype), q.rowwise_usage, q.columnwise_usage, q.internal)

    return isinstance(a, Float8Quantizer) and config(a) == config(b)


def swaps() -> list[Swap]:
    """Float8Tensor.__tensor_flatten__ returning a FlattenContext (see the module docstring)."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    def __tensor_flatten__(self):
        names, ctx = super(Float8Tensor, self).__tensor_flatten__()
        return names, FlattenContext(ctx)

    return [Swap(Float8Tensor, "__tensor_flatten__", __tensor_flatten__)]
