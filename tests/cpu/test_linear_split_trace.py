"""te.Linear with parameters_split under torch.compile(fullgraph=True), traced without a GPU
(te_compile.simulate_gpu: TE refuses to split parameters on device="meta", so the module is
built on a simulated "cuda"): one graph forward, one backward, one linear_fwd/linear_bwd pair
on the concatenated weight (TE's noop_cat), every split parameter gets a gradient of its own
shape; the cross-attention key/value projection of a decoder TransformerLayer with split QKV
parameters (fuse_qkv_params=False) now traces; fuse_wgrad_accumulation with split parameters
is refused by name."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import recipe_for

import te_compile
from te_compile.recipes import QuantConfig
from te_compile_testing import JointRecorder, op_args, op_targets

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing")

IN = 64
FWD, BWD = "te_compile.linear_fwd.default", "te_compile.linear_bwd.default"
SPLITS = {
    "tuple": (("query", "key", "value"), {"query": 32, "key": 32, "value": 32}),
    "dict": ({"query": 64, "key": 16, "value": 16}, {"query": 64, "key": 16, "value": 16}),
}


def compile_joint(module, recipe, x):
    def step(inp):
        ctx = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with ctx:
            return module(inp)

    rec = JointRecorder()
    out = torch.compile(step, backend=rec.backend, fullgraph=True)(x)
    return rec, out


def fwd_arg(rec, name):
    node = next(n for gm in rec.fw for n in gm.graph.nodes if str(n.target) == FWD)
    return op_args(node)[name]


@pytest.mark.parametrize("name", ["none", "current", "block", "delayed"])
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("bias", [True, False])
def test_parameters_split_joint_graph(name, split, bias, patched, graph_breaks):
    split_arg, sizes = SPLITS[split]
    out_features = sum(sizes.values())
    with te_compile.simulate_gpu("hopper"):
        m = te.Linear(
            IN,
            out_features,
            bias=bias,
            parameters_split=split_arg,
            params_dtype=torch.bfloat16,
            device="cuda",
        )
        x = torch.randn(4, 8, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        rec, out = compile_joint(m, recipe_for(name), x)
        out.float().sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert op_targets(rec.fw).count(FWD) == 1 and op_targets(rec.bw).count(BWD) == 1
    assert out.shape == (4, 8, out_features) and x.grad.shape == x.shape
    # The GEMM's weight is the split parameters' rows, concatenated in the graph.
    assert tuple(fwd_arg(rec, "weight").meta["val"].shape) == (out_features, IN)
    assert QuantConfig.from_key(fwd_arg(rec, "config")).kind == name
    for part, rows in sizes.items():
        assert getattr(m, f"{part}_weight").grad.shape == (rows, IN)
        if bias:
            assert getattr(m, f"{part}_bias").grad.shape == (rows,)


def test_fuse_wgrad_accumulation_with_split_is_refused(patched):
    with te_compile.simulate_gpu("hopper"):
        m = te.Linear(
            IN,
            96,
            parameters_split=("query", "key", "value"),
            fuse_wgrad_accumulation=True,
            params_dtype=torch.bfloat16,
            device="cuda",
        )
        for p in m.parameters():
            p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
        x = torch.randn(8, IN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with pytest.raises(Exception, match="te.Linear with fuse_wgrad_accumulation with"):
            torch.compile(m, fullgraph=True)(x)


@pytest.mark.parametrize("output_layernorm", [False, True])
def test_decoder_layer_with_split_qkv_params(output_layernorm, patched, graph_breaks):
    """TE's default fuse_qkv_params=False: the cross attention's key/value projection is a
    te.Linear with parameters_split ("key", "value")."""
    import attention_cases as cases

    with te_compile.simulate_gpu("hopper"):
        layer = cases.make_layer(
            cases.LayerCase(dict(layer_type="decoder", self_attn_mask_type="causal")),
            output_layernorm=output_layernorm,
        )
        kv = layer.inter_attention.key_value
        assert isinstance(kv, te.Linear) and len(kv.weight_names) == 2
        x = torch.randn(
            cases.SEQ, cases.BATCH, cases.HIDDEN, device="cuda", dtype=torch.bfloat16
        ).requires_grad_()
        enc = torch.randn_like(x)
        rec = JointRecorder()
        fn = torch.compile(lambda a, e: layer(a, encoder_output=e), backend=rec.backend)
        out = fn(x, enc)
        out.float().sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert out.shape == x.shape
    for name in kv.weight_names:
        assert getattr(kv, name).grad is not None
