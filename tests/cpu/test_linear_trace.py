"""te.Linear under torch.compile(fullgraph=True), traced on CPU with a pretend GPU.

Forward traces run on fake CUDA tensors. Backward traces (AOTAutograd's joint graph) run on
meta tensors: the autograd engine asks the CUDA driver about fake CUDA tensors' devices, so
the tests add "meta" to the device types the compiled path accepts.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import compile_fullgraph, recipe_for
from transformer_engine.common import recipe as R

from te_compile.recipes import QuantConfig
from te_compile_testing import JointRecorder, op_args, op_results

FWD, BWD = "te_compile.linear_fwd", "te_compile.linear_bwd"
RECIPES = ["none", "current", "block"]
IN, OUT = 64, 32


def make_linear(monkeypatch, device, *, bias=True, dtype=torch.bfloat16, **kwargs):
    """A te.Linear whose parameters are `device` tensors (fake CUDA under fake_cuda)."""
    # TE refuses to construct without CUDA; pretend only while constructing, since dynamo's
    # metrics touch the driver when torch.cuda.is_available() is True.
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        linear = te.Linear(IN, OUT, bias=bias, params_dtype=dtype, device="meta", **kwargs)
    linear.weight = torch.nn.Parameter(torch.empty(OUT, IN, device=device, dtype=dtype))
    if bias:
        linear.bias = torch.nn.Parameter(torch.empty(OUT, device=device, dtype=dtype))
    return linear


def in_autocast(linear, recipe, **call_kwargs):
    def fn(x):
        ctx = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with ctx:
            return linear(x, **call_kwargs)

    return fn


def input_of(shape, device, requires_grad, dtype=torch.bfloat16):
    return torch.empty(shape, device=device, dtype=dtype, requires_grad=requires_grad)


SHAPES = {"2d": (32, IN), "3d": (4, 8, IN)}


def op_arg(node, name):
    return op_args(node)[name]


# ---- forward, fake CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("requires_grad", [True, False])
def test_forward_one_graph(
    name,
    bias,
    shape,
    requires_grad,
    patched,
    fake_gpu,
    fake_cuda,
    backend,
    graph_breaks,
    monkeypatch,
):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda", bias=bias)
    x = input_of(SHAPES[shape], "cuda", requires_grad)
    out = compile_fullgraph(in_autocast(linear, recipe_for(name)), backend)(x)
    assert out.shape == (*SHAPES[shape][:-1], OUT) and out.dtype == torch.bfloat16
    assert len(backend.graphs) == 1 and graph_breaks() == 0
    targets = backend.targets()
    assert targets.count(FWD) == 1, targets
    node = next(n for n in backend.graphs[0].graph.nodes if str(n.target) == FWD)
    assert QuantConfig.from_key(op_arg(node, "config")).kind == name  # the decoded recipe


def test_no_grad_saves_nothing(patched, fake_gpu, fake_cuda, backend, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    fn = in_autocast(linear, R.Float8CurrentScaling())
    with torch.no_grad():
        compile_fullgraph(fn, backend)(input_of((32, IN), "cuda", False))
    node = next(n for n in backend.graphs[0].graph.nodes if str(n.target) == FWD)
    assert (op_arg(node, "save_input"), op_arg(node, "save_weight")) == (False, False)


def test_blackwell_keeps_rowwise_layout_for_saved_fp8(patched, fake_gpu, monkeypatch):
    """Per-tensor FP8 on a GPU with non-TN FP8 GEMMs saves [M, K] data, not a transpose."""
    fake_gpu("blackwell")
    rec = JointRecorder()
    linear = make_linear(monkeypatch, "meta", bias=False)
    x = input_of((32, IN), "meta", True)
    torch.compile(in_autocast(linear, R.Float8CurrentScaling()), backend=rec.backend)(x)
    node = next(n for n in rec.fw[0].graph.nodes if "linear_fwd" in str(n.target))
    assert QuantConfig.from_key(op_arg(node, "config")).fp8_transpose is False
    saved_input = node.meta["val"][1]
    assert tuple(saved_input.shape) == (32, IN) and saved_input.dtype == torch.uint8


# ---- forward + backward, meta ------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("requires_grad", [True, False])
def test_forward_backward_joint_graph(
    name, bias, shape, requires_grad, patched, fake_gpu, graph_breaks, monkeypatch
):
    fake_gpu("hopper")
    rec = JointRecorder()
    linear = make_linear(monkeypatch, "meta", bias=bias)
    x = input_of(SHAPES[shape], "meta", requires_grad)
    out = torch.compile(in_autocast(linear, recipe_for(name)), backend=rec.backend, fullgraph=True)(
        x
    )
    out.sum().backward()
    assert graph_breaks() == 0
    assert len(rec.fw) == 1 and len(rec.bw) == 1
    assert rec.targets(rec.fw).count("te_compile.linear_fwd.default") == 1
    assert rec.targets(rec.bw).count("te_compile.linear_bwd.default") == 1
    assert linear.weight.grad.shape == (OUT, IN) and linear.weight.grad.dtype == torch.bfloat16
    if bias:
        assert linear.bias.grad.shape == (OUT,)
    if requires_grad:
        assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16
    else:
        assert x.grad is None
    if name == "none":  # no FP8: forward saves nothing of its own
        node = next(n for n in rec.fw[0].graph.nodes if "linear_fwd" in str(n.target))
        assert len(op_results(node)) == 1


@pytest.mark.parametrize("name", ["none", "current", "block"])
def test_fp32_activations(name, patched, fake_gpu, graph_breaks, monkeypatch):
    """FP32 parameters and input (torch.autocast is off on a machine without CUDA)."""
    fake_gpu("hopper")
    rec = JointRecorder()
    linear = make_linear(monkeypatch, "meta", dtype=torch.float32)
    x = input_of((32, IN), "meta", True, dtype=torch.float32)
    fn = in_autocast(linear, recipe_for(name))
    out = torch.compile(fn, backend=rec.backend, fullgraph=True)(x)
    out.sum().backward()
    assert out.dtype == torch.float32 and graph_breaks() == 0
    assert linear.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


# ---- what the compiled path refuses ------------------------------------------------------------


UNSUPPORTED_MODULE_OPTIONS = {
    "delay_wgrad_compute": dict(delay_wgrad_compute=True),
    "save_original_input": dict(save_original_input=True),
}


def _compile_call(linear, recipe, x, **call_kwargs):
    return compile_fullgraph(in_autocast(linear, recipe, **call_kwargs), "eager")(x)


@pytest.mark.parametrize("option", list(UNSUPPORTED_MODULE_OPTIONS))
def test_unsupported_module_options_are_named(option, patched, fake_gpu, fake_cuda, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda", **UNSUPPORTED_MODULE_OPTIONS[option])
    with pytest.raises(RuntimeError, match=f"te.Linear with {option}.*not supported"):
        _compile_call(linear, R.Float8CurrentScaling(), input_of((32, IN), "cuda", True))


@pytest.mark.parametrize(
    "attr,value,option",
    [
        ("ub_overlap_rs_fprop", True, "userbuffers overlap"),
        ("ub_bulk_wgrad", True, "userbuffers overlap"),
        # (parameters_split is supported: tests/cpu/test_linear_split_trace.py; tensor
        # parallelism: tests/cpu/test_tensor_parallel_trace.py; FP8
        # parameters, quantized_model_init: tests/cpu/test_fp8_params_trace.py)
    ],
)
def test_unsupported_module_state_is_named(
    attr, value, option, patched, fake_gpu, fake_cuda, monkeypatch
):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    object.__setattr__(linear, attr, value)
    with pytest.raises(RuntimeError, match=f"te.Linear with {option}"):
        _compile_call(linear, R.Float8CurrentScaling(), input_of((32, IN), "cuda", True))


@pytest.mark.parametrize(
    "call_kwargs,option",
    [
        (dict(fp8_output=True), "fp8_output"),
        (dict(fp8_grad=True), "fp8_grad"),
    ],
)
def test_unsupported_call_options_are_named(
    call_kwargs, option, patched, fake_gpu, fake_cuda, monkeypatch
):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    x = input_of((32, IN), "cuda", True)
    with pytest.raises(RuntimeError, match=f"te.Linear with {option}"):
        _compile_call(linear, R.Float8CurrentScaling(), x, **call_kwargs)


@pytest.mark.parametrize(
    "name,generation,option",
    [
        ("custom", "hopper", "CustomRecipe recipe"),
    ],
)
def test_unsupported_recipes_are_named(
    name, generation, option, patched, fake_gpu, fake_cuda, monkeypatch
):
    """MXFP8 and NVFP4 are supported on Blackwell (test_linear_blackwell_trace.py)."""
    fake_gpu(generation)
    linear = make_linear(monkeypatch, "cuda")
    with pytest.raises(RuntimeError, match=f"te.Linear with (the )?{option}"):
        _compile_call(linear, recipe_for(name), input_of((32, IN), "cuda", True))


def test_backward_override_is_named(patched, fake_gpu, fake_cuda, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    recipe = R.Float8CurrentScaling(backward_override="high_precision")
    with pytest.raises(RuntimeError, match="te.Linear with backward_override='high_precision'"):
        _compile_call(linear, recipe, input_of((32, IN), "cuda", True))


def test_calibration_is_named(patched, fake_gpu, fake_cuda, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")

    def fn(x):
        with te.autocast(enabled=False, calibrating=True, recipe=R.DelayedScaling()):
            return linear(x)

    with pytest.raises(RuntimeError, match="calibrating=True"):
        compile_fullgraph(fn, "eager")(input_of((32, IN), "cuda", True))


# ---- bad input: clear errors, not dynamo internals ---------------------------------------------


def test_fp8_dims_not_multiple_of_16(patched, fake_gpu, fake_cuda, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    with pytest.raises(RuntimeError, match="divisible by 8"):
        _compile_call(linear, R.Float8CurrentScaling(), input_of((30, IN), "cuda", True))


def test_cpu_input(patched, fake_gpu, fake_cuda, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        _compile_call(linear, None, input_of((32, IN), "cpu", True))


def test_dtype_mismatch(patched, fake_gpu, fake_cuda, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    x = input_of((32, IN), "cuda", True, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Data types for parameters must match"):
        _compile_call(linear, None, x)


def test_wrong_in_features(patched, fake_gpu, fake_cuda, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    with pytest.raises(RuntimeError, match="in_features=64"):
        _compile_call(linear, None, input_of((32, IN + 16), "cuda", True))


def test_unpatched_te_does_not_compile(fake_gpu, fake_cuda, monkeypatch):
    """The check that proves these tests can fail: vanilla TE refuses DelayedScaling under
    compile (its other recipes reach its own custom op, whose run on fake CUDA tensors needs a
    driver: no verdict without a GPU)."""
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    with pytest.raises(Exception, match="DelayedScaling is not supported under torch.compile"):
        _compile_call(linear, R.DelayedScaling(), input_of((32, IN), "cuda", True))
