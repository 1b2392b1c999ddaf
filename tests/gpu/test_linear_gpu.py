"""GPU suite for te.Linear under torch.compile with inductor: forward and backward bit-identical
to eager TE, per recipe; opcheck for the te_compile::linear_* ops.

Run on a GPU machine with TE installed: `bash scripts/gpu_suite.sh` (or `pytest -m gpu`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import recipe_instances
from transformer_engine.pytorch import quantization as q

pytestmark = pytest.mark.gpu


class InductorRecorder:
    """Inductor, counting the graphs dynamo hands it (a recompile or graph break adds one)."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        self.inductor = lookup_backend("inductor")
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inductor(gm, example_inputs)


def supported(name: str) -> tuple[bool, str]:
    check = {"current": q.check_fp8_support, "block": q.check_fp8_block_scaling_support}[name]
    return check()


RECIPES = ["none", "current", "block"]
IN, OUT = 128, 256
SHAPES = {"2d": (64, IN), "3d": (4, 32, IN)}


def recipe_for(name):
    return None if name == "none" else recipe_instances()[name]


def skip_unless_supported(name):
    if name != "none" and not supported(name)[0]:
        pytest.skip(supported(name)[1])


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


@pytest.mark.parametrize("name", ["current", "block"])
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

    return (QuantConfig() if name == "none" else _quant_config(recipe_for(name))).op_args()


def _fwd_args(name, bias=True):
    torch.manual_seed(0)
    x = torch.randn(64, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(OUT, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
    return (x, w, b, torch.bfloat16, True, True, *_quant(name))


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_fwd_opcheck(name, bias):
    skip_unless_supported(name)
    import te_compile.ops  # noqa: F401

    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    if name != "block":
        # Block scaling's column-wise scale_inv is padded (to multiples of 4) and TE leaves the
        # padding unwritten, so two runs differ there; the GEMMs never read it (the parity
        # tests above compare every result bit for bit).
        checks += ("test_aot_dispatch_dynamic",)
    torch.library.opcheck(
        torch.ops.te_compile.linear_fwd.default, _fwd_args(name, bias), test_utils=checks
    )


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_bwd_opcheck(name, bias):
    skip_unless_supported(name)
    import te_compile.ops  # noqa: F401

    args = _fwd_args(name, bias)
    x, w, b = args[:3]
    with torch.no_grad():
        out, *parts = torch.ops.te_compile.linear_fwd(*args)
    grad = torch.randn_like(out)
    fp8 = name != "none"
    n = len(parts) // 2
    bwd_args = (
        grad,
        None if fp8 else x.detach(),
        None if fp8 else w.detach(),
        None if fp8 else (b.detach() if b is not None else None),
        b is not None,
        parts[:n],
        parts[n:],
        torch.bfloat16,
        IN,
        True,
        True,
        *_quant(name),
    )
    torch.library.opcheck(torch.ops.te_compile.linear_bwd.default, bwd_args)
