"""te_compile/kernels/activation.py against eager TE's LayerNormMLP (no GPU).

- The activation table is TE's own: same names, same kernels, fused dbias kernels for the same
  recipes (`_get_act_func_supported_list`).
- Per recipe, forward and backward call the kernels eager TE's `_LayerNormMLP` calls, with the
  quantizer roles, usages and DelayedScaling slots it uses: recorded with stand-in kernels and
  quantizers (the real ones need a GPU; tests/gpu compares numerics with eager TE).
"""

from __future__ import annotations

import pytest
import torch
from transformer_engine.common import recipe as R

from te_compile.kernels import activation, extension, gemm_layer
from te_compile.recipes import for_linear

RECIPES = {
    "none": lambda: None,
    "delayed": R.DelayedScaling,
    "current": R.Float8CurrentScaling,
    "block": R.Float8BlockScaling,
    "mxfp8": R.MXFP8BlockScaling,
    "nvfp4": R.NVFP4BlockScaling,
}


def _cfg(name):
    return for_linear(RECIPES[name](), fp8_transpose=True)


@pytest.mark.parametrize("name", list(RECIPES))
def test_table_is_tes(name):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.module.layernorm_mlp import _get_act_func_supported_list

    te_table = _get_act_func_supported_list(RECIPES[name]())
    assert sorted(te_table) == sorted(activation.ACTIVATIONS)
    cfg = _cfg(name)
    for act, (fwd, bwd, dbias) in te_table.items():
        ours = activation.ACTIVATIONS[act]
        assert getattr(tex, ours.forward) is fwd, act
        assert getattr(tex, ours.backward) is bwd, act
        if cfg.fp8:
            assert activation.fuses_dbias(cfg, act) == (dbias is not None), act
        if dbias is not None:
            assert getattr(tex, ours.dbias_backward) is dbias, act


def test_gated_widths_are_tes():
    # TE's LayerNormMLP doubles FC1's outputs for exactly these activations (its __init__).
    gated = {"geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"}
    assert {n for n, a in activation.ACTIVATIONS.items() if a.gated} == gated
    assert activation.output_features("swiglu", 64) == 32
    assert activation.output_features("gelu", 64) == 64


def test_params():
    assert activation.params_tuple("gelu", None) == ()
    assert activation.params_tuple("clamped_swiglu", {"limit": 5}) == (5.0, 1.702, 1.0)
    with pytest.raises(TypeError, match="activation_params"):
        activation.params_tuple("gelu", {"limit": 5.0})


class _Recorder:
    """Stand-in kernels and quantizers: records each call as a tuple."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(activation, "_kernel", self.kernel)
        monkeypatch.setattr(gemm_layer, "quantizer", self.quantizer)
        monkeypatch.setattr(extension, "quantize", lambda t, q: self.log("quantize", q) or "q")
        monkeypatch.setattr(
            extension, "bgrad_quantize", lambda t, q: self.log("bgrad_quantize", q) or ("db", "q")
        )
        monkeypatch.setattr(extension, "with_state", self.with_state)

    def log(self, *call):
        self.calls.append(call)

    def kernel(self, fn_name):
        def run(*args):
            self.log(fn_name, *(a for a in args if not isinstance(a, torch.Tensor)))
            if fn_name.startswith("dbias_"):
                return "db", "q"
            return torch.zeros(4, 8)

        return run

    @staticmethod
    def quantizer(cfg, role, *, rowwise, columnwise, weight_shape=None):
        return (role, rowwise, columnwise)

    def with_state(self, q, scale, amax):
        import contextlib

        self.log("state", int(scale.item()), int(amax.item()))
        return contextlib.nullcontext(q)


def _state():
    # slot i holds i: the recorder logs which slot a quantizer was bound to
    return [torch.arange(6.0), torch.arange(6.0)]


FWD_EXPECTED = {
    "none": [("gelu", None)],
    "delayed": [("state", 3, 3), ("gelu", ("input", True, False))],
    "current": [("gelu", ("input", True, False))],
    "block": [("gelu", None), ("quantize", ("input", True, True))],
    "mxfp8": [("gelu", ("input", True, True))],
    "nvfp4": [("gelu", ("input", True, True))],
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_kernels_per_recipe(name, monkeypatch):
    rec = _Recorder(monkeypatch)
    cfg = _cfg(name)
    state = _state() if name == "delayed" else None
    activation.forward(torch.zeros(4, 8), cfg, "gelu", (), state=state)
    assert rec.calls == FWD_EXPECTED[name]


GRAD_Q = ("grad", True, True)
BWD_EXPECTED = {
    # (activation, recipe): calls
    ("gelu", "none"): [("dgelu", None)],
    ("gelu", "delayed"): [("state", 0, 0), ("dbias_dgelu", GRAD_Q)],
    ("gelu", "mxfp8"): [("dbias_dgelu", GRAD_Q)],
    ("gelu", "current"): [("dgelu", None), ("bgrad_quantize", GRAD_Q)],
    ("gelu", "nvfp4"): [("dgelu", None), ("bgrad_quantize", GRAD_Q)],
    ("gelu", "block"): [("dgelu", None), ("quantize", GRAD_Q)],
    ("swiglu", "delayed"): [("dswiglu", None), ("state", 0, 0), ("bgrad_quantize", GRAD_Q)],
    ("swiglu", "mxfp8"): [("dswiglu", None), ("bgrad_quantize", GRAD_Q)],
    ("clamped_swiglu", "current"): [
        ("clamped_dswiglu", None, 7.0, 1.702, 1.0),
        ("bgrad_quantize", GRAD_Q),
    ],
}


@pytest.mark.parametrize("act,name", list(BWD_EXPECTED))
def test_backward_kernels_per_recipe(act, name, monkeypatch):
    rec = _Recorder(monkeypatch)
    cfg = _cfg(name)
    state = _state() if name == "delayed" else None
    params = activation.params_tuple(act, None)
    dact, dbias = activation.backward(
        torch.zeros(4, 8), torch.zeros(4, 8), cfg, act, params, state=state
    )
    assert rec.calls == BWD_EXPECTED[(act, name)]
    assert (dbias is None) == (name == "none")
    if name == "block":
        assert dbias.shape == (8,)


def test_gemm_layer_slots_match_layernorm_mlp():
    """FC2's input is fp8_meta forward slot GEMM2_INPUT, FC1's grad_output backward slot
    GRAD_OUTPUT1 (TE's LayerNormMLP._get_quantizers)."""
    import transformer_engine_torch as tex

    from te_compile.kernels.fp8_operands import delayed_slot

    assert delayed_slot("input", activation.FC2_INPUT_GEMM) == int(tex.FP8FwdTensors.GEMM2_INPUT)
    assert delayed_slot("grad", activation.FC1_GRAD_GEMM) == int(tex.FP8BwdTensors.GRAD_OUTPUT1)
    assert delayed_slot("grad", 1) == int(tex.FP8BwdTensors.GRAD_OUTPUT2)
