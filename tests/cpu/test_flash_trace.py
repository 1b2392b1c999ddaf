"""The FlashAttention backend under torch.compile(fullgraph=True), traced without a GPU and
without flash-attn: TE's backend choice is forced to FlashAttention 2.8.3 and TE's
`flash_attn_func` / `flash_attn_varlen_func` are replaced by stand-ins shaped like flash-attn
2.7+'s (an autograd.Function over custom ops with fake kernels, as flash-attn registers them).
What is checked: 0 graph breaks forward and backward, the arguments TE's FlashAttention module
hands flash-attn (bshd layout, dropout, scale, causal, window, softcap, varlen packing for
padding masks, MLA head padding), and the named refusals of flash-attn builds that cannot
trace. The real kernels' numerics: tests/gpu/test_attention_gpu.py -k flash."""

from __future__ import annotations

import math

import attention_cases as cases
import pytest
import torch
import transformer_engine.pytorch as te
from packaging.version import Version
from transformer_engine.pytorch.attention.dot_product_attention import backends
from transformer_engine.pytorch.attention.dot_product_attention.utils import FlashAttentionUtils

import te_compile
from te_compile.modules import attention_backends
from te_compile_testing import JointRecorder, op_args

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing")

H, D, S, B = 4, 16, cases.SEQ, cases.BATCH
FWD, VARLEN_FWD, BWD = (f"te_compile_test.flash_{n}.default" for n in ("fwd", "varlen_fwd", "bwd"))


# ---- stand-ins for flash-attn 2.7+ (never run: traced on fake tensors only) --------------------


@torch.library.custom_op("te_compile_test::flash_fwd", mutates_args=())
def _flash_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size: list[int],
    softcap: float,
    deterministic: bool,
) -> torch.Tensor:
    raise NotImplementedError("a stand-in: traced only")


def _fake_out(q, k, v, *args):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


_flash_fwd.register_fake(_fake_out)


@torch.library.custom_op("te_compile_test::flash_varlen_fwd", mutates_args=())
def _flash_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size: list[int],
    softcap: float,
    deterministic: bool,
) -> torch.Tensor:
    raise NotImplementedError("a stand-in: traced only")


_flash_varlen_fwd.register_fake(_fake_out)


@torch.library.custom_op("te_compile_test::flash_bwd", mutates_args=())
def _flash_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError("a stand-in: traced only")


@_flash_bwd.register_fake
def _(dout, q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _StandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, q, k, v, *args):
        ctx.save_for_backward(q, k, v)
        ctx.n_args = len(args)
        return op(q, k, v, *args)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        return (None, *torch.ops.te_compile_test.flash_bwd(dout, q, k, v), *[None] * ctx.n_args)


def _keywords(dropout_p, softmax_scale, causal, window_size, softcap, deterministic):
    return [dropout_p, softmax_scale, causal, list(window_size), softcap, deterministic]


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
):
    assert alibi_slopes is None
    kw = _keywords(dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
    return _StandIn.apply(torch.ops.te_compile_test.flash_fwd, q, k, v, *kw)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
):
    assert alibi_slopes is None
    kw = _keywords(dropout_p, softmax_scale, causal, window_size, softcap, deterministic)
    varlen = torch.ops.te_compile_test.flash_varlen_fwd
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _StandIn.apply(varlen, q, k, v, *lengths, *kw)


@pytest.fixture
def flash(patched, monkeypatch):
    """TE picks FlashAttention 2.8.3 (traceable), whose entry points are the stand-ins."""
    pick = torch.compiler.assume_constant_result(
        lambda params: (True, "2.8.3", "", False, -1, False)
    )
    monkeypatch.setattr(attention_backends, "select_backend", pick)
    monkeypatch.setattr(FlashAttentionUtils, "version", Version("2.8.3"))
    for flag in ("v2_plus", "v2_1_plus", "v2_3_plus", "v2_4_plus", "v2_4_1_plus", "v2_5_plus"):
        monkeypatch.setattr(FlashAttentionUtils, flag, True)
    for flag in ("v2_5_7_plus", "v2_6_0_plus", "v2_7_0_plus"):
        monkeypatch.setattr(FlashAttentionUtils, flag, True)
    monkeypatch.setattr(backends, "flash_attn_func", flash_attn_func)
    monkeypatch.setattr(backends, "flash_attn_varlen_func", flash_attn_varlen_func)
    # simulate_gpu's "cuda" tensors are meta tensors, and TE's FlashAttention asserts
    # `is_cuda`, which dynamo answers from the device: let it say yes for meta (tests only).
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.tensor import TensorVariable

    def is_cuda(self, tx):
        return VariableTracker.build(tx, self.device.type in ("cuda", "meta"))

    monkeypatch.setattr(TensorVariable, "method_attr_is_cuda", is_cuda)


def t(*shape, grad=True):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)


def trace(fn, *args):
    """(recorder, output): fn compiled fullgraph, its output's sum back-propagated."""
    rec = JointRecorder()
    out = torch.compile(fn, backend=rec.backend, fullgraph=True)(*args)
    out.float().sum().backward()
    return rec, out


def flash_call(rec, target):
    """The stand-in op's call in the forward graph: {argument name: value (or node)}."""
    node = next(n for gm in rec.fw for n in gm.graph.nodes if str(n.target) == target)
    return op_args(node), node


def shape(x):
    return tuple(x.meta["val"].shape)


# ---- traced calls ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask,causal", [("causal", True), ("no_mask", False)])
def test_flash_separate_qkv(fmt, mask, causal, flash, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(
            H, D, num_gqa_groups=2, attn_mask_type=mask, attention_dropout=0.1, qkv_format=fmt
        )
        sb = (S, B) if fmt == "sbhd" else (B, S)
        q, k, v = t(*sb, H, D), t(*sb, 2, D), t(*sb, 2, D)
        rec, out = trace(dpa, q, k, v)
        args, node = flash_call(rec, FWD)
        assert graph_breaks() == 0 and out.shape == (*sb, H * D)
        assert all(x.grad is not None for x in (q, k, v))
        assert BWD in JointRecorder.targets(rec.bw)
        # flash-attn takes bshd: TE transposes sbhd input.
        assert shape(args["q"]) == (B, S, H, D) and shape(args["k"]) == (B, S, 2, D)
        assert args["dropout_p"] == pytest.approx(0.1) and args["causal"] is causal
        assert args["softmax_scale"] == pytest.approx(1 / math.sqrt(D))
        assert args["window_size"] == ([-1, 0] if causal else [-1, -1])
        assert args["softcap"] == 0.0 and args["deterministic"] is dpa.deterministic

        dpa.eval()
        rec = JointRecorder()
        with torch.no_grad():
            torch.compile(dpa, backend=rec.backend, fullgraph=True)(q, k, v)
        assert flash_call(rec, FWD)[0]["dropout_p"] == 0.0


def test_flash_window_and_softcap(flash, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D, attn_mask_type="causal", window_size=(8, 0))
        q, k, v = t(S, B, H, D), t(S, B, H, D), t(S, B, H, D)
        rec, _ = trace(lambda q, k, v: dpa(q, k, v, softcap=30.0), q, k, v)
    args, _ = flash_call(rec, FWD)
    assert graph_breaks() == 0 and args["window_size"] == [8, 0] and args["softcap"] == 30.0


def test_flash_padding_mask_packs(flash, graph_breaks):
    """A padding mask: TE packs the tokens into [b*s, h, d] and calls the varlen kernel with
    the mask's cu_seqlens (kv's a copy: flash-attn's Function takes both as inputs)."""
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D, attn_mask_type="padding_causal")
        q, k, v = t(S, B, H, D), t(S, B, H, D), t(S, B, H, D)
        mask = torch.zeros(B, 1, 1, S, dtype=torch.bool, device="cuda")
        rec, out = trace(lambda q, k, v: dpa(q, k, v, attention_mask=mask), q, k, v)
    args, _ = flash_call(rec, VARLEN_FWD)
    assert graph_breaks() == 0 and out.shape == (S, B, H * D)
    assert shape(args["q"]) == (B * S, H, D) and shape(args["cu_seqlens_q"]) == (B + 1,)
    assert args["cu_seqlens_q"] is not args["cu_seqlens_k"]
    assert args["max_seqlen_q"] == S and args["causal"] is True
    assert all(x.grad is not None for x in (q, k, v))


def test_flash_mla_pads_and_trims(flash, graph_breaks):
    """Head dims 32 (q, k) and 16 (v): TE pads v to 32 for flash-attn 2, trims the output."""
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, (2 * D, D), attn_mask_type="causal")
        q, k, v = t(S, B, H, 2 * D), t(S, B, H, 2 * D), t(S, B, H, D)
        rec, out = trace(dpa, q, k, v)
    args, _ = flash_call(rec, FWD)
    assert graph_breaks() == 0 and out.shape == (S, B, H * D)
    assert shape(args["v"]) == (B, S, H, 2 * D)
    assert v.grad is not None and v.grad.shape == v.shape


def test_flash_packed_qkv_uses_tes_prepare_op(flash, graph_breaks):
    """MultiheadAttention's interleaved QKV (sbh3d) with 128-channel heads and s*b >= 512:
    TE's FlashAttention moves q/k/v to bshd with its own fa_prepare ops."""
    heads, seq, batch = 2, 256, 2
    with te_compile.simulate_gpu("hopper"):
        mha = te.MultiheadAttention(
            heads * 128, heads, params_dtype=torch.bfloat16, device="cuda", fuse_qkv_params=True
        )
        x = t(seq, batch, heads * 128)
        rec, out = trace(mha, x)
    args, _ = flash_call(rec, FWD)
    assert graph_breaks() == 0 and out.shape == x.shape
    assert shape(args["q"]) == (batch, seq, heads, 128)
    assert any("fa_prepare_fwd" in n for n in JointRecorder.targets(rec.fw))
    assert any("fa_prepare_bwd" in n for n in JointRecorder.targets(rec.bw))


# ---- refusals ----------------------------------------------------------------------------------


def _dpa_step():
    with te_compile.simulate_gpu("hopper"):
        dpa = te.DotProductAttention(H, D)
        q = t(S, B, H, D)
        return torch.compile(dpa, backend="eager", fullgraph=True)(q, q, q)


@pytest.mark.parametrize(
    "version,why",
    [
        ("2.6.3", "custom ops only from flash-attn 2.7 on"),
        ("3.0.0b1", "FlashAttention 3 is not covered"),
        ("4.0.0b11", "FlashAttention 4 outside"),
    ],
)
def test_untraceable_flash_is_named(version, why, patched, monkeypatch):
    """The refusal names the flash-attn version, why it cannot trace, and the way out."""
    major = int(version[0])
    refusal = attention_backends.flash_refusal(major)
    pick = torch.compiler.assume_constant_result(
        lambda params: (True, version, refusal, False, -1, False)
    )
    monkeypatch.setattr(attention_backends, "select_backend", pick)
    message = f"FlashAttention backend with flash-attn {version} .*{why}.*NVTE_FLASH_ATTN=0"
    with pytest.raises(Exception, match=message):
        _dpa_step()


@pytest.mark.parametrize("v2_7_0_plus", [False, True])
def test_flash2_needs_its_custom_ops(v2_7_0_plus, monkeypatch):
    """FlashAttention 2 traces only when its kernels are registered torch ops: before 2.7 they
    are not, and a >= 2.7 install without them (no torch.ops.flash_attn here) is refused too."""
    monkeypatch.setattr(FlashAttentionUtils, "v2_7_0_plus", v2_7_0_plus)
    assert "2.7" in attention_backends.flash_refusal(2)
