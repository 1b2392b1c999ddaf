"""GPU tests for te_compile.configure_tf32 and te_compile.capture (manual CUDA-graph capture of
compiled TE code), against eager TE.

The eager sequence runs first and is recorded; TE's global FP8 state is reset; then the
compiled/captured sequence runs on an identical module and is compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import recipe_instances, skip_unless_supported
from transformer_engine.pytorch import quantization as q

import te_compile

pytestmark = pytest.mark.gpu

FGS = q.FP8GlobalStateManager
IN, OUT, TOKENS = 256, 128, 64
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _patched():
    te_compile.patch()
    yield
    te_compile.unpatch()


def fresh_linear() -> te.Linear:
    torch.manual_seed(0)
    linear = te.Linear(IN, OUT, bias=True, params_dtype=BF16)
    with torch.no_grad():
        linear.bias.normal_()
    return linear


def inputs(n: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(TOKENS, IN, device="cuda", dtype=BF16) for _ in range(n)]


# ---- configure_tf32 ----------------------------------------------------------------------------


@pytest.fixture
def tf32_restored():
    b = torch.backends
    saved = (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision)
    yield
    b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision = saved


@pytest.mark.parametrize("api", ["fp32_precision", "allow_tf32"])
def test_configure_tf32_then_compile_fp8(api, tf32_restored):
    """Each API flavour: TF32 really applies to FP32 matmuls (results differ from IEEE), and an
    inductor-compiled function with an FP32 matmul and an FP8 te.Linear runs without torch's
    "mix of the legacy and new APIs" error, its te.Linear output bit-identical to eager."""
    skip_unless_supported("current")
    a = torch.randn(512, 512, device="cuda")
    b = torch.randn(512, 512, device="cuda")
    te_compile.configure_tf32(False, api=api)
    ieee = a @ b
    assert te_compile.configure_tf32(True, api=api) == api
    tf32 = a @ b
    assert not torch.equal(ieee, tf32), "TF32 did not apply to an FP32 matmul"

    linear, recipe = fresh_linear(), recipe_instances()["current"]
    x = inputs(1)[0]

    def fn(x, a, b):
        with te.autocast(recipe=recipe):
            y = linear(x)
        return y, a @ b

    eager_y, _ = fn(x, a, b)
    torch._dynamo.reset()
    compiled_y, compiled_mm = torch.compile(fn, fullgraph=True)(x, a, b)
    torch.testing.assert_close(compiled_y, eager_y, rtol=0, atol=0)
    torch.testing.assert_close(compiled_mm, tf32, rtol=1e-2, atol=1e-2)
    if api == "allow_tf32":  # the other API reads the same state
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"


# ---- capture -----------------------------------------------------------------------------------


def _eager_forward(recipe, xs, warmup):
    linear = fresh_linear()
    outs = []
    with torch.no_grad():
        for x in [xs[0]] * warmup + xs:
            with te.autocast(recipe=recipe):
                outs.append(linear(x).clone())
    return outs[warmup:]


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_capture_compiled_forward(name):
    skip_unless_supported(name)
    recipe, warmup, xs = recipe_instances()[name], 3, inputs(4)
    expected = _eager_forward(recipe, xs, warmup)
    FGS.reset()
    torch._dynamo.reset()

    linear = fresh_linear()

    def forward(x):
        with te.autocast(recipe=recipe):
            return linear(x)

    static_x = xs[0].clone()
    with torch.no_grad():
        graph = te_compile.capture(torch.compile(forward, fullgraph=True), static_x, warmup=warmup)
        for x, want in zip(xs, expected, strict=True):
            got = graph(x)  # new input values, copied into the static input, then a replay
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def _eager_training(recipe, xs, grads, warmup):
    """Per step: output, input grad, weight grad, bias grad (and DelayedScaling state last)."""
    linear = fresh_linear()
    steps = []
    for x, g in [(xs[0], grads[0])] * warmup + list(zip(xs, grads, strict=True)):
        x = x.clone().requires_grad_()
        linear.weight.grad = linear.bias.grad = None
        with te.autocast(recipe=recipe):
            y = linear(x)
        y.backward(g)
        steps.append([t.clone() for t in (y, x.grad, linear.weight.grad, linear.bias.grad)])
    state = _delayed_state(linear)
    return steps[warmup:], state


def _delayed_state(linear):
    meta = getattr(linear, "fp8_meta", {})
    if not hasattr(meta.get("scaling_fwd"), "amax_history"):
        return []  # not DelayedScaling
    te_compile.flush_delayed_updates()  # what compiled modules left to the exit
    return [meta[k].amax_history.clone() for k in ("scaling_fwd", "scaling_bwd")] + [
        meta[k].scale.clone() for k in ("scaling_fwd", "scaling_bwd")
    ]


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_capture_compiled_forward_backward(name):
    """A compiled te.Linear fwd+bwd captured in one CUDA graph: after each replay with new input
    values, output and every gradient equal eager TE's step (DelayedScaling state too)."""
    skip_unless_supported(name)
    recipe, warmup = recipe_instances()[name], 3
    xs, grads = inputs(4), [torch.randn(TOKENS, OUT, device="cuda", dtype=BF16) for _ in range(4)]
    expected, expected_state = _eager_training(recipe, xs, grads, warmup)
    FGS.reset()
    torch._dynamo.reset()

    linear = fresh_linear()

    def forward(x):
        with te.autocast(recipe=recipe):
            return linear(x)

    compiled = torch.compile(forward, fullgraph=True)

    def step(x, g):
        y = compiled(x)
        y.backward(g)
        return y

    static_x = xs[0].clone().requires_grad_()
    static_g = grads[0].clone()
    params = [static_x, linear.weight, linear.bias]
    graph = te_compile.capture(step, static_x, static_g, warmup=warmup, reset_grads=params)
    for x, g, want in zip(xs, grads, expected, strict=True):
        y = graph(x.detach(), g)
        got = [y, static_x.grad, linear.weight.grad, linear.bias.grad]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(_delayed_state(linear), expected_state, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
