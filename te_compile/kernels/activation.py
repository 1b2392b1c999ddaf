"""TE's activation kernels, called as eager TE's LayerNormMLP calls them (TE 2.20.2), per recipe.

Plain functions for op bodies (they run inside real op kernels only, never at trace time).

Forward (`forward`), on FC1's output, producing FC2's input:
- no FP8: `tex.<act>(x, None)`, high precision;
- Float8BlockScaling: the same, then `tex.quantize` with FC2's input quantizer (TE has no fused
  activation + block quantize);
- every other recipe: `tex.<act>(x, quantizer)`, the activation fused with the quantization
  (TE's C++ picks fully fused, activation + amax then cast, or unfused, per quantizer type).
FC2's input quantizer is row-wise only for per-tensor FP8 (TE makes the transpose in backward)
and row- plus column-wise for MXFP8, block scaling and NVFP4 (`_get_quantizers`).

Backward (`backward`), from FC2's dgrad, producing FC1's grad_output:
- no FP8: `tex.d<act>(grad, x, None)`; FC1's dbias comes from its wgrad GEMM;
- DelayedScaling and MXFP8 with gelu, qgelu, relu, srelu, silu: `tex.dbias_d<act>(grad, x,
  quantizer)`, dact + dbias + quantize fused;
- Float8BlockScaling: `tex.d<act>` in high precision, dbias by `sum(0)`, then `tex.quantize`;
- otherwise: `tex.d<act>` in high precision, then `tex.bgrad_quantize` (dbias + quantize).
TE does the dbias work even for a module without biases; so do we (same kernels).

The GELU of a bf16/fp16/fp32 LayerNormMLP is TE's "bias-GeLU fusion" (`bias_gelu`,
`bgrad_dgelu`: TE's own torch.compile'd functions from transformer_engine.pytorch.jit, called as
eager TE calls them), unless TE turned it off (NVTE_BIAS_GELU_NVFUSION=0, non-reentrant
activation recompute), in which case TE fuses GELU into cuBLAS epilogues (not done here: the
module refuses it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..recipes import QuantConfig
from . import gemm_layer


@dataclass(frozen=True)
class Activation:
    """One activation of TE's LayerNormMLP table (`_get_act_func_supported_list`)."""

    forward: str  # transformer_engine_torch function names
    backward: str
    # dact + dbias + quantize in one kernel, used by TE for DelayedScaling and MXFP8 only
    dbias_backward: str | None = None
    gated: bool = False  # GLU family: FC1 has twice the outputs; the activation halves them
    # activation_params TE passes through (keyword name, pybind default), in signature order
    params: tuple[tuple[str, float], ...] = ()


ACTIVATIONS = {
    "gelu": Activation("gelu", "dgelu", "dbias_dgelu"),
    "geglu": Activation("geglu", "dgeglu", gated=True),
    "glu": Activation("glu", "dglu", gated=True),
    "qgelu": Activation("qgelu", "dqgelu", "dbias_dqgelu"),
    "qgeglu": Activation("qgeglu", "dqgeglu", gated=True),
    "relu": Activation("relu", "drelu", "dbias_drelu"),
    "reglu": Activation("reglu", "dreglu", gated=True),
    "srelu": Activation("srelu", "dsrelu", "dbias_dsrelu"),
    "sreglu": Activation("sreglu", "dsreglu", gated=True),
    "silu": Activation("silu", "dsilu", "dbias_dsilu"),
    "swiglu": Activation("swiglu", "dswiglu", gated=True),
    "clamped_swiglu": Activation(
        "clamped_swiglu",
        "clamped_dswiglu",
        gated=True,
        params=(("limit", 7.0), ("alpha", 1.702), ("glu_linear_offset", 1.0)),
    ),
}

# Recipes whose LayerNormMLP uses the fused dbias_d<act> kernels (TE's table).
DBIAS_FUSED_KINDS = ("delayed", "mxfp8")
# Recipes whose FC2-input quantizer makes both halves in forward (TE's _get_quantizers).
BOTH_HALVES_KINDS = ("block", "mxfp8", "nvfp4")

# The FC2 GEMM's slots in a LayerNormMLP's DelayedScaling state: FC2's input is GEMM 1's input
# (fp8_meta forward slot 3); FC1's grad_output is GEMM 0's (backward slot 0).
FC2_INPUT_GEMM = 1
FC1_GRAD_GEMM = 0


def params_tuple(name: str, params: dict | None) -> tuple[float, ...]:
    """activation_params as the positional floats of TE's kernel, defaults filled in. Raises as
    eager TE would (a TypeError from the kernel call) for parameters the activation has not."""
    act = ACTIVATIONS[name]
    params = dict(params or {})
    values = tuple(float(params.pop(key, default)) for key, default in act.params)
    if params:
        raise TypeError(
            f"activation {name!r} takes no activation_params {sorted(params)} "
            f"(it takes {[key for key, _ in act.params]})"
        )
    return values


def output_features(name: str, fc1_features: int) -> int:
    """The activation's output width for an FC1 output of `fc1_features`."""
    return fc1_features // 2 if ACTIVATIONS[name].gated else fc1_features


@functools.cache
def _kernel(fn_name: str):
    import transformer_engine_torch as tex

    return getattr(tex, fn_name)


def activate(x: torch.Tensor, name: str, params: tuple[float, ...], quantizer=None):
    """`tex.<act>(x, quantizer, *params)`: a tensor, or a TE storage with a quantizer."""
    return _kernel(ACTIVATIONS[name].forward)(x, quantizer, *params)


def dactivate(grad: torch.Tensor, x: torch.Tensor, name: str, params: tuple[float, ...]):
    """`tex.d<act>(grad, x, None, *params)`: the activation's backward in high precision."""
    return _kernel(ACTIVATIONS[name].backward)(grad, x, None, *params)


def fuses_dbias(cfg: QuantConfig, name: str) -> bool:
    """Whether TE's backward runs the fused dact + dbias + quantize kernel."""
    return cfg.kind in DBIAS_FUSED_KINDS and ACTIVATIONS[name].dbias_backward is not None


def forward(fc1_out: torch.Tensor, cfg: QuantConfig, name: str, params, *, state):
    """FC2's input from FC1's output (see the module docstring): a high-precision tensor without
    FP8, else a TE storage quantized for FC2's input role. DelayedScaling: `state` = [scale,
    amaxes] of the forward slots (the kernel max-accumulates the amax)."""
    if not cfg.fp8:
        return activate(fc1_out, name, params)
    both = cfg.kind in BOTH_HALVES_KINDS
    if cfg.kind == "block":
        act_out = activate(fc1_out, name, params)
        return gemm_layer.quantize(act_out, cfg, "input", True, both, state, gemm=FC2_INPUT_GEMM)
    with gemm_layer.bound_quantizer(
        cfg, "input", rowwise=True, columnwise=both, state=state, gemm=FC2_INPUT_GEMM
    ) as q:
        return activate(fc1_out, name, params, q)


def backward(
    grad: torch.Tensor, fc1_out: torch.Tensor, cfg: QuantConfig, name: str, params, *, state
):
    """(dact, dbias) from FC2's dgrad `grad` (2-D) and the saved FC1 output (see the module
    docstring). Without FP8, dact is high precision and dbias None (the FC1 wgrad GEMM makes
    it); with FP8, dact is a TE storage (both halves) quantized for FC1's grad_output role.
    DelayedScaling: `state` = [scale, latest amaxes] of the backward slots."""
    if not cfg.fp8:
        return dactivate(grad, fc1_out, name, params), None
    if fuses_dbias(cfg, name):
        fused = _kernel(ACTIVATIONS[name].dbias_backward)
        with gemm_layer.bound_quantizer(
            cfg, "grad", rowwise=True, columnwise=True, state=state, gemm=FC1_GRAD_GEMM
        ) as q:
            dbias, dact = fused(grad, fc1_out, q)
        return dact, dbias
    dact = dactivate(grad, fc1_out, name, params)
    if cfg.kind == "block":  # TE: no fused dbias for block scaling
        dbias = dact.view(-1, dact.shape[-1]).sum(dim=0)
        dact = gemm_layer.quantize(dact, cfg, "grad", True, True, state, gemm=FC1_GRAD_GEMM)
        return dact, dbias
    dbias, dact = gemm_layer.quantize(
        dact, cfg, "grad", True, True, state, gemm=FC1_GRAD_GEMM, bgrad=True
    )
    return dact, dbias


# ---- TE's bias-GeLU fusion (no FP8) -----------------------------------------------------------


def _stable_keys(fused, *args):
    """Calls one of TE's torch.compile'd fusions from inside an op body. Dynamo guards a
    compiled entry on the dispatch keys its inputs show, and inside an op body those depend on
    how the op was reached (on an H100, CUDA-graph warm-up and capture of one step differed in
    ADInplaceOrView): the capture compiled a second entry, whose first run autotunes,
    synchronizes and breaks the capture. The inputs therefore go in as inference-mode aliases
    (DLPack: same memory, no copy, no autograd or ADInplaceOrView key), whose keys no calling
    context changes, so one entry serves every call (eager TE's own calls keep theirs). Inference
    mode alone is not enough: a normal tensor keeps its ADInplaceOrView key there."""
    with torch.inference_mode():
        return fused(*(None if a is None else torch.from_dlpack(a.detach()) for a in args))


def bias_gelu(fc1_out_without_bias: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GELU(x + bias) by TE's `bias_gelu_fused` (a torch.compile'd function of its own, the
    kernel eager TE runs). Cloned out of inference mode: it is saved for the backward."""
    from transformer_engine.pytorch.jit import bias_gelu_fused

    return _stable_keys(bias_gelu_fused, fc1_out_without_bias, bias).clone()


def bgrad_dgelu(grad: torch.Tensor, fc1_out_without_bias: torch.Tensor, bias):
    """(dact, dbias or None) by TE's `bgrad_dgelu_fused`; dact only feeds FC1's GEMMs, dbias is
    returned as a gradient (cloned out of inference mode)."""
    from transformer_engine.pytorch.jit import bgrad_dgelu_fused

    dbias, dact = _stable_keys(bgrad_dgelu_fused, grad, fc1_out_without_bias, bias)
    return dact, None if dbias is None else dbias.clone()
