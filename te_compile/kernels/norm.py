"""TE's normalization kernels (LayerNorm, RMSNorm) for every op that normalizes. Run inside op
kernels only; `spec` is a NormSpec (spec.py), or any object with its fields.

- `tex_norm_fwd` / `tex_norm_bwd`: one call of tex.layernorm_fwd / rmsnorm_fwd / *_bwd, with
  the arguments eager TE's `apply_normalization` and `_LayerNormLinear.backward` pass.
- `norm_for_gemm`: the norm in front of a GEMM (LayerNormLinear, LayerNormMLP), quantizing
  its output for the GEMM the way eager TE does: one fused tex call with the GEMM input's
  quantizer where TE fuses (FP8 and the norm output not returned; TE's C++ then picks fully
  fused for delayed scaling, norm + fused amax then quantize for current scaling and NVFP4,
  norm then quantize for block scaling and MXFP8), else the norm in high precision then
  `gemm_layer.quantize`.
"""

from __future__ import annotations

from torch import Tensor

from ..recipes import QuantConfig
from . import extension, gemm_layer, tensor_parallel

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def has_beta(spec) -> bool:
    """LayerNorm has a bias (beta) and a mean; RMSNorm neither."""
    return spec.normalization == "LayerNorm"


def tex_norm_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, spec, *, out_dtype, quantizer=None
):
    """(out, mu, rsigma) of TE's norm kernel on 2-D `x`. `out` is a `out_dtype` tensor, or the
    TE storage `quantizer` makes (TE's C++ decides how far it fuses); mu is None for RMSNorm."""
    check_normalization(spec.normalization)
    otype = extension.te_dtype(out_dtype)
    margin, zcg = spec.fwd_sm_margin, spec.zero_centered_gamma
    if has_beta(spec):
        return extension.tex().layernorm_fwd(
            x, weight, bias, spec.eps, None, quantizer, otype, margin, zcg
        )
    out, _, rsigma = extension.tex().rmsnorm_fwd(
        x, weight, spec.eps, None, quantizer, otype, margin, zcg
    )
    return out, None, rsigma


def tex_norm_bwd(dz: Tensor, x: Tensor, mu: Tensor | None, rsigma: Tensor, gamma: Tensor, spec):
    """(dx, dgamma, dbeta) of TE's norm backward kernel; dbeta is None for RMSNorm."""
    check_normalization(spec.normalization)
    margin, zcg = spec.bwd_sm_margin, spec.zero_centered_gamma
    if has_beta(spec):
        return extension.tex().layernorm_bwd(dz, x, mu, rsigma, gamma, margin, zcg)
    dx, dgamma = extension.tex().rmsnorm_bwd(dz, x, rsigma, gamma, margin, zcg)
    return dx, dgamma, None


def norm_for_gemm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    cfg: QuantConfig,
    spec,
    *,
    state,
    columnwise: bool,
    return_hp: bool,
    gemm: int = 0,
    tp=None,
):
    """(gemm_input, ln_out, mu, rsigma): the norm of 2-D `x` as the input of GEMM `gemm`.

    Without FP8 both are the high-precision output. With FP8, `gemm_input` is a TE storage
    quantized by the GEMM's input quantizer (row-wise, plus column-wise when `columnwise`),
    DelayedScaling through `state` as in `gemm_layer.bound_quantizer`; `ln_out` is the
    high-precision output when `return_hp` (then TE does not fuse), else None. `tp`: the
    GEMM's ParallelSpec; an input all-gathered afterwards (sequence parallelism) is quantized
    as TE quantizes it for the gather (no per-tensor transpose, current scaling's amax
    reduced over the group)."""
    if not cfg.fp8:
        out, mu, rsigma = tex_norm_fwd(x, weight, bias, spec, out_dtype=x.dtype)
        return out, out, mu, rsigma
    gathered = tp if tp is not None and tp.gathers_input else None
    if gathered is not None and cfg.per_tensor:
        columnwise = False
    with (
        gemm_layer.bound_quantizer(
            cfg, "input", rowwise=True, columnwise=columnwise, state=state, gemm=gemm
        ) as q,
        tensor_parallel.amax_reduced(q, gathered),
    ):
        if not return_hp:
            out, mu, rsigma = tex_norm_fwd(x, weight, bias, spec, out_dtype=x.dtype, quantizer=q)
            return out, None, mu, rsigma
        out, mu, rsigma = tex_norm_fwd(x, weight, bias, spec, out_dtype=x.dtype)
        return extension.quantize(out, q), out, mu, rsigma


def stats_shapes(spec, tokens: int) -> tuple[list[int], list[int]]:
    """Shapes of (mu, rsigma), float32: RMSNorm's mu is empty."""
    return [tokens if has_beta(spec) else 0], [tokens]
