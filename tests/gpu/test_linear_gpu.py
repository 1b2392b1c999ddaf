"""GPU suite for te.Linear under torch.compile with inductor: forward and backward bit-identical
to eager TE, per recipe; opcheck for the te_compile::linear_* ops.

Run on a GPU machine with TE installed: `bash scripts/gpu_suite.sh` (or `pytest -m gpu`).
"""

from __future__ import annotations

import contextlib

import linear_cases
import pytest
import torch
import transformer_engine.pytorch as te
from conftest import recipe_for, skip_unless_supported
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

import te_compile
from te_compile_testing import InductorRecorder

pytestmark = pytest.mark.gpu


# MXFP8 and NVFP4 need Blackwell: on Hopper their cases skip with TE's reason.
RECIPES = ["none", "current", "block", "delayed", "mxfp8", "nvfp4"]
# Block-scaled scale_inv tensors are padded and TE leaves the padding unwritten.
PADDED_SCALES = ("block", "mxfp8", "nvfp4")
FGS = q.FP8GlobalStateManager
IN, OUT = 128, 256
SHAPES = {"2d": (64, IN), "3d": (4, 32, IN)}


def fresh_linear(bias: bool, dtype: torch.dtype) -> te.Linear:
    torch.manual_seed(0)
    linear = te.Linear(IN, OUT, bias=bias, params_dtype=dtype)
    if bias:  # TE zero-initialises biases: make dbias/bias bugs visible
        with torch.no_grad():
            linear.bias.normal_()
    return linear


def forward_fn(linear, recipe, torch_amp=None):
    def fn(x):
        amp = torch.autocast("cuda", dtype=torch_amp) if torch_amp else contextlib.nullcontext()
        fp8 = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with amp, fp8:
            return linear(x)

    return fn


def run(name, bias, shape, dtype, compiled, input_requires_grad=True, torch_amp=None):
    """Forward + backward on a fresh module; returns out and every gradient."""
    torch._dynamo.reset()
    FGS.reset()
    linear = fresh_linear(bias, dtype)
    torch.manual_seed(1)
    x = torch.randn(SHAPES[shape], device="cuda", dtype=dtype).requires_grad_(input_requires_grad)
    fn = forward_fn(linear, recipe_for(name), torch_amp)
    backend = InductorRecorder()
    if compiled:
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    out = fn(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    if compiled:
        assert backend.graphs == 1
    grads = [x.grad, linear.weight.grad, linear.bias.grad if bias else None]
    return out.detach(), grads


def assert_same(got, want):
    out_c, grads_c = got
    out_e, grads_e = want
    assert out_c.dtype == out_e.dtype and torch.equal(out_c, out_e), "forward output differs"
    for label, c, e in zip(("dgrad", "wgrad", "dbias"), grads_c, grads_e, strict=True):
        assert (c is None) == (e is None), f"{label}: {c is None=} {e is None=}"
        if c is not None:
            assert c.dtype == e.dtype and torch.equal(c, e), f"{label} differs"


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_linear_matches_eager_bf16(name, bias, shape, patched):
    skip_unless_supported(name)
    assert_same(
        run(name, bias, shape, torch.bfloat16, compiled=True),
        run(name, bias, shape, torch.bfloat16, compiled=False),
    )


@pytest.mark.parametrize("name", RECIPES)
def test_linear_matches_eager_fp32(name, patched):
    """FP32 activations: the FP8 GEMM's bias is cast to BF16, as TE does."""
    skip_unless_supported(name)
    if name == "nvfp4":
        pytest.skip("NVFP4's Hadamard transform takes BF16 input only (eager TE raises too)")
    assert_same(
        run(name, True, "3d", torch.float32, compiled=True),
        run(name, True, "3d", torch.float32, compiled=False),
    )


@pytest.mark.parametrize("name", RECIPES)
def test_linear_matches_eager_torch_autocast(name, patched):
    """FP32 parameters under torch.autocast(bf16): activation dtype from torch's autocast."""
    skip_unless_supported(name)
    kw = dict(torch_amp=torch.bfloat16)
    assert_same(
        run(name, True, "2d", torch.float32, compiled=True, **kw),
        run(name, True, "2d", torch.float32, compiled=False, **kw),
    )


@pytest.mark.parametrize("name", RECIPES)
def test_input_without_grad_matches_eager(name, patched):
    skip_unless_supported(name)
    assert_same(
        run(name, True, "2d", torch.bfloat16, compiled=True, input_requires_grad=False),
        run(name, True, "2d", torch.bfloat16, compiled=False, input_requires_grad=False),
    )


@pytest.mark.parametrize("name", ["current", "block", "delayed", "mxfp8", "nvfp4"])
def test_fp8_really_ran(name, patched):
    skip_unless_supported(name)
    out_fp8, _ = run(name, True, "2d", torch.bfloat16, compiled=True)
    out_bf16, _ = run("none", True, "2d", torch.bfloat16, compiled=True)
    assert not torch.equal(out_fp8, out_bf16)


@pytest.mark.parametrize("name", RECIPES)
def test_no_grad_inference_matches_eager(name, patched):
    skip_unless_supported(name)
    linear = fresh_linear(True, torch.bfloat16)
    x = torch.randn(SHAPES["3d"], device="cuda", dtype=torch.bfloat16)
    fn = forward_fn(linear, recipe_for(name))
    with torch.no_grad():
        want = fn(x)
        got = torch.compile(fn, backend=InductorRecorder(), fullgraph=True)(x)
    assert torch.equal(got, want)


# ---- opcheck -----------------------------------------------------------------------------------


def _quant(name):
    from te_compile.modules.linear import _quant_config
    from te_compile.recipes import QuantConfig

    return (QuantConfig() if name == "none" else _quant_config(recipe_for(name))).key


def _fwd_args(name, bias=True):
    return linear_cases.fwd_args(_quant(name), bias, delayed=name == "delayed")


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_fwd_opcheck(name, bias):
    skip_unless_supported(name)
    import te_compile.ops  # noqa: F401

    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    if name not in PADDED_SCALES:
        # Block-scaled scale_inv tensors are padded (Float8BlockScaling to multiples of 4,
        # MXFP8/NVFP4 to [128, 4] tiles) and TE leaves the padding unwritten, so two runs
        # differ there; the GEMMs never read it (the parity tests above compare every result
        # bit for bit).
        checks += ("test_aot_dispatch_dynamic",)
    torch.library.opcheck(
        torch.ops.te_compile.linear_fwd.default, _fwd_args(name, bias), test_utils=checks
    )


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_bwd_opcheck(name, bias):
    skip_unless_supported(name)
    import te_compile.ops  # noqa: F401

    bwd_args = linear_cases.bwd_args(_fwd_args(name, bias))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    if name != "nvfp4":
        # NVFP4 rounds gradients stochastically: each run draws new Philox offsets.
        checks += ("test_aot_dispatch_dynamic",)
    torch.library.opcheck(torch.ops.te_compile.linear_bwd.default, bwd_args, test_utils=checks)


# ---- DelayedScaling over training steps, nested recipes ----------------------------------------


def delayed_training(compiled: bool, steps: int = 10):
    """SGD steps of one te.Linear under DelayedScaling; per step: output, dgrad, TE's forward
    and backward amax history and scale, and the updated weight."""
    torch._dynamo.reset()
    FGS.reset()
    linear = fresh_linear(True, torch.bfloat16)
    opt = torch.optim.SGD(linear.parameters(), lr=0.1)
    fn = forward_fn(linear, R.DelayedScaling(amax_history_len=4))
    backend = InductorRecorder()
    if compiled:
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    torch.manual_seed(2)
    record = []
    for _ in range(steps):
        x = torch.randn(64, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = fn(x)
        out.backward(torch.randn_like(out))
        opt.step()
        opt.zero_grad()
        te_compile.flush_delayed_updates()  # what compiled modules left to the exit
        fwd, bwd = linear.fp8_meta["scaling_fwd"], linear.fp8_meta["scaling_bwd"]
        state = (fwd.amax_history, fwd.scale, bwd.amax_history, bwd.scale, linear.weight)
        record.append([out.detach(), x.grad] + [t.detach().clone() for t in state])
    return record, backend.graphs


def test_delayed_ten_steps_match_eager(patched):
    skip_unless_supported("delayed")
    got, graphs = delayed_training(compiled=True)
    want, _ = delayed_training(compiled=False)
    labels = ("out", "dgrad", "fwd amax_history", "fwd scale", "bwd amax_history", "bwd scale")
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for label, a, b in zip((*labels, "weight"), g, w, strict=True):
            assert torch.equal(a, b), f"step {step}: {label} differs"
    assert graphs == 1, "recompiled during the 10 steps"
    assert not torch.equal(got[-1][3], torch.ones_like(got[-1][3])), "scales never updated"


def test_nested_recipes_per_layer_match_eager(patched):
    """Outer DelayedScaling, inner Float8CurrentScaling, innermost disabled: each layer uses
    its own recipe forward and backward, compiled as one graph, equal to eager TE."""
    skip_unless_supported("delayed")
    delayed, current = R.DelayedScaling(amax_history_len=4), R.Float8CurrentScaling()

    def run_nested(compiled: bool):
        torch._dynamo.reset()
        FGS.reset()
        torch.manual_seed(0)
        layers = [te.Linear(IN, IN, params_dtype=torch.bfloat16) for _ in range(3)]

        def fn(x):
            with te.autocast(recipe=delayed):
                h = layers[0](x)
                with te.autocast(recipe=current):
                    h = layers[1](h)
                    with te.autocast(enabled=False):
                        return layers[2](h)

        backend = InductorRecorder()
        if compiled:
            fn = torch.compile(fn, backend=backend, fullgraph=True)
        torch.manual_seed(1)
        x = torch.randn(64, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = fn(x)
        out.backward(torch.randn_like(out))
        grads = [p.grad for layer in layers for p in layer.parameters()]
        te_compile.flush_delayed_updates()  # what compiled modules left to the exit
        meta = layers[0].fp8_meta
        state = [meta["scaling_fwd"].amax_history, meta["scaling_bwd"].amax_history]
        return [out.detach(), x.grad, *grads, *state], backend.graphs

    got, graphs = run_nested(compiled=True)
    want, _ = run_nested(compiled=False)
    assert graphs == 1
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"result {i} differs"
