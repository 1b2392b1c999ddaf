"""te.TransformerLayer under torch.compile(fullgraph=True), traced without a GPU on the meta
tensors of te_compile.simulate_gpu: option set x recipe, one forward and one AOTAutograd
backward graph each (0 graph breaks), the attention running as TE's fused attention op (or
TE's unfused module when NVTE_FUSED_ATTN=0), every GEMM op carrying the recipe's config.

Option sets: tests/attention_cases.py (masks, GQA, sbhd/bshd, RoPE, fused and unfused QKV
parameters, bias, RMSNorm/swiglu, dropout, the Llama-style layer, a decoder layer with cross
attention, the unfused backend forced by NVTE_FUSED_ATTN=0)."""

from __future__ import annotations

import attention_cases as cases
import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile.ops.attention import FusedAttnSpec
from te_compile.recipes import QuantConfig
from te_compile_testing import JointRecorder, op_args

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing")

RECIPES = {
    "none": lambda: None,
    "current": R.Float8CurrentScaling,
    "block": R.Float8BlockScaling,
    "delayed": R.DelayedScaling,
    "mxfp8": R.MXFP8BlockScaling,
    "nvfp4": R.NVFP4BlockScaling,
}
ARCH = {"mxfp8": "blackwell", "nvfp4": "blackwell"}
GEMM_OPS = ("linear_fwd", "layernorm_linear_fwd", "layernorm_mlp_fwd")
ATTN_FWD, ATTN_BWD = "te_compile.fused_attn_fwd.default", "te_compile.fused_attn_bwd.default"
ROPE_FWD, ROPE_BWD = "te_compile.fused_rope_fwd.default", "te_compile.fused_rope_bwd.default"


def trace(case_name, recipe_name, monkeypatch, steps=1):
    """Compile one layer step (te.autocast inside) and run forward + backward `steps` times
    on meta tensors; returns (recorder, layer, input, output)."""
    case = cases.LAYER_CASES[case_name]
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    recipe = RECIPES[recipe_name]()
    rec = JointRecorder()
    with te_compile.simulate_gpu(ARCH.get(recipe_name, "hopper")):
        layer = cases.make_layer(case)
        kwargs = cases.call_kwargs(case)

        def step(x, **kw):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return layer(x, **kw)

        compiled = torch.compile(step, backend=rec.backend, fullgraph=True)
        for _ in range(steps):
            x = cases.layer_input(case)
            out = compiled(x, **kwargs)
            out.float().sum().backward()
    return rec, layer, x, out


def _ops(graphs, name):
    return [t for t in JointRecorder.targets(graphs) if t == name]


def _gemm_configs(graphs) -> list[str]:
    """The QuantConfig kinds of every TE GEMM op in `graphs`."""
    kinds = []
    for gm in graphs:
        for node in gm.graph.nodes:
            target = str(node.target)
            if node.op == "call_function" and any(f".{op}." in target for op in GEMM_OPS):
                kinds.append(QuantConfig.from_key(op_args(node)["config"]).kind)
    return kinds


def check_layer_graphs(rec, case_name, recipe_name, graph_breaks):
    case = cases.LAYER_CASES[case_name]
    assert graph_breaks() == 0
    assert len(rec.fw) == 1 and len(rec.bw) == 1
    n_attn = 2 if case.encoder else 1
    if not case.fused_attention:
        assert not _ops(rec.fw, ATTN_FWD)  # TE's unfused module, traced
    else:
        assert len(_ops(rec.fw, ATTN_FWD)) == n_attn
        assert len(_ops(rec.bw, ATTN_BWD)) == n_attn
    if case.rope:
        assert len(_ops(rec.fw, ROPE_FWD)) == 2 and len(_ops(rec.bw, ROPE_BWD)) == 2
    kinds = _gemm_configs(rec.fw)
    assert len(kinds) >= 3
    assert set(kinds) == {recipe_name}, kinds


# Every option set under no FP8 and one FP8 recipe; every recipe under the layers of the issue.
MATRIX = [
    *[(c, "none") for c in cases.LAYER_CASES],
    *[(c, "current") for c in cases.LAYER_CASES],
    *[(c, r) for c in ("default", "llama", "rope", "dropout") for r in ("block", "delayed")],
    *[(c, r) for c in ("default", "llama") for r in ("mxfp8", "nvfp4")],
]


@pytest.mark.parametrize("case_name,recipe_name", MATRIX)
def test_transformer_layer_joint_graph(case_name, recipe_name, patched, graph_breaks, monkeypatch):
    rec, layer, x, out = trace(case_name, recipe_name, monkeypatch)
    check_layer_graphs(rec, case_name, recipe_name, graph_breaks)
    assert out.shape == x.shape and out.dtype == cases.LAYER_CASES[case_name].dtype
    assert x.grad is not None and x.grad.shape == x.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name


@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
def test_second_step_does_not_recompile(recipe_name, patched, graph_breaks, monkeypatch):
    rec, *_ = trace("llama", recipe_name, monkeypatch, steps=2)
    assert len(rec.fw) == 1 and len(rec.bw) == 1 and graph_breaks() == 0


def test_eval_mode_and_no_grad(patched, graph_breaks):
    """Inference: is_training=False reaches the op, no backward graph, dropout off."""
    case = cases.LAYER_CASES["dropout"]
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        layer = cases.make_layer(case).eval()
        with torch.no_grad():
            out = torch.compile(layer, backend=rec.backend, fullgraph=True)(
                cases.layer_input(case, requires_grad=False)
            )
    assert graph_breaks() == 0 and out.shape == (cases.SEQ, cases.BATCH, cases.HIDDEN)
    node = next(n for gm in rec.fw for n in gm.graph.nodes if str(n.target) == ATTN_FWD)
    config = FusedAttnSpec.from_key(op_args(node)["config"])
    assert config.is_training is False
    assert config.dropout == 0.0


def test_negative_control_without_patch(graph_breaks):
    """TE's own compile path breaks on this layer (the repro of TE issue 2590)."""
    te_compile.unpatch()
    case = cases.LAYER_CASES["rope"]
    with te_compile.simulate_gpu("hopper"):
        layer = cases.make_layer(case)
        kwargs = cases.call_kwargs(case)
        with pytest.raises(Exception, match="Creating Recipe objects inside compiled regions"):
            torch.compile(layer, backend="eager", fullgraph=True)(cases.layer_input(case), **kwargs)


@pytest.mark.parametrize("recipe_name", ["none", "delayed"])
def test_regional_compilation_one_graph_for_all_layers(recipe_name, patched, graph_breaks):
    """torch.compile per layer (as torchtitan does): identical layers share one graph over two
    steps: nothing in the compiled path specialises on a layer's identity, number or name."""
    case = cases.LAYER_CASES["llama"]
    recipe = RECIPES[recipe_name]()
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        layers = [cases.make_layer(case, layer_number=i + 1) for i in range(4)]
        for layer in layers:
            layer.compile(backend=rec.backend, fullgraph=True)
        kwargs = cases.call_kwargs(case)
        for _ in range(2):
            h = x = cases.layer_input(case)
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                for layer in layers:
                    h = layer(h, **kwargs)
            h.float().sum().backward()
    assert graph_breaks() == 0 and x.grad is not None
    assert len(rec.fw) == 1 and len(rec.bw) == 1


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
@pytest.mark.parametrize("recipe_name", ["none", "current", "delayed"])
def test_varying_sequence_length(recipe_name, dynamic, patched, graph_breaks):
    """Sequences of 16, 32, 24 and 40 tokens in torch.compile's default mode and with
    dynamic=True: one graph per length (eager TE picks the attention backend per call from the
    actual sizes, so a graph holds for its sizes only), never a break. Until session 27 the
    second length broke the trace (the dynamic length reached the backend choice's
    constant-result function), and dynamic=True broke the first (symbolic recipe, module and
    global floats, the last inside the graph path's autograd.Function)."""
    recipe = {"none": None, "current": R.Float8CurrentScaling(), "delayed": R.DelayedScaling()}
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        layer = cases.make_layer(cases.LAYER_CASES["causal"])

        def step(x):
            with te.autocast(enabled=recipe_name != "none", recipe=recipe[recipe_name]):
                return layer(x)

        compiled = torch.compile(step, backend=rec.backend, fullgraph=True, dynamic=dynamic)
        for seq in (16, 32, 24, 40):
            x = torch.randn(seq, cases.BATCH, cases.HIDDEN, device="cuda", dtype=torch.bfloat16)
            compiled(x.requires_grad_()).float().sum().backward()
            assert x.grad.shape == x.shape
    assert graph_breaks() == 0 and len(rec.fw) == 4
    assert [rec.targets([gm]).count(ATTN_FWD) for gm in rec.fw] == [1, 1, 1, 1]
