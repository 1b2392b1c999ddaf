"""te.LayerNormLinear under torch.compile(fullgraph=True), traced on CPU with a pretend GPU:
module x recipe x option matrix, forward + joint backward in one graph each, no graph breaks.

Joint graphs on meta tensors (TE's recipe state on meta too); see test_linear_trace.py.
"""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import RECIPE_GENERATION, compile_fullgraph, recipe_for, recipe_instances
from transformer_engine.common import recipe as R

from te_compile.modules import persistent_state
from te_compile.recipes import QuantConfig
from te_compile.spec import NormSpec
from te_compile_testing import (
    JointRecorder,
    build_without_gpu,
    op_args,
    op_results,
    op_targets,
    recipe_state_on,
)

IN, OUT = 64, 96
FWD, BWD = "te_compile.layernorm_linear_fwd.default", "te_compile.layernorm_linear_bwd.default"
QUANTIZE_WEIGHT = "te_compile.quantize_weight.default"
RECIPES = ["none", "current", "block", "delayed", "mxfp8", "nvfp4"]
NORMS = ["LayerNorm", "RMSNorm"]


def make(dtype=torch.bfloat16, **kwargs):
    return build_without_gpu(
        lambda: te.LayerNormLinear(IN, OUT, params_dtype=dtype, device="meta", **kwargs), "meta"
    )


def step_fn(module, recipe):
    def step(x, **kwargs):
        if recipe is None:
            return module(x, **kwargs)
        with te.autocast(recipe=recipe):
            return module(x, **kwargs)

    return step


@pytest.fixture
def meta_gpu(patched, fake_gpu, graph_breaks):
    """Pretend `generation`, accept meta tensors, TE's recipe state on meta."""

    def enter(generation):
        fake_gpu(generation)

    with recipe_state_on("meta"):
        yield enter, graph_breaks


def fwd_node(graphs):
    return next(
        n for gm in graphs for n in gm.graph.nodes if "layernorm_linear_fwd" in str(n.target)
    )


def joint(module, recipe, x, **kwargs):
    rec = JointRecorder()
    out = torch.compile(step_fn(module, recipe), backend=rec.backend, fullgraph=True)(x, **kwargs)
    return rec, out


def loss_of(out):
    if isinstance(out, tuple):
        return sum(o.float().sum() for o in out if o is not None)
    return out.float().sum()


# ---- the matrix --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_ln", [False, True])
def test_joint_graph(name, normalization, bias, return_ln, meta_gpu):
    enter, graph_breaks = meta_gpu
    enter(RECIPE_GENERATION.get(name, "hopper"))
    m = make(normalization=normalization, bias=bias, return_layernorm_output=return_ln)
    x = torch.empty(4, 8, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)
    rec, out = joint(m, recipe_for(name), x)
    loss_of(out).backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert op_targets(rec.fw).count(FWD) == 1 and op_targets(rec.bw).count(BWD) == 1
    y = out[0] if return_ln else out
    assert y.shape == (4, 8, OUT) and y.dtype == torch.bfloat16
    if return_ln:
        assert out[1].shape == x.shape and out[1].dtype == torch.bfloat16
    assert x.grad.shape == x.shape
    assert m.weight.grad.shape == (OUT, IN) and m.layer_norm_weight.grad.shape == (IN,)
    if normalization == "LayerNorm":
        assert m.layer_norm_bias.grad.shape == (IN,)
    if bias:
        assert m.bias.grad.shape == (OUT,)
    node = fwd_node(rec.fw)
    args = op_args(node)
    assert QuantConfig.from_key(args["config"]).kind == name
    assert NormSpec.from_key(args["norm"]).normalization == normalization
    # FP8 without a returned norm output fuses the norm with the input's quantization: the
    # high-precision norm output is then neither saved nor returned.
    has_ln_out = return_ln or name == "none"
    n_out = 3 + has_ln_out
    assert tuple(op_results(node)[3].shape) == (32, IN) if has_ln_out else True
    if name != "none" and not return_ln:
        assert all(t.dtype != torch.bfloat16 for t in op_results(node)[n_out:])


@pytest.mark.parametrize("name", ["none", "current", "block"])
def test_forward_only_fake_cuda(name, patched, fake_gpu, fake_cuda, backend, graph_breaks):
    fake_gpu("hopper")
    m = build_without_gpu(
        lambda: te.LayerNormLinear(IN, OUT, params_dtype=torch.bfloat16, device="meta"), "cuda"
    )
    x = torch.empty(32, IN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = compile_fullgraph(step_fn(m, recipe_for(name)), backend)(x)
    assert out.shape == (32, OUT) and len(backend.graphs) == 1 and graph_breaks() == 0
    assert backend.targets().count("te_compile.layernorm_linear_fwd") == 1


# ---- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["none", "current", "block"])
def test_parameters_split_qkv(name, meta_gpu):
    enter, graph_breaks = meta_gpu
    enter("hopper")
    split = {"query": 32, "key": 32, "value": 32}
    m = make(parameters_split=split)
    x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)
    rec, out = joint(m, recipe_for(name), x)
    out.sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert out.shape == (32, OUT)
    for part in ("query", "key", "value"):
        assert getattr(m, f"{part}_weight").grad.shape == (32, IN)
        assert getattr(m, f"{part}_bias").grad.shape == (32,)


@pytest.mark.parametrize("normalization", NORMS)
def test_zero_centered_gamma_and_fp32(normalization, meta_gpu):
    enter, graph_breaks = meta_gpu
    enter("hopper")
    m = make(torch.float32, normalization=normalization, zero_centered_gamma=True)
    x = torch.empty(32, IN, device="meta", dtype=torch.float32, requires_grad=True)
    rec, out = joint(m, R.Float8CurrentScaling(), x)
    out.sum().backward()
    assert out.dtype == torch.float32 and graph_breaks() == 0
    assert NormSpec.from_key(op_args(fwd_node(rec.fw))["norm"]).zero_centered_gamma is True
    assert m.layer_norm_weight.grad.dtype == torch.float32


def test_return_bias_and_layernorm_output(meta_gpu):
    enter, graph_breaks = meta_gpu
    enter("hopper")
    m = make(return_bias=True, return_layernorm_output=True)
    x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)
    rec, (out, bias, ln_out) = joint(m, R.Float8CurrentScaling(), x)
    assert bias.shape == (OUT,) and ln_out.shape == (32, IN)
    (out.sum() + ln_out.float().sum()).backward()
    assert graph_breaks() == 0 and m.weight.grad is not None


def test_return_layernorm_output_gathered_runs_unfused_without_ln_grad(meta_gpu):
    """As eager TE: a gathered norm output skips the fused norm+quantize, and its gradient is
    not added in backward (the returned tensor is detached)."""
    enter, graph_breaks = meta_gpu
    enter("hopper")
    m = make(return_layernorm_output=True, return_layernorm_output_gathered=True)
    x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)
    rec, (out, ln_out) = joint(m, R.Float8CurrentScaling(), x)
    assert not ln_out.requires_grad
    out.sum().backward()
    assert op_args(fwd_node(rec.fw))["return_ln_out"] is True and graph_breaks() == 0


@pytest.mark.parametrize("name", ["current", "block", "delayed"])
def test_weight_cache_over_microbatches(name, meta_gpu):
    enter, graph_breaks = meta_gpu
    enter("hopper")
    m = make(parameters_split=("query", "key", "value"))
    rec = JointRecorder()
    step = torch.compile(step_fn(m, recipe_for(name)), backend=rec.backend, fullgraph=True)
    for first in (True, False, False, True):
        x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)
        step(x, is_first_microbatch=first).sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 2 and len(rec.bw) == 2
    for fw in rec.fw:
        assert op_targets([fw]).count(QUANTIZE_WEIGHT) == 1
    caches = getattr(m, persistent_state.WEIGHT_CACHES_ATTR)
    ((valid, parts),) = caches.values()
    assert valid.shape == (1,)


@pytest.mark.parametrize("name", ["none", "current"])
def test_fuse_wgrad_accumulation(name, meta_gpu):
    enter, graph_breaks = meta_gpu
    enter("hopper")
    m = make(fuse_wgrad_accumulation=True)
    m.weight.main_grad = torch.zeros(OUT, IN, device="meta", dtype=torch.float32)
    x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)
    rec, out = joint(m, recipe_for(name), x)
    out.sum().backward()
    assert graph_breaks() == 0 and m.weight.grad is None
    bwd = next(n for gm in rec.bw for n in gm.graph.nodes if "auto_functionalized" in str(n.target))
    assert "layernorm_linear_bwd" in str(bwd.args[0])
    assert op_args(bwd)["main_grad"] is not None, bwd.kwargs


def test_delayed_state_created_with_one_gemm(meta_gpu):
    enter, graph_breaks = meta_gpu
    enter("hopper")
    m = make()
    x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)
    rec, out = joint(m, R.DelayedScaling(amax_history_len=4), x)
    out.sum().backward()
    assert m.fp8_meta["scaling_fwd"].amax_history.shape == (4, 3)
    assert m.fp8_meta["scaling_bwd"].amax_history.shape == (4, 2)
    assert "te_compile.amax_and_scale_update.default" in op_targets(rec.fw)


# ---- refusals and bad input --------------------------------------------------------------------


def _trace(m, recipe, x, **kwargs):
    return torch.compile(step_fn(m, recipe), backend="eager", fullgraph=True)(x, **kwargs)


@pytest.mark.parametrize(
    "kwargs,option",
    [
        (dict(fuse_wgrad_accumulation=True, parameters_split=("a", "b")), "parameters_split"),
        (dict(delay_wgrad_compute=True), "delay_wgrad_compute"),
    ],
)
def test_unsupported_options_are_named(kwargs, option, meta_gpu):
    enter, _ = meta_gpu
    enter("hopper")
    m = make(**kwargs)
    for name in m.weight_names:
        getattr(m, name).main_grad = torch.zeros(48, IN, device="meta")
    x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match=f"te.LayerNormLinear with .*{option}"):
        _trace(m, R.Float8CurrentScaling(), x)


def test_gathered_norm_output_under_sequence_parallelism_is_named(meta_gpu):
    """(Tensor parallelism itself: tests/cpu/test_tensor_parallel_trace.py.)"""
    enter, _ = meta_gpu
    enter("hopper")
    m = make()
    for attr, value in (("tp_size", 2), ("sequence_parallel", True), ("parallel_mode", "column")):
        object.__setattr__(m, attr, value)
    m.return_layernorm_output = m.return_layernorm_output_gathered = True
    x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16)
    match = "te.LayerNormLinear with return_layernorm_output_gathered=True with sequence_par"
    with pytest.raises(RuntimeError, match=match):
        _trace(m, None, x)


def test_custom_recipe_is_named(meta_gpu):
    enter, _ = meta_gpu
    enter("hopper")
    x = torch.empty(32, IN, device="meta", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="te.LayerNormLinear with the CustomRecipe"):
        _trace(make(), recipe_instances()["custom"], x)


@pytest.mark.parametrize(
    "shape,dtype,match",
    [
        ((32, IN + 16), torch.bfloat16, "in_features=64"),
        ((30, IN), torch.bfloat16, "divisible by 8"),
        ((32, IN), torch.float32, "Data types for parameters must match"),
    ],
)
def test_bad_input(shape, dtype, match, meta_gpu):
    enter, _ = meta_gpu
    enter("hopper")
    x = torch.empty(shape, device="meta", dtype=dtype)
    with pytest.raises(Exception, match=match):
        _trace(make(), R.Float8CurrentScaling(), x)


def test_unpatched_te_does_not_compile(fake_gpu, fake_cuda):
    fake_gpu("hopper")
    m = build_without_gpu(
        lambda: te.LayerNormLinear(IN, OUT, params_dtype=torch.bfloat16, device="meta"), "cuda"
    )
    x = torch.empty(32, IN, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="torch.compiler.disable"):  # TE's forward opts out
        torch.compile(step_fn(m, R.Float8CurrentScaling()), backend="eager", fullgraph=True)(x)
