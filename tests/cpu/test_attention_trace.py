"""te.DotProductAttention and te.MultiheadAttention under torch.compile(fullgraph=True), traced
without a GPU (te_compile.simulate_gpu): the op's layout, mask, window and backend arguments
are what eager TE passes; packed q/k/v inputs; gradients reach every input; options the
compiled path does not cover raise UnsupportedUnderCompileError naming them; the attention and
RoPE ops checked on meta tensors (tests/meta_opcheck.py)."""

from __future__ import annotations

import attention_cases as cases
import pytest
import torch
import transformer_engine.pytorch as te
from meta_opcheck import opcheck_on_meta
from transformer_engine.common import recipe as R

import te_compile
from te_compile.modules import attention_backends
from te_compile.ops.attention import FusedAttnSpec, fused_attn_bwd
from te_compile_testing import JointRecorder, op_args

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing")

ATTN_FWD = "te_compile.fused_attn_fwd.default"
H, D, S, B = 4, 16, cases.SEQ, cases.BATCH


def attn_node(rec):
    """The forward attention op's arguments by name, its `config` unpacked into them."""
    node = next(n for gm in rec.fw for n in gm.graph.nodes if str(n.target) == ATTN_FWD)
    args = op_args(node)
    return {**args, **vars(FusedAttnSpec.from_key(args["config"]))}


def compile_joint(fn, *args, **kwargs):
    rec = JointRecorder()
    out = torch.compile(fn, backend=rec.backend, fullgraph=True)(*args, **kwargs)
    if isinstance(out, tuple):
        out = out[0]
    out.float().sum().backward()
    return rec, out


def t(*shape, grad=True):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)


def make_mha(**kwargs):
    """A bf16 te.MultiheadAttention on "cuda" (meta under simulate_gpu), fused QKV parameters
    unless `kwargs` says otherwise."""
    kwargs = {"fuse_qkv_params": True, **kwargs}
    return te.MultiheadAttention(
        cases.HIDDEN, cases.HEADS, params_dtype=torch.bfloat16, device="cuda", **kwargs
    )


# ---- DotProductAttention -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("groups", [H, 2])
def test_dpa_separate_qkv(fmt, mask, groups, patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(
            H, D, num_gqa_groups=groups, attn_mask_type=mask, qkv_format=fmt
        )
        lead = (S, B) if fmt == "sbhd" else (B, S)
        q, k, v = t(*lead, H, D), t(*lead, groups, D), t(*lead, groups, D)
        rec, out = compile_joint(dpa, q, k, v)
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    assert out.shape == (*lead, H * D)
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v))
    args = attn_node(rec)
    assert args["qkv_layout"] == f"{fmt}_{fmt}_{fmt}"
    assert args["attn_mask_type"] == mask
    assert args["window_size"] == ((-1, 0) if "causal" in mask else (-1, -1))
    assert args["bottom_right_diagonal"] is (mask != "causal")
    assert args["backend"] == 1  # cuDNN F16_arbitrary_seqlen, as TE picks on Hopper
    assert args["attn_scale"] == pytest.approx(D**-0.5)
    assert args["max_seqlens"] == [S, S]
    assert args["cu_seqlens_padded"] == [None, None]  # TE passes padded ones only for padding masks


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("dim,layout", [(-3, "{s}3hd"), (-2, "{s}h3d")])
def test_dpa_packed_qkv_layer(fmt, dim, layout, patched, graph_breaks):
    """A declared packed buffer reaches the op whole, with TE's declared layout."""
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D, attn_mask_type="causal", qkv_format=fmt)
        lead = (S, B) if fmt == "sbhd" else (B, S)
        qkv = t(*lead, 3, H, D) if dim == -3 else t(*lead, H, 3, D)
        rec, out = compile_joint(lambda x: dpa(qkv_layer=x, qkv_interleave_dim=dim), qkv)
    assert graph_breaks() == 0 and out.shape == (*lead, H * D)
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
    args = attn_node(rec)
    assert args["qkv_layout"] == layout.format(s=fmt[:2])
    assert len(args["qkv"]) == 1


def test_dpa_packed_kv_layer(patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D, attn_mask_type="no_mask", attention_type="cross")
        q, kv = t(S, B, H, D), t(2 * S, B, 2, H, D)
        rec, out = compile_joint(lambda q, kv: dpa(q, kv_layer=kv), q, kv)
    assert graph_breaks() == 0 and out.shape == (S, B, H * D)
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    args = attn_node(rec)
    assert args["qkv_layout"] == "sbhd_sb2hd"
    assert args["max_seqlens"] == [S, 2 * S]


@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_dpa_padding_mask_and_cu_seqlens(mask, patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D, attn_mask_type=mask)
        q, k, v = t(S, B, H, D), t(S, B, H, D), t(S, B, H, D)
        rec, _ = compile_joint(
            lambda q, k, v, m: dpa(q, k, v, attention_mask=m), q, k, v, cases.padding_mask()
        )
        args = attn_node(rec)
        assert args["attn_mask_type"] == mask
        assert args["cu_seqlens_padded"][0] is not None  # TE: padded = plain for padding masks
        cu = torch.tensor([0, 20, 40], dtype=torch.int32, device="cuda")
        rec2, _ = compile_joint(
            lambda q, k, v: dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu), q, k, v
        )
    assert graph_breaks() == 0
    # the given cu_seqlens are graph inputs the op reads (TE slices them to batch + 1); the
    # padding mask's are computed from the mask in the graph
    given = attn_node(rec2)
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        assert _unsliced(given[name]).op == "placeholder", name
    assert given["attn_mask_type"] == mask
    assert _unsliced(args["cu_seqlens_q"]).op == "call_function"


def _unsliced(node):
    """The node a graph value was sliced from (the value itself if it was not)."""
    while str(node.target) == "aten.slice.Tensor":
        node = node.args[0]
    return node


def test_dpa_dropout_training_and_eval(patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D, attention_dropout=0.1, attn_mask_type="causal")
        q, k, v = t(S, B, H, D), t(S, B, H, D), t(S, B, H, D)
        rec, _ = compile_joint(dpa, q, k, v)
        assert attn_node(rec)["dropout"] == pytest.approx(0.1)
        assert attn_node(rec)["is_training"] is True
        dpa.eval()
        rec = JointRecorder()
        with torch.no_grad():
            torch.compile(dpa, backend=rec.backend, fullgraph=True)(q, k, v)
    assert attn_node(rec)["dropout"] == 0.0 and attn_node(rec)["is_training"] is False


def test_dpa_unfused_backend_when_forced(patched, graph_breaks, monkeypatch):
    """NVTE_FUSED_ATTN=0 without flash-attn: TE picks UnfusedDotProductAttention; its module
    is traced (TE's softmax custom ops), no te_compile attention op."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D, attn_mask_type="causal", attention_dropout=0.1)
        q, k, v = t(S, B, H, D), t(S, B, H, D), t(S, B, H, D)
        rec, out = compile_joint(dpa, q, k, v)
    targets = JointRecorder.targets(rec.fw)
    assert graph_breaks() == 0 and ATTN_FWD not in targets
    assert any("softmax" in x for x in targets), targets
    assert all(x.grad is not None for x in (q, k, v))


def test_backend_choice_is_tes(patched):
    """select_backend is TE's get_attention_backend on the same parameters."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    params = (
        ("qkv_dtype", "bfloat16"),
        ("qkv_layout", "sbhd_sbhd_sbhd"),
        ("batch_size", B),
        ("num_heads", H),
        ("num_gqa_groups", H),
        ("max_seqlen_q", S),
        ("max_seqlen_kv", S),
        ("head_dim_qk", D),
        ("head_dim_v", D),
        ("attn_mask_type", "causal"),
        ("window_size", (-1, 0)),
        ("bottom_right_diagonal", False),
    )
    with te_compile.simulate_gpu("hopper"):
        ours = attention_backends.select_backend(params)
        kwargs = dict(params)
        kwargs["qkv_dtype"] = torch.bfloat16
        theirs = dpa_utils.get_attention_backend(dpa_utils.AttentionParams(**kwargs))
    assert ours == (False, "", "", True, int(theirs[3]), bool(theirs[4]))
    assert theirs[2] and not theirs[0]


# ---- MultiheadAttention -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,layout",
    [
        ({}, "sbh3d"),  # TE's default interleaved QKV weight: packed [s, b, h, 3, d]
        ({"qkv_weight_interleaved": False}, "sb3hd"),
        ({"num_gqa_groups": 2}, "sbhd_sbhd_sbhd"),  # GQA: split, made contiguous as eager
        # Split QKV parameters: TE turns qkv_weight_interleaved off.
        ({"input_layernorm": True, "fuse_qkv_params": False}, "sb3hd"),
        # ... without input_layernorm: a te.Linear with parameters_split.
        ({"fuse_qkv_params": False}, "sb3hd"),
    ],
)
def test_mha_layouts(kwargs, layout, patched, graph_breaks):
    """The layout the projection's output reaches cuDNN attention with (fused QKV parameters
    unless the case says otherwise)."""
    with te_compile.simulate_gpu("hopper"):
        mha = make_mha(**kwargs)
        x = t(S, B, cases.HIDDEN)
        rec, out = compile_joint(mha, x)
    assert graph_breaks() == 0 and out.shape == x.shape
    assert attn_node(rec)["qkv_layout"] == layout


def test_mha_rotary(patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        mha = make_mha()
        rope = te.attention.RotaryPositionEmbedding(cases.HEAD_DIM)(max_seq_len=S)
        x = t(S, B, cases.HIDDEN)
        rec, out = compile_joint(lambda x: mha(x, rotary_pos_emb=rope), x)
    targets = JointRecorder.targets(rec.fw)
    assert graph_breaks() == 0 and targets.count("te_compile.fused_rope_fwd.default") == 2
    assert attn_node(rec)["qkv_layout"] == "sbhd_sbhd_sbhd"


# ---- refusals ----------------------------------------------------------------------------------


def _dpa_call(dpa_kwargs=None, call=None, recipe=None, fmt="sbhd"):
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D, qkv_format=fmt, **(dpa_kwargs or {}))
        q, k, v = t(S, B, H, D), t(S, B, H, D), t(S, B, H, D)

        def step(q, k, v):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return dpa(q, k, v, **(call or {}))

        return torch.compile(step, backend="eager", fullgraph=True)(q, k, v)


REFUSALS = {
    "fp8_dpa": (dict(recipe=R.DelayedScaling(fp8_dpa=True)), "FP8 attention"),
    "fp8_mha": (dict(recipe=R.Float8CurrentScaling(fp8_mha=True)), "FP8 attention"),
    "bias": (
        dict(call={"core_attention_bias_type": "post_scale_bias"}),
        "core_attention_bias_type",
    ),
    "alibi": (dict(call={"core_attention_bias_type": "alibi"}), "core_attention_bias_type"),
    "arbitrary": (dict(call={"attn_mask_type": "arbitrary"}), "arbitrary"),
    "softmax_type": (dict(dpa_kwargs={"softmax_type": "off-by-one"}), "softmax_type"),
    "max_logit": (dict(dpa_kwargs={"return_max_logit": True}), "return_max_logit"),
    "thd": (dict(call={"qkv_format": "thd"}), "qkv_format='thd'"),
    "inference_params": (dict(call={"inference_params": object()}), "KV caching"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_dpa_refusals_are_named(name, patched):
    kwargs, what = REFUSALS[name]
    with pytest.raises(Exception, match=f"te.DotProductAttention with .*{what}"):
        _dpa_call(**kwargs)


def test_dpa_context_parallel_is_named(patched):
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D)
        dpa.cp_group = object()  # what set_context_parallel_group leaves (any group)
        q = t(S, B, H, D)
        with pytest.raises(Exception, match="te.DotProductAttention with context parallelism"):
            torch.compile(dpa, backend="eager", fullgraph=True)(q, q, q)


@pytest.mark.parametrize("recipe", [R.DelayedScaling(fp8_dpa=True), R.DelayedScaling(fp8_mha=True)])
def test_mha_fp8_attention_is_named(recipe, patched):
    with te_compile.simulate_gpu("hopper"):
        mha = make_mha()

        def step(x):
            with te.autocast(recipe=recipe):
                return mha(x)

        with pytest.raises(Exception, match="te.MultiheadAttention with FP8 attention"):
            torch.compile(step, backend="eager", fullgraph=True)(t(S, B, cases.HIDDEN))


def test_eager_is_tes_own(patched):
    """Not compiling, the patched forwards are TE's (its device check fires on meta)."""
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D)
        q = t(S, B, H, D)
        with pytest.raises(RuntimeError, match="TransformerEngine needs CUDA"):
            dpa(q, q, q)


# ---- the ops on meta tensors (fake kernels, schemas, autograd) ----------------------------------


@pytest.mark.parametrize(
    "layout", ["sbhd_sbhd_sbhd", "bshd_bshd_bshd", "sb3hd", "sbh3d", "bs3hd", "sbhd_sb2hd"]
)
@pytest.mark.parametrize("mask,padded", [("causal", False), ("padding", True)])
def test_fused_attn_opcheck_on_fake(layout, mask, padded, fake_cuda):
    args = cases.fused_attn_fwd_args(layout, mask, padded=padded)
    opcheck_on_meta(torch.ops.te_compile.fused_attn_fwd.default, args)
    opcheck_on_meta(torch.ops.te_compile.fused_attn_bwd.default, cases.fused_attn_bwd_args(args))


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_opcheck_on_fake(fmt, interleaved, fake_cuda):
    args = cases.rope_args(fmt, interleaved)
    opcheck_on_meta(torch.ops.te_compile.fused_rope_fwd.default, args)
    grad = torch.randn_like(args[0]).detach()
    opcheck_on_meta(torch.ops.te_compile.fused_rope_bwd.default, (grad, *args[1:]))


@pytest.mark.parametrize("layout", ["sbhd_sbhd_sbhd", "sbh3d", "bshd_bsh2d"])
def test_fused_attn_fake_shapes(layout, fake_cuda):
    """Fake outputs: out like q with v's head dim, float32 stats [b, h, s_q, 1] (cuDNN's),
    int64 rng_state [2]; one gradient per qkv tensor, of its shape."""
    args = cases.fused_attn_fwd_args(layout, "causal")
    out, stats, rng = torch.ops.te_compile.fused_attn_fwd(*args)
    lead = (S, B) if layout.startswith("sb") else (B, S)
    heads = 4
    assert out.shape == (*lead, heads, 16) and out.dtype == torch.bfloat16
    assert stats.shape == (B, heads, S, 1) and stats.dtype == torch.float32
    assert rng.shape == (2,) and rng.dtype == torch.int64
    grads = fused_attn_bwd(*cases.fused_attn_bwd_args(args))
    assert [g.shape for g in grads] == [x.shape for x in args[0]]


def test_attention_op_is_a_random_op():
    """The forward op draws from the CUDA generator: tagged so that compilers neither merge,
    drop nor recompute it, and keep its order among random ops under fallback_random."""
    import te_compile.ops  # noqa: F401

    assert torch.Tag.nondeterministic_seeded in torch.ops.te_compile.fused_attn_fwd.default.tags
    assert torch.Tag.nondeterministic_seeded not in torch.ops.te_compile.fused_attn_bwd.default.tags


class _FakeTE:
    """TE's fused_attn module as the forward kernel sees it: records the `cuda_graph` flag;
    raises `error` when given one."""

    class FusedAttnBackend:
        cast = staticmethod(lambda b: b)

    def __init__(self, error=None):
        self.error, self.flags = error, []

    def fused_attn_fwd(self, *args, cuda_graph, **kwargs):
        self.flags.append(cuda_graph)
        if self.error is not None:
            raise self.error
        return torch.zeros(1), [torch.zeros(1), torch.zeros(2)]


def _call_fwd_kernel(layout="sb3hd"):
    from te_compile.ops import attention as attn_ops

    qkv = [torch.zeros(4, 2, 3, 1, 8)] if layout == "sb3hd" else [torch.zeros(4, 2, 1, 8)] * 3
    cfg = cases.fused_attn_spec(layout, "causal")
    return attn_ops.fused_attn_fwd.impl(qkv, None, None, [None, None], [4, 4], cfg.key)


@pytest.mark.parametrize("capturing", [False, True])
def test_te_graph_capture_flag_passed(capturing, monkeypatch):
    """TE's `cuda_graph` flag is passed as eager TE passes it in its own graphs: True exactly
    while the stream is capturing (TE then refuses configurations cuDNN runs wrong there)."""
    from te_compile.ops import attention as attn_ops

    fake = _FakeTE()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(attn_ops, "_te_fused_attn", lambda: fake)
    _call_fwd_kernel()
    assert fake.flags == [capturing]


def test_te_capture_refusal_named(monkeypatch):
    """TE's refusal inside a capture (cuDNN <= 9.15, sequence not a multiple of 128: wrong
    gradients on an H100 otherwise) becomes a named error with the ways out; any other TE error
    passes through unchanged."""
    from te_compile.errors import UnsupportedUnderCompileError
    from te_compile.ops import attention as attn_ops

    te_msg = "Known cuDNN <= 9.15 issue with CUDA graph. Please upgrade cuDNN."
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(attn_ops, "_te_fused_attn", lambda: _FakeTE(RuntimeError(te_msg)))
    with pytest.raises(UnsupportedUnderCompileError, match="multiple of 128") as info:
        _call_fwd_kernel()
    assert te_msg in str(info.value)
    other = RuntimeError("some other TE failure")
    monkeypatch.setattr(attn_ops, "_te_fused_attn", lambda: _FakeTE(other))
    with pytest.raises(RuntimeError) as info:
        _call_fwd_kernel("sbhd_sbhd_sbhd")
    assert info.value is other


@pytest.mark.parametrize("layout", ["sb3hd", "sbh3d", "bs3hd", "sbhd_sb2hd", "bshd_bsh2d"])
def test_packed_gradients_are_tes_buffer_not_a_copy(layout):
    """Where TE's backward returns dq/dk/dv as slices of one packed buffer, the op returns that
    buffer (no copy); other gradients are stacked; values equal torch.stack's either way."""
    from te_compile.ops.attention import _join_grads, split_qkv

    shapes = {"sb3hd": (S, B, 3, H, D), "sbh3d": (S, B, H, 3, D), "bs3hd": (B, S, 3, H, D)}
    shapes |= {"sbhd_sb2hd": (S, B, 2, H, D), "bshd_bsh2d": (B, S, H, 2, D)}
    packed = torch.randn(shapes[layout])
    q = torch.randn(packed.shape[:-3] + (H, D)) if "_" in layout else None
    tes_grads = split_qkv([packed] if q is None else [q, packed], layout)
    joined = _join_grads(*tes_grads, layout)[-1]
    assert joined.data_ptr() == packed.data_ptr() and torch.equal(joined, packed)
    copies = [g.clone() for g in tes_grads]  # apart: the op stacks them
    stacked = _join_grads(*copies, layout)[-1]
    assert stacked.is_contiguous() and torch.equal(stacked, packed)
    assert stacked.data_ptr() != packed.data_ptr()
