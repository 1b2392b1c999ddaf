"""te.LayerNormMLP's forward and backward as custom ops running TE's own kernels.

    te_compile::layernorm_mlp_fwd(inp, ln_weight, ln_bias?, fc1_weight, fc1_bias?, fc2_weight,
        fc2_bias?, fwd_state, bwd_state, fc1_cache, fc2_cache, fc1_main_grad?, fc2_main_grad?,
        config, mlp, out_dtype, save_norm, save_fc1_input, save_fc1_out, save_fc2_input,
        accumulate)
        -> [out, (ln_out), *saved, (fwd_amax)]
    te_compile::layernorm_mlp_bwd(grad_out, grad_ln_out?, inp, ln_weight, fc1_weight?,
        fc1_bias?, fc2_weight?, fc2_bias?, saved, bwd_scale!?, bwd_history!?, fc1_main_grad!?,
        fc2_main_grad!?, config, mlp, out_dtype, save_norm, save_fc1_input, save_fc1_out,
        save_fc2_input, needs, accumulate)
        -> (dx, dgamma, dbeta, fc1_wgrad, fc1_dbias, fc2_wgrad, fc2_dbias), [0] when not computed

`config` is the recipe (`QuantConfig.key`), `mlp` the module's options (`MLPConfig.key`).

Forward, as eager TE's `_LayerNormMLP._forward` (TE 2.20.2): the norm, with FC1's input
quantization fused into it when FP8 is on and the norm output is not returned; FC1 (bias in
the GEMM epilogue, or in TE's bias-GeLU fusion); the activation, fused with FC2's input
quantization (ops/activation.py); FC2. The GEMMs are the shared GEMM layer (gemm_layer.py),
GEMM 0 and GEMM 1 of the module's DelayedScaling slots. Backward: FC2 (grad_output quantized
with its dbias as te.Linear does), the activation's backward fused with FC1's grad_output
quantization and dbias where TE fuses them, FC1, the norm's backward.

What backward reads is saved as plain tensors (FP8 operands as their column-wise parts, see
fp8_operands.py), decided by the `save_*` flags: `save_norm` (the input or norm parameters
need grads: FC1 dgrad and the norm backward), `save_fc1_input` (FC1 wgrad), `save_fc1_out`
(anything before FC2 needs grads: FC2 dgrad and the activation backward), `save_fc2_input`
(FC2 wgrad). Saved, in order: mu (LayerNorm), rsigma, FC1 input, FC1 weight, FC1 output, FC2
input, FC2 weight; without FP8 the FC1/FC2 inputs are high-precision tensors and the weights
the op's own inputs (not saved here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..recipes import QuantConfig
from . import activation, gemm_layer, norm, registry
from .fp8_operands import columnwise_count, fake_columnwise_parts, weight_cache_columnwise

FC1, FC2 = 0, 1  # GEMM indices (DelayedScaling slots)


@dataclass(frozen=True)
class MLPConfig:
    """The LayerNormMLP options the ops need, as one canonical string (`key`)."""

    normalization: str = "LayerNorm"
    eps: float = 1e-5
    zero_centered_gamma: bool = False
    activation: str = "gelu"
    params: tuple[float, ...] = ()  # activation_params, positional (activation.params_tuple)
    fwd_sm_margin: int = 0
    bwd_sm_margin: int = 0
    bias_gelu: bool = False  # TE's bias-GeLU fusion (no FP8, gelu)
    return_ln: bool = False  # return_layernorm_output

    @property
    def key(self) -> str:
        params = ",".join(repr(float(p)) for p in self.params)
        return (
            f"norm={self.normalization};eps={float(self.eps)!r};"
            f"zcg={int(self.zero_centered_gamma)};act={self.activation};params={params};"
            f"fwd_margin={int(self.fwd_sm_margin)};bwd_margin={int(self.bwd_sm_margin)};"
            f"bias_gelu={int(self.bias_gelu)};return_ln={int(self.return_ln)}"
        )

    @staticmethod
    @functools.cache
    def from_key(key: str) -> MLPConfig:
        v = dict(item.split("=", 1) for item in key.split(";"))
        cfg = MLPConfig(
            normalization=v["norm"],
            eps=float(v["eps"]),
            zero_centered_gamma=bool(int(v["zcg"])),
            activation=v["act"],
            params=tuple(float(p) for p in v["params"].split(",") if p),
            fwd_sm_margin=int(v["fwd_margin"]),
            bwd_sm_margin=int(v["bwd_margin"]),
            bias_gelu=bool(int(v["bias_gelu"])),
            return_ln=bool(int(v["return_ln"])),
        )
        if cfg.key != key:
            raise ValueError(f"not a canonical MLPConfig key: {key!r}")
        return cfg


# ---- saved-tensor layout -----------------------------------------------------------------------


def _segments(cfg: QuantConfig, m: MLPConfig, flags: tuple[bool, bool, bool, bool]):
    """(name, count) of every tensor group backward reads, in order. `flags` = (save_norm,
    save_fc1_input, save_fc1_out, save_fc2_input)."""
    save_norm, save_fc1_input, save_fc1_out, save_fc2_input = flags
    n = columnwise_count(cfg)
    operand = n if cfg.fp8 else 1  # an FP8 operand's column-wise parts, or one tensor
    return (
        ("mu", int(save_norm and m.normalization == "LayerNorm")),
        ("rsigma", int(save_norm)),
        ("fc1_input", operand if save_fc1_input else 0),
        ("fc1_weight", n if cfg.fp8 and save_norm else 0),
        ("fc1_out", int(save_fc1_out)),
        ("fc2_input", operand if save_fc2_input else 0),
        ("fc2_weight", n if cfg.fp8 and save_fc1_out else 0),
    )


def _not_returned(cfg: QuantConfig, m: MLPConfig, fc1_cached: bool, fc2_cached: bool) -> set:
    """Segments the forward op does not return (setup_context adds them): a cached weight's
    parts (read from the cache) and, without FP8, a returned norm output saved as FC1's input
    (outputs of one op may not alias each other)."""
    names = set()
    if not cfg.fp8 and m.return_ln:
        names.add("fc1_input")
    if fc1_cached:
        names.add("fc1_weight")
    if fc2_cached:
        names.add("fc2_weight")
    return names


def _split(saved: list, segments) -> dict:
    out, i = {}, 0
    for name, count in segments:
        out[name] = list(saved[i : i + count])
        i += count
    if i != len(saved):
        raise RuntimeError(f"te_compile: layernorm_mlp got {len(saved)} saved tensors, not {i}")
    return out


# ---- forward -----------------------------------------------------------------------------------


def layernorm_mlp_fwd(
    inp: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor | None,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    fwd_state: list[torch.Tensor],
    bwd_state: list[torch.Tensor],
    fc1_cache: list[torch.Tensor],
    fc2_cache: list[torch.Tensor],
    fc1_main_grad: torch.Tensor | None,
    fc2_main_grad: torch.Tensor | None,
    config: str,
    mlp: str,
    out_dtype: torch.dtype,
    save_norm: bool,
    save_fc1_input: bool,
    save_fc1_out: bool,
    save_fc2_input: bool,
    accumulate: bool,
) -> list[torch.Tensor]:
    """LayerNormMLP's forward (see the module docstring). DelayedScaling: `fwd_state` =
    [scale] of the six forward slots; this call's amaxes are returned last for the caller to
    max-merge into TE's history. `bwd_state`, the main grads and `accumulate`
    ride along to the backward op."""
    cfg, m = QuantConfig.from_key(config), MLPConfig.from_key(mlp)
    dev = inp.device.index
    hidden = ln_weight.numel()
    x = gemm_layer.cast(inp.reshape(-1, hidden), out_dtype)
    gamma, beta = gemm_layer.cast(ln_weight, out_dtype), gemm_layer.cast(ln_bias, out_dtype)
    state = gemm_layer.fresh_amax_state(fwd_state)

    # Norm, with FC1's input quantization fused in unless its high-precision output is returned.
    ln_out, ln_out_hp, mu, rsigma = norm.norm_for_gemm(
        x,
        gamma,
        beta,
        cfg,
        normalization=m.normalization,
        eps=m.eps,
        sm_margin=m.fwd_sm_margin,
        zero_centered_gamma=m.zero_centered_gamma,
        state=state,
        columnwise=save_fc1_input,
        return_hp=m.return_ln,
        gemm=FC1,
    )

    # FC1. TE's bias-GeLU fusion adds the bias in the activation instead of the GEMM.
    fc1_out, fc1_saved = gemm_layer.forward(
        ln_out,
        fc1_weight,
        None if m.bias_gelu else fc1_bias,
        cfg,
        state=state,
        weight_cache=fc1_cache,
        save_input=save_fc1_input,
        save_weight=save_norm,
        out_dtype=out_dtype,
        x_shape=x.shape,
        device_index=dev,
        gemm=FC1,
    )
    if cfg.fp8:  # FC1's saved parts: input's column-wise half first, then the weight's
        n_in = columnwise_count(cfg) if save_fc1_input else 0
        fc1_in_parts, fc1_w_parts = fc1_saved[:n_in], fc1_saved[n_in:]
    else:
        fc1_in_parts, fc1_w_parts = ([ln_out] if save_fc1_input else []), []

    # Activation (+ FC2's input quantization), then FC2.
    if m.bias_gelu:
        act_out = activation.bias_gelu(fc1_out, gemm_layer.cast(fc1_bias, out_dtype))
    else:
        act_out = activation.forward(fc1_out, cfg, m.activation, m.params, state=state)
    if save_fc2_input and cfg.per_tensor and cfg.fp8_transpose:
        # TE's FC2 input quantizer is row-wise only; its backward makes the transpose from the
        # FP8 data (fp8_transpose, same bytes). Made here so it can be saved as a plain tensor.
        act_out.update_usage(columnwise_usage=True)
    ffn = fc2_weight.shape[1]
    out, fc2_saved = gemm_layer.forward(
        act_out,
        fc2_weight,
        fc2_bias,
        cfg,
        state=state,
        weight_cache=fc2_cache,
        save_input=save_fc2_input,
        save_weight=save_fc1_out,
        out_dtype=out_dtype,
        x_shape=(x.shape[0], ffn),
        device_index=dev,
        gemm=FC2,
    )
    if not cfg.fp8:
        fc2_saved = [act_out] if save_fc2_input else []
    n_fc2_in = columnwise_count(cfg) if save_fc2_input else 0

    groups = {
        "mu": [mu],
        "rsigma": [rsigma],
        "fc1_input": fc1_in_parts,
        "fc1_weight": fc1_w_parts,
        "fc1_out": [fc1_out],
        "fc2_input": fc2_saved[:n_fc2_in] if cfg.fp8 else fc2_saved,
        "fc2_weight": fc2_saved[n_fc2_in:] if cfg.fp8 else [],
    }
    flags = (save_norm, save_fc1_input, save_fc1_out, save_fc2_input)
    skip = _not_returned(cfg, m, bool(fc1_cache), bool(fc2_cache))
    saved = [
        t
        for name, count in _segments(cfg, m, flags)
        if name not in skip
        for t in groups[name][:count]
    ]
    outputs = [out.view(*inp.shape[:-1], out.shape[-1])]
    if m.return_ln:
        outputs.append(ln_out_hp.view(inp.shape))
    return outputs + saved + ([state[1]] if state else [])


def _layernorm_mlp_fwd_fake(
    inp,
    ln_weight,
    ln_bias,
    fc1_weight,
    fc1_bias,
    fc2_weight,
    fc2_bias,
    fwd_state,
    bwd_state,
    fc1_cache,
    fc2_cache,
    fc1_main_grad,
    fc2_main_grad,
    config,
    mlp,
    out_dtype,
    save_norm,
    save_fc1_input,
    save_fc1_out,
    save_fc2_input,
    accumulate,
):
    cfg, m = QuantConfig.from_key(config), MLPConfig.from_key(mlp)
    rows, hidden = inp.numel() // inp.shape[-1], inp.shape[-1]
    fc1_shape, fc2_in_shape = [rows, fc1_weight.shape[0]], [rows, fc2_weight.shape[1]]

    def empty(shape, dtype=out_dtype):
        return inp.new_empty(shape, dtype=dtype)

    def operand(shape):  # a saved GEMM input: FP8 column-wise parts, or the tensor
        if cfg.fp8:
            return fake_columnwise_parts(shape, cfg, "input", inp)
        return [empty(shape)]

    def weight(w):
        return fake_columnwise_parts(w.shape, cfg, "weight", inp)

    groups = {
        "mu": lambda: [empty([rows], torch.float32)],
        "rsigma": lambda: [empty([rows], torch.float32)],
        "fc1_input": lambda: operand([rows, hidden]),
        "fc1_weight": lambda: weight(fc1_weight),
        "fc1_out": lambda: [empty(fc1_shape)],
        "fc2_input": lambda: operand(fc2_in_shape),
        "fc2_weight": lambda: weight(fc2_weight),
    }
    flags = (save_norm, save_fc1_input, save_fc1_out, save_fc2_input)
    skip = _not_returned(cfg, m, bool(fc1_cache), bool(fc2_cache))
    saved = [
        t
        for name, count in _segments(cfg, m, flags)
        if count and name not in skip
        for t in groups[name]()
    ]
    outputs = [empty([*inp.shape[:-1], fc2_weight.shape[0]])]
    if m.return_ln:
        outputs.append(empty(list(inp.shape)))
    return outputs + saved + ([torch.empty_like(fwd_state[0])] if fwd_state else [])


# ---- backward ----------------------------------------------------------------------------------


def layernorm_mlp_bwd(
    grad_out: torch.Tensor,
    grad_ln_out: torch.Tensor | None,
    inp: torch.Tensor | None,
    ln_weight: torch.Tensor | None,
    fc1_weight: torch.Tensor | None,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor | None,
    fc2_bias: torch.Tensor | None,
    saved: list[torch.Tensor],
    bwd_scale: torch.Tensor | None,
    bwd_history: torch.Tensor | None,
    fc1_main_grad: torch.Tensor | None,
    fc2_main_grad: torch.Tensor | None,
    config: str,
    mlp: str,
    out_dtype: torch.dtype,
    fc1_features: int,
    flags: list[bool],
    needs: list[bool],
    accumulate: bool,
) -> tuple[torch.Tensor, ...]:
    """Gradients of layernorm_mlp_fwd, for the inputs (inp, ln_weight, ln_bias, fc1_weight,
    fc1_bias, fc2_weight, fc2_bias) flagged in `needs`. `flags` are the forward's save flags;
    `saved` every group of `_segments`. Weights are passed without FP8 only (FP8 operands come
    from `saved`); biases always (their presence decides TE's dbias work). DelayedScaling:
    `bwd_history`/`bwd_scale` are TE's backward state, updated at the end."""
    cfg, m = QuantConfig.from_key(config), MLPConfig.from_key(mlp)
    dev = grad_out.device.index
    hidden = grad_out.shape[-1]
    need_x, need_gamma, need_beta, need_w1, need_b1, need_w2, _ = needs
    needs_norm = need_x or need_gamma or need_beta
    needs_act = needs_norm or need_w1 or need_b1
    s = _split(saved, _segments(cfg, m, tuple(flags)))
    g = grad_out.reshape(-1, hidden)
    if not g.is_contiguous():
        g = g.contiguous()
    state = [bwd_scale, bwd_history[0]] if cfg.fp8 and bwd_history is not None else None

    def hp(name):  # a high-precision saved operand (no FP8)
        return s[name][0] if not cfg.fp8 and s[name] else None

    fc2_dgrad, fc2_wgrad, fc2_dbias = gemm_layer.backward(
        g,
        cfg,
        x=hp("fc2_input"),
        weight=fc2_weight,
        bias=fc2_bias,
        input_parts=s["fc2_input"],
        weight_parts=s["fc2_weight"],
        state=state,
        main_grad=fc2_main_grad,
        out_dtype=out_dtype,
        has_bias=fc2_bias is not None,
        needs_dgrad=needs_act,
        needs_wgrad=need_w2,
        accumulate=accumulate,
        device_index=dev,
        gemm=FC2,
        grad_columnwise=True,  # TE's LayerNormMLP asks for both halves of FC2's grad_output
    )
    dx = dgamma = dbeta = fc1_wgrad = fc1_dbias = None
    if needs_act:
        fc1_out = s["fc1_out"][0]
        if m.bias_gelu:
            dact, fc1_dbias = activation.bgrad_dgelu(
                fc2_dgrad, fc1_out, gemm_layer.cast(fc1_bias, out_dtype)
            )
            fc1_gemm_bias = None  # the dbias came from the fused bgrad-dgelu
        else:
            dact, fc1_dbias = activation.backward(
                fc2_dgrad, fc1_out, cfg, m.activation, m.params, state=state
            )
            fc1_gemm_bias = fc1_bias
        fc1_dgrad, fc1_wgrad, gemm_dbias = gemm_layer.backward(
            dact,
            cfg,
            x=hp("fc1_input"),
            weight=fc1_weight,
            bias=fc1_gemm_bias,
            input_parts=s["fc1_input"],
            weight_parts=s["fc1_weight"],
            state=state,
            main_grad=fc1_main_grad,
            out_dtype=out_dtype,
            has_bias=fc1_gemm_bias is not None,
            needs_dgrad=needs_norm,
            needs_wgrad=need_w1,
            accumulate=accumulate,
            device_index=dev,
            gemm=FC1,
            dbias=fc1_dbias,
        )
        if fc1_dbias is None:
            fc1_dbias = gemm_dbias
        if fc1_dbias is None and fc1_bias is not None and need_b1:
            # No FP8 and no FC1 wgrad: TE sums dact (its LayerNormMLP backward).
            fc1_dbias = dact.sum(dim=0)
        if needs_norm:
            dz = fc1_dgrad
            if grad_ln_out is not None:  # return_layernorm_output: both paths' gradients
                dz = dz + grad_ln_out.reshape(dz.shape)
            x = gemm_layer.cast(inp.reshape(-1, hidden), out_dtype)
            gamma = gemm_layer.cast(ln_weight, out_dtype)
            mu = s["mu"][0] if s["mu"] else None
            dx, dgamma, dbeta = norm.norm_bwd(
                dz,
                x,
                mu,
                s["rsigma"][0],
                gamma,
                normalization=m.normalization,
                sm_margin=m.bwd_sm_margin,
                zero_centered_gamma=m.zero_centered_gamma,
            )
            dx = dx.view(grad_out.shape)
    if bwd_history is not None:
        gemm_layer.update_backward_state(bwd_scale, bwd_history, cfg)

    def result(t):  # [0] for what is not computed (outputs of one op may not alias)
        return grad_out.new_empty([0], dtype=out_dtype) if t is None else t

    return tuple(result(t) for t in (dx, dgamma, dbeta, fc1_wgrad, fc1_dbias, fc2_wgrad, fc2_dbias))


def _bwd_shapes(grad_out, fc1_features, m: MLPConfig):
    hidden = grad_out.shape[-1]
    ffn = activation.output_features(m.activation, fc1_features)
    return (
        list(grad_out.shape),
        [hidden],
        [hidden],
        [fc1_features, hidden],
        [fc1_features],
        [hidden, ffn],
        [hidden],
    )


def _computed(cfg: QuantConfig, m: MLPConfig, needs, has_fc1_bias, has_fc2_bias, main_grads):
    """Which of layernorm_mlp_bwd's seven results are real tensors (the rest are [0])."""
    need_x, need_gamma, need_beta, need_w1, need_b1, need_w2, _ = needs
    needs_norm = need_x or need_gamma or need_beta
    needs_act = needs_norm or need_w1 or need_b1
    fc1_main, fc2_main = main_grads
    return (
        needs_norm,
        needs_norm,
        needs_norm and m.normalization == "LayerNorm",
        needs_act and need_w1 and not fc1_main,
        needs_act and has_fc1_bias and (cfg.fp8 or m.bias_gelu or need_w1 or need_b1),
        need_w2 and not fc2_main,
        gemm_layer.returns_dbias(cfg, has_fc2_bias, need_w2),
    )


def _layernorm_mlp_bwd_fake(
    grad_out,
    grad_ln_out,
    inp,
    ln_weight,
    fc1_weight,
    fc1_bias,
    fc2_weight,
    fc2_bias,
    saved,
    bwd_scale,
    bwd_history,
    fc1_main_grad,
    fc2_main_grad,
    config,
    mlp,
    out_dtype,
    fc1_features,
    flags,
    needs,
    accumulate,
):
    cfg, m = QuantConfig.from_key(config), MLPConfig.from_key(mlp)
    computed = _computed(
        cfg,
        m,
        needs,
        fc1_bias is not None,
        fc2_bias is not None,
        (fc1_main_grad is not None, fc2_main_grad is not None),
    )
    return tuple(
        grad_out.new_empty(shape if real else [0], dtype=out_dtype)
        for shape, real in zip(_bwd_shapes(grad_out, fc1_features, m), computed, strict=True)
    )


# ---- autograd ----------------------------------------------------------------------------------

_N_DIFFERENTIABLE = 7  # inp, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias


def _setup_context(ctx, inputs, output) -> None:
    (
        inp,
        ln_weight,
        ln_bias,
        fc1_weight,
        fc1_bias,
        fc2_weight,
        fc2_bias,
        fwd_state,
        bwd_state,
        fc1_cache,
        fc2_cache,
        fc1_main_grad,
        fc2_main_grad,
        config,
        mlp,
        out_dtype,
        *flags,
        accumulate,
    ) = inputs
    cfg, m = QuantConfig.from_key(config), MLPConfig.from_key(mlp)
    ctx.config, ctx.mlp, ctx.out_dtype, ctx.accumulate = config, mlp, out_dtype, accumulate
    ctx.flags = list(flags)
    ctx.fc1_features = fc1_weight.shape[0]
    ctx.n_lists = (len(fwd_state), len(bwd_state), len(fc1_cache), len(fc2_cache))
    # Mutable state rides on ctx, not save_for_backward: backward mutates it in place, which
    # the saved-tensor version check would reject.
    ctx.bwd_state = bwd_state
    ctx.main_grads = (fc1_main_grad, fc2_main_grad)
    n_out = 2 if m.return_ln else 1
    returned = list(output[n_out : len(output) - (1 if fwd_state else 0)])
    ctx.mark_non_differentiable(*output[n_out:])
    skip = _not_returned(cfg, m, bool(fc1_cache), bool(fc2_cache))
    added = {
        "fc1_input": lambda: [output[1].view(-1, output[1].shape[-1])],
        "fc1_weight": lambda: weight_cache_columnwise(fc1_cache, cfg),
        "fc2_weight": lambda: weight_cache_columnwise(fc2_cache, cfg),
    }
    saved, i = [], 0
    for name, count in _segments(cfg, m, tuple(flags)):
        if not count:
            continue
        if name in skip:
            saved += added[name]()
        else:
            saved += returned[i : i + count]
            i += count
    save_norm, _, save_fc1_out, _ = flags
    fp8 = cfg.fp8
    ctx.n_saved = len(saved)
    ctx.save_for_backward(
        inp if save_norm else None,
        ln_weight if save_norm else None,
        fc1_weight if save_norm and not fp8 else None,
        fc1_bias,
        fc2_weight if save_fc1_out and not fp8 else None,
        fc2_bias,
        *saved,
    )


def _backward(ctx, grads):
    m = MLPConfig.from_key(ctx.mlp)
    n_fwd, n_bwd, n_c1, n_c2 = ctx.n_lists
    nones = ([None] * n_fwd, [None] * n_bwd, [None] * n_c1, [None] * n_c2, None, None)
    nones += (None,) * 8  # config, mlp, out_dtype, four save flags, accumulate
    needs = list(ctx.needs_input_grad[:_N_DIFFERENTIABLE])
    grad_out = grads[0]
    if grad_out is None or not any(needs):
        return (None,) * _N_DIFFERENTIABLE + nones
    inp, ln_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *saved = ctx.saved_tensors
    grad_ln = grads[1] if m.return_ln else None
    results = torch.ops.te_compile.layernorm_mlp_bwd(
        grad_out,
        grad_ln,
        inp,
        ln_weight,
        fc1_weight,
        fc1_bias,
        fc2_weight,
        fc2_bias,
        saved,
        *(ctx.bwd_state or [None, None]),
        *ctx.main_grads,
        ctx.config,
        ctx.mlp,
        ctx.out_dtype,
        ctx.fc1_features,
        ctx.flags,
        needs,
        ctx.accumulate,
    )
    cfg = QuantConfig.from_key(ctx.config)
    computed = _computed(
        cfg,
        m,
        needs,
        fc1_bias is not None,
        fc2_bias is not None,
        tuple(g is not None for g in ctx.main_grads),
    )
    grads_in = tuple(
        r if real and need else None for r, real, need in zip(results, computed, needs, strict=True)
    )
    return grads_in + nones


# ---- registration ------------------------------------------------------------------------------

LAYERNORM_MLP_FWD = registry.define(
    "layernorm_mlp_fwd(Tensor inp, Tensor ln_weight, Tensor? ln_bias, Tensor fc1_weight, "
    "Tensor? fc1_bias, Tensor fc2_weight, Tensor? fc2_bias, Tensor[] fwd_state, "
    "Tensor[] bwd_state, Tensor[] fc1_cache, Tensor[] fc2_cache, Tensor? fc1_main_grad, "
    "Tensor? fc2_main_grad, str config, str mlp, ScalarType out_dtype, bool save_norm, "
    "bool save_fc1_input, bool save_fc1_out, bool save_fc2_input, bool accumulate) -> Tensor[]",
    layernorm_mlp_fwd,
    _layernorm_mlp_fwd_fake,
)
registry.register_autograd(LAYERNORM_MLP_FWD, _backward, _setup_context)
LAYERNORM_MLP_BWD = registry.define(
    "layernorm_mlp_bwd(Tensor grad_out, Tensor? grad_ln_out, Tensor? inp, Tensor? ln_weight, "
    "Tensor? fc1_weight, Tensor? fc1_bias, Tensor? fc2_weight, Tensor? fc2_bias, "
    "Tensor[] saved, Tensor(a!)? bwd_scale, Tensor(b!)? bwd_history, "
    "Tensor(c!)? fc1_main_grad, Tensor(d!)? fc2_main_grad, str config, str mlp, "
    "ScalarType out_dtype, int fc1_features, bool[] flags, bool[] needs, bool accumulate) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    layernorm_mlp_bwd,
    _layernorm_mlp_bwd_fake,
)
