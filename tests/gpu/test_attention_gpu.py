"""GPU suite for te.DotProductAttention under torch.compile(fullgraph=True): compiled (inductor)
vs eager TE on identical inputs, output and every input gradient bit-identical where the same
kernels run (cuDNN fused attention through te_compile::fused_attn_*, TE's default on Hopper);
attention dropout drawn from the same Philox stream as eager (same seed -> same mask, a new
mask every step); TE's backend choice when cuDNN attention is switched off; opcheck of the
attention and RoPE ops on real kernels.

Lean (each compile of one attention takes a few seconds). Run:
`python3 -m pytest tests -m gpu -k attention`.
"""

from __future__ import annotations

import attention_cases as cases
import pytest
import torch
import transformer_engine.pytorch as te

from te_compile_testing import InductorRecorder

pytestmark = pytest.mark.gpu

H, D, S, B = 8, 64, 128, 2
BF16 = torch.bfloat16


def inputs(shapes, seed=1):
    torch.manual_seed(seed)
    return [torch.randn(*s, device="cuda", dtype=BF16, requires_grad=True) for s in shapes]


def run(make_dpa, shapes, compiled, *, seed=1, steps=1):
    """Fresh DotProductAttention, `steps` forward + backward passes with the same RNG seed
    before the first; returns per step {out, grad of every input}."""
    torch._dynamo.reset()
    cases.reset_backend_choice()
    fn = make_dpa()
    backend = InductorRecorder()
    if compiled:
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    records = []
    torch.manual_seed(123)  # the Philox stream dropout draws from
    for step in range(steps):
        xs = inputs(shapes, seed + step)
        out = fn(*xs)
        out.backward(torch.randn_like(out))
        records.append({"out": out.detach()} | {f"d{i}": x.grad for i, x in enumerate(xs)})
    if compiled:
        assert backend.graphs == 1, "recompiled"
    return records


def assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in w:
            assert torch.equal(g[key], w[key]), (
                f"step {i}: {key} differs from eager TE (max abs diff "
                f"{(g[key].float() - w[key].float()).abs().max().item():.3g})"
            )


def sbhd(heads=H):
    return (S, B, heads, D)


def bshd(heads=H):
    return (B, S, heads, D)


CASES = {
    "sbhd_causal": (dict(attn_mask_type="causal"), [sbhd()] * 3),
    "bshd_no_mask_gqa": (
        dict(attn_mask_type="no_mask", qkv_format="bshd", num_gqa_groups=2),
        [bshd(), bshd(2), bshd(2)],
    ),
    "causal_bottom_right_cross": (
        dict(attn_mask_type="causal_bottom_right", attention_type="cross"),
        [(S // 2, B, H, D), sbhd(), sbhd()],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dpa_matches_eager(case, patched):
    kwargs, shapes = CASES[case]

    def make():
        return te.DotProductAttention(H, D, **kwargs)

    assert_same(run(make, shapes, True), run(make, shapes, False))


def test_packed_qkv_layer_matches_eager(patched):
    """The declared packed layout (bsh3d) reaches cuDNN with the same buffer as eager."""

    def make():
        dpa = te.DotProductAttention(H, D, attn_mask_type="causal", qkv_format="bshd")
        return lambda qkv: dpa(qkv_layer=qkv, qkv_interleave_dim=-2)

    shapes = [(B, S, H, 3, D)]
    assert_same(run(make, shapes, True), run(make, shapes, False))


def test_padding_mask_matches_eager(patched):
    mask = cases.padding_mask(S, B, pad=17)

    def make():
        dpa = te.DotProductAttention(H, D, attn_mask_type="padding_causal")
        return lambda q, k, v: dpa(q, k, v, attention_mask=mask)

    shapes = [sbhd()] * 3
    assert_same(run(make, shapes, True), run(make, shapes, False))


def test_dropout_is_eagers_and_random_per_step(patched):
    """Attention dropout: the op draws Philox seed/offset from the default CUDA generator where
    eager TE draws them, so under one seed compiled == eager bit for bit, step by step; and
    every step draws a new mask."""

    def make():
        return te.DotProductAttention(H, D, attention_dropout=0.2, attn_mask_type="causal")

    shapes = [sbhd()] * 3
    got = run(make, shapes, True, steps=3, seed=7)
    assert_same(got, run(make, shapes, False, steps=3, seed=7))
    # Two calls on one input: two masks.
    dpa = torch.compile(make(), fullgraph=True)
    (q, k, v) = inputs(shapes, 3)
    a, b = dpa(q, k, v), dpa(q, k, v)
    assert not torch.equal(a, b), "dropout mask repeated across steps"
    torch.manual_seed(9)
    c = dpa(q, k, v)
    torch.manual_seed(9)
    assert torch.equal(c, dpa(q, k, v)), "not reproducible under a fixed seed"


def test_backend_when_cudnn_attention_is_off(patched, monkeypatch):
    """NVTE_FUSED_ATTN=0: TE picks FlashAttention if flash-attn is installed (refused by name
    under compile), else UnfusedDotProductAttention (TE's module, traced)."""
    from transformer_engine.pytorch.attention.dot_product_attention.utils import (
        FlashAttentionUtils,
    )

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    dpa = te.DotProductAttention(H, D, attn_mask_type="causal")
    q, k, v = inputs([sbhd()] * 3)
    compiled = torch.compile(dpa, fullgraph=True)
    if FlashAttentionUtils.is_installed:
        with pytest.raises(Exception, match="FlashAttention backend"):
            compiled(q, k, v)
        return
    out = compiled(q, k, v)
    out.backward(torch.ones_like(out))
    assert out.shape == (S, B, H * D) and all(x.grad is not None for x in (q, k, v))


def test_unfused_backend_close_to_eager(patched, monkeypatch):
    """UnfusedDotProductAttention forced (NVTE_FUSED_ATTN=0, NVTE_FLASH_ATTN=0): inductor
    compiles TE's PyTorch code around TE's softmax kernels (its scale, mask and layout ops
    may be fused differently), so results are compared with a bound, not bit for bit; the
    measured max relative error is printed (-s)."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")

    def make():
        return te.DotProductAttention(H, D, attn_mask_type="causal")

    shapes = [sbhd()] * 3
    got, want = run(make, shapes, True)[0], run(make, shapes, False)[0]
    for key in want:
        err = (got[key].float() - want[key].float()).abs().max() / want[key].float().abs().max()
        print(f"unfused {key}: max relative error {err.item():.3g}")
        assert err < 2e-2, f"{key}: {err.item():.3g}"


# ---- opcheck on real kernels -------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["sbhd_sbhd_sbhd", "sb3hd", "bsh3d", "sbhd_sb2hd"])
def test_fused_attn_ops_opcheck(layout):
    args = cases.fused_attn_fwd_args(layout, "causal")
    torch.library.opcheck(torch.ops.te_compile.fused_attn_fwd.default, args)
    torch.library.opcheck(
        torch.ops.te_compile.fused_attn_bwd.default, cases.fused_attn_bwd_args(args)
    )


def test_fused_attn_fake_matches_real():
    """The fake kernel's shapes, dtypes and strides are the real kernel's (inductor asserts
    them on every call)."""
    for layout in ("sbhd_sbhd_sbhd", "bshd_bshd_bshd", "sbh3d", "sbhd_sb2hd"):
        args = cases.fused_attn_fwd_args(layout, "padding", padded=True)
        real = torch.ops.te_compile.fused_attn_fwd(*args)
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = torch.ops.te_compile.fused_attn_fwd(*args)
        for r, f in zip(real, fake, strict=True):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), layout


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_rope_ops_opcheck(fmt):
    args = cases.rope_args(fmt)
    torch.library.opcheck(torch.ops.te_compile.fused_rope_fwd.default, args)
