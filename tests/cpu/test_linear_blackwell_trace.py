"""te.Linear with MXFP8BlockScaling and NVFP4BlockScaling under torch.compile(fullgraph=True),
traced on CPU with a pretend Blackwell GPU (these recipes need cc >= 10.0, as in eager TE).

Forward traces run on fake CUDA tensors, joint forward + backward traces on meta tensors (see
test_linear_trace.py). The saved column-wise parts are compared with what TE's own quantizers
allocate (`make_empty` on meta, TE's C++ allocation), and our quantizer configuration with the
quantizers TE's recipe state builds for te.Linear's roles.
"""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import compile_fullgraph
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q
from transformer_engine.pytorch import utils as te_utils
from transformer_engine.pytorch.module import base
from transformer_engine.pytorch.tensor import nvfp4_tensor

from te_compile.kernels import operands_mx
from te_compile.kernels.fp8_operands import quantizer as make_quantizer
from te_compile.recipes import QuantConfig, for_linear
from te_compile.spec import GemmGrads
from te_compile_testing import JointRecorder, op_args, op_results, op_targets

IN, OUT = 64, 32
SHAPES = {"2d": (32, IN), "3d": (4, 8, IN)}
RECIPES = {"mxfp8": R.MXFP8BlockScaling, "nvfp4": R.NVFP4BlockScaling}
FWD, BWD = "te_compile.linear_fwd.default", "te_compile.linear_bwd.default"


def make_linear(monkeypatch, device, *, bias=True, dtype=torch.bfloat16):
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        linear = te.Linear(IN, OUT, bias=bias, params_dtype=dtype, device="meta")
    linear.weight = torch.nn.Parameter(torch.empty(OUT, IN, device=device, dtype=dtype))
    if bias:
        linear.bias = torch.nn.Parameter(torch.empty(OUT, device=device, dtype=dtype))
    return linear


def in_autocast(linear, recipe):
    def fn(x):
        with te.autocast(recipe=recipe):
            return linear(x)

    return fn


def fwd_node(graphs):
    return next(n for gm in graphs for n in gm.graph.nodes if "linear_fwd" in str(n.target))


@pytest.fixture
def blackwell(patched, fake_gpu):
    fake_gpu("blackwell")


@pytest.fixture
def nvfp4_without_gpu(monkeypatch):
    """NVFP4Quantizer's constructor asks for the current CUDA device and builds its Hadamard
    matrix there: build those on the CPU instead (TE's own functions, same values)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    mask = nvfp4_tensor.get_sign_from_vector(nvfp4_tensor.get_wgrad_sign_vector("cpu"))
    monkeypatch.setattr(
        nvfp4_tensor, "get_random_sign_mask_for_rht", lambda signed, device: mask if signed else 0
    )
    rht = nvfp4_tensor.get_rht_matrix.__wrapped__
    monkeypatch.setattr(nvfp4_tensor, "get_rht_matrix", lambda signed, device: rht(signed, "cpu"))


# ---- forward, fake CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("requires_grad", [True, False])
def test_forward_one_graph(
    name, bias, shape, requires_grad, blackwell, fake_cuda, backend, graph_breaks, monkeypatch
):
    linear = make_linear(monkeypatch, "cuda", bias=bias)
    x = torch.empty(SHAPES[shape], device="cuda", dtype=torch.bfloat16).requires_grad_(
        requires_grad
    )
    out = compile_fullgraph(in_autocast(linear, RECIPES[name]()), backend)(x)
    assert out.shape == (*SHAPES[shape][:-1], OUT) and out.dtype == torch.bfloat16
    assert len(backend.graphs) == 1 and graph_breaks() == 0
    assert op_targets(backend.graphs).count("te_compile.linear_fwd") == 1
    node = fwd_node(backend.graphs)
    assert QuantConfig.from_key(op_args(node)["config"]).kind == name


# ---- forward + backward, meta ------------------------------------------------------------------


def joint_trace(name, bias, shape, requires_grad, monkeypatch, recipe=None):
    rec = JointRecorder()
    linear = make_linear(monkeypatch, "meta", bias=bias)
    x = torch.empty(SHAPES[shape], device="meta", dtype=torch.bfloat16)
    x.requires_grad_(requires_grad)
    fn = in_autocast(linear, recipe or RECIPES[name]())
    out = torch.compile(fn, backend=rec.backend, fullgraph=True)(x)
    out.sum().backward()
    return linear, x, rec


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("requires_grad", [True, False])
def test_forward_backward_joint_graph(
    name, bias, shape, requires_grad, blackwell, graph_breaks, monkeypatch
):
    linear, x, rec = joint_trace(name, bias, shape, requires_grad, monkeypatch)
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert op_targets(rec.fw).count(FWD) == 1 and op_targets(rec.bw).count(BWD) == 1
    assert linear.weight.grad.shape == (OUT, IN) and linear.weight.grad.dtype == torch.bfloat16
    if bias:
        assert linear.bias.grad.shape == (OUT,) and linear.bias.grad.dtype == torch.bfloat16
    if requires_grad:
        assert x.grad.shape == x.shape and x.grad.dtype == torch.bfloat16
    else:
        assert x.grad is None
    # Saved: the input's column-wise half (wgrad); the weight's only when dgrad is needed.
    per_operand = 3 if name == "nvfp4" else 2
    saved = op_results(fwd_node(rec.fw))[1:]
    assert len(saved) == per_operand * (2 if requires_grad else 1)


def te_columnwise_parts(name, shape, role):
    """The column-wise parts TE's own quantizer allocates for a `shape` operand (C++
    create_tensor on the meta device), as (shape, dtype) pairs."""
    cfg = for_linear(RECIPES[name](), fp8_transpose=False)
    quantizer = operands_mx.make_mx_quantizer(cfg, role, rowwise=False, columnwise=True)
    quantizer.internal = True
    storage = quantizer.make_empty(shape, dtype=torch.bfloat16, device="meta")
    names = ["_columnwise_data", "_columnwise_scale_inv"]
    if name == "nvfp4":
        names.append("_amax_columnwise")
    return [(tuple(getattr(storage, n).shape), getattr(storage, n).dtype) for n in names]


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_saved_parts_match_te_allocation(
    name, shape, blackwell, graph_breaks, monkeypatch, nvfp4_without_gpu
):
    _, _, rec = joint_trace(name, True, shape, True, monkeypatch)
    saved = op_results(fwd_node(rec.fw))[1:]
    got = [(tuple(t.shape), t.dtype) for t in saved]
    want = te_columnwise_parts(name, SHAPES[shape], "input")
    want += te_columnwise_parts(name, (OUT, IN), "weight")
    assert got == want
    # The backward op receives exactly these tensors.
    # (linear_bwd mutates, so functionalization wraps it: its arguments are kwargs)
    bwd = next(n for gm in rec.bw for n in gm.graph.nodes if "auto_functionalized" in str(n.target))
    assert "linear_bwd" in str(bwd.args[0])
    bwd_parts = [a.meta["val"] for a in bwd.kwargs["parts"]]
    assert [(tuple(t.shape), t.dtype) for t in bwd_parts] == want
    assert GemmGrads.from_key(bwd.kwargs["grads"]).input_parts == len(want) // 2


def test_nvfp4_3d_columnwise_data_is_2d(nvfp4_without_gpu):
    """TE's C++ lays NVFP4 column-wise data out over [M, K]; TE's Python spec does not."""
    specs = operands_mx.nvfp4_columnwise_specs((4, 8, IN))
    assert specs[0] == ((IN, 16), torch.uint8)
    assert te_columnwise_parts("nvfp4", (4, 8, IN), "input")[0] == specs[0]


# ---- quantizer configuration, per role, against TE's recipe state -------------------------------


ROLE_TENSOR_TYPES = {"input": "input", "weight": "weight", "grad": "grad_output"}


def te_linear_quantizer(recipe, role):
    """The quantizer TE's recipe state makes for te.Linear's `role` (module/linear.py
    get_quantizer_roles)."""
    fwd = role != "grad"
    roles = [q.QuantizerRole(module_type="linear", tensor_type=ROLE_TENSOR_TYPES[role])]
    state = q.RecipeState.create(
        recipe, mode="forward" if fwd else "backward", num_quantizers=1, roles=roles
    )
    return state.make_quantizers()[0]


MX_RECIPES = {
    "mxfp8": R.MXFP8BlockScaling(),
    "mxfp8-2d-hybrid": R.MXFP8BlockScaling(enable_2d_quantization=True, fp8_format=R.Format.HYBRID),
    "nvfp4": R.NVFP4BlockScaling(),
    "nvfp4-plain": R.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
    ),
}
QUANTIZER_FIELDS = (
    "dtype",
    "with_2d_quantization",
    "with_rht",
    "with_post_rht_amax",
    "stochastic_rounding",
    "row_scaled_nvfp4",
    "nvfp4_use_4over6",
    "nvfp4_e4m3_max",
    "nvfp4_4over6_err_mode",
    "rht_matrix_random_sign_mask_t",
    "with_amax_reduction",
)


@pytest.mark.parametrize("recipe_name", list(MX_RECIPES))
@pytest.mark.parametrize("role", ["input", "weight", "grad"])
def test_quantizers_match_te_recipe_state(recipe_name, role, pretend, nvfp4_without_gpu):
    pretend("blackwell")
    recipe = MX_RECIPES[recipe_name]
    ours = make_quantizer(
        for_linear(recipe, fp8_transpose=False),
        role,
        rowwise=True,
        columnwise=True,
        weight_shape=(OUT, IN),
    )
    theirs = te_linear_quantizer(recipe, role)
    assert type(ours) is type(theirs)  # C++ dispatches on the exact type
    for field in QUANTIZER_FIELDS:
        if hasattr(theirs, field):
            assert getattr(ours, field) == getattr(theirs, field), field
    # te.Linear's own flags (linear.py:2430, 2590-2600).
    assert ours.internal
    assert ours.optimize_for_gemm == (
        True if role != "weight" else module_linear_preswizzle(theirs, (OUT, IN))
    )


def module_linear_preswizzle(quantizer, shape):
    """TE's weight preswizzle rule (base.py:1277-1308) for a `shape` weight."""

    class Module:
        primary_weights_in_fp8 = False

    weight = torch.empty(shape, device="meta")
    return base.TransformerEngineBaseModule._enable_weight_preswizzle(Module, quantizer, weight)


@pytest.fixture
def pretend(fake_gpu, monkeypatch):
    """fake_gpu, plus module/base.py's own binding of the compute-capability query."""

    def set_generation(generation):
        fake_gpu(generation)
        monkeypatch.setattr(
            base, "get_device_compute_capability", te_utils.get_device_compute_capability
        )

    return set_generation


@pytest.mark.parametrize("shape", [(OUT, IN), (128, 128), (64, 256), (256, 128)])
@pytest.mark.parametrize("generation", ["blackwell", "hopper"])
def test_nvfp4_weight_swizzle_rule(shape, generation, pretend, nvfp4_without_gpu):
    """For the NVFP4 weight (2-D, no RHT) our scale-layout rule agrees with TE's preswizzle
    rule, which the C++ kernel choice then follows (quantizer.cpp:1934-1966)."""
    pretend(generation)
    recipe = R.NVFP4BlockScaling()
    cfg = for_linear(recipe, fp8_transpose=False)
    expected = module_linear_preswizzle(te_linear_quantizer(recipe, "weight"), shape)
    assert operands_mx.swizzled_scales(cfg, "weight", shape) == expected


def test_quant_config_per_role():
    nvfp4 = for_linear(R.NVFP4BlockScaling(), fp8_transpose=False)
    assert nvfp4.kind == "nvfp4" and nvfp4.dtypes == ("e2m1",) * 3
    assert nvfp4.rht == (True, False, True)
    assert nvfp4.stochastic_rounding == (False, False, True)
    assert nvfp4.block_dims == (1, 2, 1)
    assert nvfp4.split_acc == (False, True, True)  # no fp8_gemm_* fields: TE's defaults
    mxfp8 = for_linear(R.MXFP8BlockScaling(fp8_format=R.Format.HYBRID), fp8_transpose=False)
    assert mxfp8.dtypes == ("e4m3", "e4m3", "e5m2") and mxfp8.block_dims == (1, 1, 1)
    assert mxfp8.rht == (False,) * 3 and mxfp8.stochastic_rounding == (False,) * 3


# ---- what is refused ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_hopper_refuses_with_te_reason(name, patched, fake_gpu, fake_cuda, monkeypatch):
    fake_gpu("hopper")
    linear = make_linear(monkeypatch, "cuda")
    x = torch.empty(32, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fmt = name.upper()
    with pytest.raises(Exception, match=f"10.0 or higher required for {fmt} execution"):
        compile_fullgraph(in_autocast(linear, RECIPES[name]()), "eager")(x)


@pytest.mark.parametrize(
    "kwargs,option",
    [
        (dict(row_scaled_activation=True, disable_rht=True), "row_scaled_activation=True"),
        (dict(nvfp4_4over6="weights"), "nvfp4_4over6='weights'"),
    ],
)
def test_unsupported_nvfp4_options_are_named(kwargs, option, blackwell, fake_cuda, monkeypatch):
    linear = make_linear(monkeypatch, "cuda")
    x = torch.empty(32, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match=f"te.Linear with NVFP4BlockScaling\\({option}"):
        compile_fullgraph(in_autocast(linear, R.NVFP4BlockScaling(**kwargs)), "eager")(x)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("role,shape", [("input", (4, 8, IN)), ("weight", (128, 256))])
def test_rebuilt_storage_matches_te(name, role, shape, pretend, nvfp4_without_gpu):
    """The backward op's column-wise storage, rebuilt from the saved parts, carries what TE's
    own column-wise storage carries (everything the GEMM reads; no quantizer needed)."""
    from te_compile.kernels.fp8_operands import columnwise_storage

    pretend("blackwell")
    cfg = for_linear(RECIPES[name](), fp8_transpose=False)
    quantizer = make_quantizer(cfg, role, rowwise=False, columnwise=True, weight_shape=shape)
    if name == "nvfp4":  # TE's C++ asks the GPU's SM version for NVFP4's scale layout
        quantizer.optimize_for_gemm = False
    theirs = quantizer.make_empty(shape, dtype=torch.bfloat16, device="meta")
    specs = te_columnwise_parts(name, shape, role)
    parts = [torch.empty(s, dtype=d, device="meta") for s, d in specs]
    ours = columnwise_storage(parts, cfg, role, torch.bfloat16)
    assert type(ours) is type(theirs)
    mine, want = ours.get_metadata(), theirs.get_metadata()
    for key, value in want.items():
        if key == "quantizer":
            continue
        if isinstance(value, torch.Tensor) or value is None:
            got = mine[key]
            assert (got is None) == (value is None), key
            if value is not None:
                assert got.shape == value.shape and got.dtype == value.dtype, key
        elif key != "with_gemm_swizzled_scales":
            assert mine[key] == value, key
    if name == "mxfp8":
        assert ours._with_gemm_swizzled_scales == theirs._with_gemm_swizzled_scales


def test_mxfp8_fp32_activations(blackwell, graph_breaks, monkeypatch):
    """FP32 parameters and input (NVFP4's Hadamard transform takes BF16 only, in eager too)."""
    rec = JointRecorder()
    linear = make_linear(monkeypatch, "meta", dtype=torch.float32)
    x = torch.empty(32, IN, device="meta", dtype=torch.float32, requires_grad=True)
    fn = in_autocast(linear, R.MXFP8BlockScaling())
    out = torch.compile(fn, backend=rec.backend, fullgraph=True)(x)
    out.sum().backward()
    assert out.dtype == torch.float32 and graph_breaks() == 0
    assert linear.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
