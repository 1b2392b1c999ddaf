"""te.LayerNormMLP without a GPU: its ops checked on meta tensors (tests/meta_opcheck.py), and
fullgraph traces of the module, forward and joint backward, per recipe and option."""

from __future__ import annotations

import mlp_cases
import pytest
import torch
from meta_opcheck import opcheck_on_meta
from transformer_engine.common import recipe as R

import te_compile.ops  # noqa: F401  (registers the ops)
from te_compile.ops import layernorm_mlp
from te_compile.ops.layernorm_mlp_layout import MLPFlags
from te_compile.recipes import for_linear
from te_compile.spec import NormSpec
from te_compile_testing import op_args, op_results

RECIPES = {
    "none": (lambda: None, "hopper"),
    "current": (R.Float8CurrentScaling, "hopper"),
    "block": (R.Float8BlockScaling, "hopper"),
    "delayed": (R.DelayedScaling, "hopper"),
    "mxfp8": (R.MXFP8BlockScaling, "blackwell"),
    "nvfp4": (R.NVFP4BlockScaling, "blackwell"),
}


def _config(name):
    make, generation = RECIPES[name]
    return for_linear(make(), fp8_transpose=generation == "hopper").key


OPCHECK_CASES = [
    # (recipe, activation, normalization, bias, return_ln)
    *[(name, "gelu", "LayerNorm", True, False) for name in RECIPES],
    *[(name, "swiglu", "RMSNorm", False, False) for name in RECIPES],
    ("none", "relu", "LayerNorm", True, True),
    ("current", "srelu", "RMSNorm", True, True),
    ("delayed", "clamped_swiglu", "LayerNorm", False, True),
]


@pytest.mark.parametrize("name,act,norm,bias,return_ln", OPCHECK_CASES)
def test_layernorm_mlp_ops_opcheck_on_fake(name, act, norm, bias, return_ln, fake_gpu, fake_cuda):
    fake_gpu(RECIPES[name][1])
    keys = mlp_cases.spec_keys(act, norm, return_ln, bias_gelu=name == "none" and act == "gelu")
    args = mlp_cases.fwd_args(_config(name), keys, bias, name == "delayed")
    opcheck_on_meta(torch.ops.te_compile.layernorm_mlp_fwd.default, (), args)
    bwd = mlp_cases.bwd_args(args)
    opcheck_on_meta(torch.ops.te_compile.layernorm_mlp_bwd.default, (), bwd)


# ---- the module, traced ----------------------------------------------------------------------

FWD, BWD = "te_compile.layernorm_mlp_fwd.default", "te_compile.layernorm_mlp_bwd.default"
UPDATE = "te_compile.amax_and_scale_update.default"
HIDDEN, FFN = 64, 128


@pytest.fixture
def meta_gpu(patched, fake_gpu, monkeypatch):
    """`meta_gpu("hopper")`: compiled paths accept meta tensors and TE's recipe state is
    allocated on meta (joint traces without a GPU)."""
    import contextlib

    from te_compile_testing import recipe_state_on

    stack = contextlib.ExitStack()

    def enter(generation):
        fake_gpu(generation)
        stack.enter_context(recipe_state_on("meta"))

    yield enter
    stack.close()


def make_mlp(**kwargs):
    import transformer_engine.pytorch as te

    from te_compile_testing import build_without_gpu

    kwargs.setdefault("params_dtype", torch.bfloat16)
    return build_without_gpu(lambda: te.LayerNormMLP(HIDDEN, FFN, device="meta", **kwargs), "meta")


def step_fn(module, recipe, **call_kwargs):
    import contextlib

    import transformer_engine.pytorch as te

    def step(x):
        ctx = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with ctx:
            return module(x, **call_kwargs)

    return step


def joint_trace(module, recipe, x, **call_kwargs):
    """Compile one step (fullgraph, AOTAutograd recording), run forward and backward."""
    from te_compile_testing import JointRecorder

    rec = JointRecorder()
    out = torch.compile(
        step_fn(module, recipe, **call_kwargs), backend=rec.backend, fullgraph=True
    )(x)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.float().sum() for o in outs if o is not None and o.requires_grad).backward()
    return out, rec


def x_meta(shape=(4, 8, HIDDEN), requires_grad=True, dtype=torch.bfloat16):
    return torch.empty(shape, device="meta", dtype=dtype, requires_grad=requires_grad)


def _targets(graphs):
    from te_compile_testing import op_targets

    return op_targets(graphs)


ACTIVATIONS = list(__import__("te_compile.kernels.activation", fromlist=["x"]).ACTIVATIONS)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("name", list(RECIPES))
def test_activation_x_recipe_joint_graph(act, name, meta_gpu, graph_breaks):
    make, generation = RECIPES[name]
    meta_gpu(generation)
    mlp = make_mlp(activation=act)
    x = x_meta()
    out, rec = joint_trace(mlp, make(), x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert _targets(rec.fw).count(FWD) == 1 and _targets(rec.bw).count(BWD) == 1
    assert x.grad.shape == x.shape
    fc1_out = (
        2 * FFN
        if act in ("geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")
        else FFN
    )
    assert mlp.fc1_weight.grad.shape == (fc1_out, HIDDEN)
    assert mlp.fc2_weight.grad.shape == (HIDDEN, FFN)
    for p in (mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.fc1_bias, mlp.fc2_bias):
        assert p.grad is not None and p.grad.shape == p.shape
    if name == "delayed":
        assert _targets(rec.fw).count(UPDATE) == 1  # the forward update at autocast exit
        assert mlp.fp8_meta["scaling_fwd"].amax_history.shape[1] == 6  # two GEMMs
        assert mlp.fp8_meta["scaling_bwd"].amax_history.shape[1] == 4


OPTION_CASES = {
    "rmsnorm": dict(normalization="RMSNorm"),
    "no_bias": dict(bias=False),
    "return_ln": dict(return_layernorm_output=True),
    "return_ln_rmsnorm_nobias": dict(
        return_layernorm_output=True, normalization="RMSNorm", bias=False
    ),
    "zero_centered_gamma": dict(zero_centered_gamma=True),
    "return_bias": dict(return_bias=True),
    "return_bias_and_ln": dict(return_bias=True, return_layernorm_output=True),
    "set_parallel_mode": dict(set_parallel_mode=True),
    "clamped_swiglu_params": dict(
        activation="clamped_swiglu", activation_params={"limit": 5.0, "alpha": 1.5}
    ),
}


@pytest.mark.parametrize("option", list(OPTION_CASES))
@pytest.mark.parametrize("name", ["none", "current", "delayed", "mxfp8"])
def test_options_joint_graph(option, name, meta_gpu, graph_breaks):
    make, generation = RECIPES[name]
    meta_gpu(generation)
    kwargs = dict(OPTION_CASES[option])
    mlp = make_mlp(**kwargs)
    x = x_meta()
    out, rec = joint_trace(mlp, make(), x)
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    outs = out if isinstance(out, tuple) else (out,)
    assert outs[0].shape == x.shape
    if kwargs.get("return_layernorm_output"):
        assert outs[-1].shape == x.shape
    if kwargs.get("return_bias"):
        assert outs[1].shape == (HIDDEN,)
    assert x.grad.shape == x.shape and mlp.layer_norm_weight.grad is not None
    assert mlp.fc1_weight.grad is not None and mlp.fc2_weight.grad is not None
    node = next(n for n in rec.fw[0].graph.nodes if str(n.target) == FWD)
    args = op_args(node)
    norm = NormSpec.from_key(args["norm"])
    assert norm.normalization == mlp.normalization
    assert norm.zero_centered_gamma == mlp.zero_centered_gamma
    if option == "clamped_swiglu_params":
        assert layernorm_mlp.MLPSpec.from_key(args["mlp"]).params == (5.0, 1.5, 1.0)


@pytest.mark.parametrize("name", ["none", "current", "block"])
def test_forward_fake_cuda_one_graph(name, patched, fake_gpu, fake_cuda, backend, graph_breaks):
    """Forward only on fake CUDA tensors (no meta): one graph, one op, TE's decoded recipe."""
    import transformer_engine.pytorch as te

    from te_compile_testing import cuda_reported_available

    fake_gpu("hopper")
    with cuda_reported_available():
        mlp = te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16, device="meta")
    for owner in mlp.modules():
        for pname, p in list(owner.named_parameters(recurse=False)):
            setattr(
                owner, pname, torch.nn.Parameter(torch.empty(p.shape, device="cuda", dtype=p.dtype))
            )
    x = torch.empty(4, 8, HIDDEN, device="cuda", dtype=torch.bfloat16)
    out = torch.compile(step_fn(mlp, RECIPES[name][0]()), backend=backend, fullgraph=True)(x)
    assert out.shape == x.shape and len(backend.graphs) == 1 and graph_breaks() == 0
    assert backend.targets().count("te_compile.layernorm_mlp_fwd") == 1


def test_no_grad_saves_nothing(meta_gpu):
    meta_gpu("hopper")
    from te_compile_testing import JointRecorder

    mlp = make_mlp()
    rec = JointRecorder()
    with torch.no_grad():
        torch.compile(step_fn(mlp, R.Float8CurrentScaling()), backend=rec.backend, fullgraph=True)(
            x_meta(requires_grad=False)
        )
    node = next(n for gm in rec.fw for n in gm.graph.nodes if str(n.target) == FWD)
    assert _save_flags(node) == (False, False, False, False)
    assert len(op_results(node)) == 1  # just the output


def test_frozen_weights_skip_their_parts(meta_gpu, graph_breaks):
    """Only the input needs a grad: no FC1/FC2 input parts are saved, no wgrads run."""
    meta_gpu("hopper")
    mlp = make_mlp()
    for p in mlp.parameters():
        p.requires_grad_(False)
    x = x_meta()
    _, rec = joint_trace(mlp, R.Float8CurrentScaling(), x)
    assert graph_breaks() == 0 and x.grad.shape == x.shape
    node = next(n for n in rec.fw[0].graph.nodes if str(n.target) == FWD)
    assert _save_flags(node) == (True, False, True, False)
    # mu, rsigma, FC1 weight parts (2), fc1_out, FC2 weight parts (2)
    assert len(op_results(node)) == 1 + 2 + 2 + 1 + 2


# ---- recipe-specific wiring --------------------------------------------------------------------


def _save_flags(node) -> tuple[bool, ...]:
    f = MLPFlags.from_key(op_args(node)["flags"])
    return (f.save_norm, f.save_fc1_input, f.save_fc1_out, f.save_fc2_input)


def _fwd_node(rec):
    return next(n for gm in rec.fw for n in gm.graph.nodes if str(n.target) == FWD)


@pytest.mark.parametrize("act,bias_gelu", [("gelu", True), ("relu", False)])
def test_bf16_gelu_uses_tes_bias_gelu_fusion(act, bias_gelu, meta_gpu):
    meta_gpu("hopper")
    _, rec = joint_trace(make_mlp(activation=act), None, x_meta())
    mlp = layernorm_mlp.MLPSpec.from_key(op_args(_fwd_node(rec))["mlp"])
    assert mlp.bias_gelu is bias_gelu


def test_delayed_state_is_tes_with_two_gemms(meta_gpu, graph_breaks):
    from transformer_engine.pytorch import quantization as q

    meta_gpu("hopper")
    recipe = R.DelayedScaling(amax_history_len=4)
    mlp = make_mlp()
    _, rec = joint_trace(mlp, recipe, x_meta())
    assert graph_breaks() == 0
    meta = mlp.fp8_meta
    assert meta["scaling_fwd"].amax_history.shape == (4, 6)
    assert meta["scaling_bwd"].amax_history.shape == (4, 4)
    fgs = q.FP8GlobalStateManager
    buffer = fgs.quantization_state.global_amax_history_buffer[
        fgs.get_key_in_buffer(True, recipe, None)
    ]
    assert any(h is meta["scaling_fwd"].amax_history for h in buffer)
    # The backward op mutates TE's backward scale and history (its update runs there).
    bwd = next(n for gm in rec.bw for n in gm.graph.nodes if "auto_functionalized" in str(n.target))
    assert "layernorm_mlp_bwd" in str(bwd.args[0])
    # [scale, amax_history], a mutated list (functionalization names its length and bases)
    assert bwd.kwargs.get("_bwd_state_length") == 2, bwd.kwargs.keys()


@pytest.mark.parametrize("name", ["current", "delayed", "block"])
def test_weight_caches_per_gemm_over_microbatches(name, meta_gpu, graph_breaks):
    """is_first_microbatch: both GEMM weights quantized into caches (quantize_weight), one graph
    per value of the flag."""
    make, _ = RECIPES[name]
    meta_gpu("hopper")
    mlp = make_mlp()
    recs = []
    for first in (True, False, False):
        _, rec = joint_trace(mlp, make(), x_meta(), is_first_microbatch=first)
        recs.append(rec)
        assert _targets(rec.fw).count("te_compile.quantize_weight.default") == 2
        args = op_args(_fwd_node(rec))
        assert args["fc1_cache"] and args["fc2_cache"]
        assert MLPFlags.from_key(args["flags"]).accumulate is (not first)
    assert graph_breaks() == 0
    caches = mlp._te_compile_weight_caches
    assert sorted(k.split("|")[0] for k in caches) == ["fc1_weight", "fc2_weight"]


@pytest.mark.parametrize("name", ["none", "current"])
def test_fuse_wgrad_accumulation_writes_main_grad(name, meta_gpu, graph_breaks):
    make, _ = RECIPES[name]
    meta_gpu("hopper")
    mlp = make_mlp(fuse_wgrad_accumulation=True)
    for w in (mlp.fc1_weight, mlp.fc2_weight):
        w.main_grad = torch.zeros(w.shape, device="meta", dtype=torch.float32)
    _, rec = joint_trace(mlp, make(), x_meta())
    assert graph_breaks() == 0
    assert mlp.fc1_weight.grad is None and mlp.fc2_weight.grad is None
    bwd = next(n for gm in rec.bw for n in gm.graph.nodes if "auto_functionalized" in str(n.target))
    mutated = [k for k in bwd.kwargs if "main_grad" in k]
    assert len(mutated) == 2, bwd.kwargs.keys()  # both main grads are mutated inputs


# ---- what the compiled path refuses, and bad input ----------------------------------------------


def _compile_call(mlp, recipe, x, **call_kwargs):
    return torch.compile(step_fn(mlp, recipe, **call_kwargs), backend="eager", fullgraph=True)(x)


REFUSED = {
    "gathered": (
        dict(return_layernorm_output_gathered=True),
        None,
        "return_layernorm_output_gathered",
    ),
    "delay_wgrad": (dict(delay_wgrad_compute=True), None, "delay_wgrad_compute"),
    "gemm_gelu_env": ({}, ("gemm_gelu_fusion", True), "NVTE_GEMM_GELU_FUSION"),
    "no_bias_gelu": ({}, ("bias_gelu_nvfusion", False), "cuBLAS GEMM epilogues"),
    # (tensor parallelism itself: tests/cpu/test_tensor_parallel_trace.py)
    "sp_alone": ({}, ("sequence_parallel", True), "sequence_parallel=True without set_parallel"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_options_are_named(case, meta_gpu):
    kwargs, attr, match = REFUSED[case]
    meta_gpu("hopper")
    mlp = make_mlp(**kwargs)
    if attr:
        setattr(mlp, *attr)
    recipe = None if case == "no_bias_gelu" else R.Float8CurrentScaling()
    with pytest.raises(Exception, match=f"te.LayerNormMLP with .*{match}.*not supported"):
        _compile_call(mlp, recipe, x_meta())


def test_unknown_activation_raises_tes_error(meta_gpu):
    meta_gpu("hopper")
    mlp = make_mlp()
    mlp.activation = "tanh"
    with pytest.raises(Exception, match="Activation type tanh is not supported"):
        _compile_call(mlp, None, x_meta())


@pytest.mark.parametrize(
    "shape,match",
    [((4, 8, HIDDEN + 16), "does not match hidden_size"), ((3, HIDDEN), "divisible by 8")],
)
def test_bad_input_gets_a_clear_error(shape, match, meta_gpu):
    meta_gpu("hopper")
    with pytest.raises(Exception, match=match):
        _compile_call(make_mlp(), R.Float8CurrentScaling(), x_meta(shape))


def test_without_patch_te_graph_breaks(fake_gpu, fake_cuda):
    """Negative control: unpatched, TE's LayerNormMLP does not compile with fullgraph."""
    import transformer_engine.pytorch as te

    from te_compile_testing import cuda_reported_available

    fake_gpu("hopper")
    with cuda_reported_available():
        mlp = te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16, device="meta")
    for owner in mlp.modules():
        for pname, p in list(owner.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, device="cuda", dtype=p.dtype)
            setattr(owner, pname, torch.nn.Parameter(empty))
    x = torch.empty(4, 8, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="torch.compiler.disable"):  # TE's forward opts out
        torch.compile(step_fn(mlp, None), backend="eager", fullgraph=True)(x)
