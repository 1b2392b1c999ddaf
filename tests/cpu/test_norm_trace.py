"""te.LayerNorm and te.RMSNorm under torch.compile(fullgraph=True), traced on CPU.

Forward traces on fake CUDA tensors; joint forward + backward traces on meta tensors (see
test_linear_trace.py for why).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import compile_fullgraph
from transformer_engine.common import recipe as R

from te_compile.spec import NormSpec
from te_compile_testing import JointRecorder, build_without_gpu, op_args, op_targets

H = 64
NORMS = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm}
FWD, BWD = "te_compile.norm_fwd.default", "te_compile.norm_bwd.default"


def make_norm(name, device, dtype=torch.bfloat16, **kwargs):
    return build_without_gpu(
        lambda: NORMS[name](H, params_dtype=dtype, device="meta", **kwargs), device
    )


def call(norm, recipe=None):
    def fn(x):
        ctx = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with ctx:
            return norm(x)

    return fn


def op_node(graphs, name):
    return next(n for gm in graphs for n in gm.graph.nodes if name in str(n.target))


def norm_of(graphs) -> NormSpec:
    """The NormSpec of the graphs' norm_fwd call."""
    return NormSpec.from_key(op_args(op_node(graphs, "norm_fwd"))["norm"])


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("shape", [(32, H), (4, 8, H)])
def test_forward_one_graph(name, shape, patched, fake_gpu, fake_cuda, backend, graph_breaks):
    fake_gpu("hopper")
    norm = make_norm(name, "cuda", eps=1e-6)
    x = torch.empty(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = compile_fullgraph(call(norm), backend)(x)
    assert out.shape == shape and out.dtype == torch.bfloat16
    assert len(backend.graphs) == 1 and graph_breaks() == 0
    assert backend.targets().count("te_compile.norm_fwd") == 1
    spec = norm_of(backend.graphs)
    assert spec.normalization == name and spec.eps == 1e-6


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("recipe", [None, "current"])
def test_forward_backward_joint_graph(
    name, dtype, zero_centered_gamma, requires_grad, recipe, patched, fake_gpu, graph_breaks
):
    fake_gpu("hopper")
    rec = JointRecorder()
    norm = make_norm(name, "meta", dtype, zero_centered_gamma=zero_centered_gamma)
    x = torch.empty(4, 8, H, device="meta", dtype=dtype, requires_grad=requires_grad)
    r = R.Float8CurrentScaling() if recipe else None
    out = torch.compile(call(norm, r), backend=rec.backend, fullgraph=True)(x)
    out.sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert op_targets(rec.fw).count(FWD) == 1 and op_targets(rec.bw).count(BWD) == 1
    assert out.dtype == dtype
    assert norm.weight.grad.shape == (H,) and norm.weight.grad.dtype == dtype
    if name == "LayerNorm":
        assert norm.bias.grad.shape == (H,)
    assert (x.grad is not None) == requires_grad
    assert norm_of(rec.fw).zero_centered_gamma == zero_centered_gamma


def test_bf16_input_fp32_params_computes_in_fp32(patched, fake_gpu, graph_breaks):
    """As TE's op: the compute dtype is the weight's; the input is cast to it."""
    fake_gpu("hopper")
    rec = JointRecorder()
    norm = make_norm("RMSNorm", "meta", torch.float32)
    x = torch.empty(32, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = torch.compile(call(norm), backend=rec.backend, fullgraph=True)(x)
    out.sum().backward()
    assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert graph_breaks() == 0


def test_sm_margin_dict_reaches_the_kernels(patched, fake_gpu, fake_cuda, backend):
    fake_gpu("hopper")
    norm = make_norm("LayerNorm", "cuda", sm_margin={"forward": 2, "backward": 3, "inference": 4})
    x = torch.empty(32, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compile_fullgraph(call(norm), backend)(x)
    spec = norm_of(backend.graphs)
    assert (spec.fwd_sm_margin, spec.bwd_sm_margin) == (2, 3)
    with torch.no_grad():
        torch._dynamo.reset()
        backend.graphs.clear()
        compile_fullgraph(call(norm), backend)(x)
    assert norm_of(backend.graphs).fwd_sm_margin == 4  # inference margin


def test_wrong_hidden_size(patched, fake_gpu, fake_cuda):
    fake_gpu("hopper")
    norm = make_norm("LayerNorm", "cuda")
    x = torch.empty(32, H + 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="not compatible"):
        compile_fullgraph(call(norm), "eager")(x)


def test_cpu_input(patched, fake_gpu, fake_cuda):
    fake_gpu("hopper")
    norm = make_norm("RMSNorm", "cuda")
    x = torch.empty(32, H, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="needs CUDA"):
        compile_fullgraph(call(norm), "eager")(x)


def test_unpatched_te_does_not_compile(fake_gpu, fake_cuda):
    """The negative control: vanilla TE's norm breaks the graph (pybind / driver calls)."""
    fake_gpu("hopper")
    norm = make_norm("LayerNorm", "cuda")
    x = torch.empty(32, H, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="layernorm_fwd"):  # dynamo skips TE's pybind kernel
        compile_fullgraph(call(norm), "eager")(x)
