"""GPU suite for te.DotProductAttention under torch.compile(fullgraph=True): compiled (inductor)
vs eager TE on identical inputs, output and every input gradient bit-identical where the same
kernels run (cuDNN fused attention through te_compile::fused_attn_*, TE's default on Hopper);
attention dropout drawn from the same Philox stream as eager (same seed -> same mask, a new
mask every step); TE's backend choice when cuDNN attention is switched off; opcheck of the
attention and RoPE ops on real kernels.

FlashAttention (forced with NVTE_FUSED_ATTN=0) is tested where flash-attn >= 2.7 is installed
and skipped elsewhere; on a GPU machine without it, scripts/flash_attn_test_build.sh brings a
test build (bf16, head dims 64 and 128, which these tests use).

Lean (each compile of one attention takes a few seconds). Run:
`python3 -m pytest tests -m gpu -k attention`.
"""

from __future__ import annotations

import attention_cases as cases
import pytest
import torch
import transformer_engine.pytorch as te

from te_compile.modules import attention_backends
from te_compile.ops.attention import fused_attn_bwd
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
    """NVTE_FUSED_ATTN=0: TE picks FlashAttention if flash-attn is installed (traced from 2.7
    on, else refused by name), else UnfusedDotProductAttention (TE's module, traced)."""
    from transformer_engine.pytorch.attention.dot_product_attention.utils import (
        FlashAttentionUtils,
    )

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    cases.reset_backend_choice()
    dpa = te.DotProductAttention(H, D, attn_mask_type="causal")
    q, k, v = inputs([sbhd()] * 3)
    compiled = torch.compile(dpa, fullgraph=True)
    if FlashAttentionUtils.is_installed and attention_backends.flash_refusal(2):
        with pytest.raises(Exception, match="FlashAttention backend"):
            compiled(q, k, v)
        return
    out = compiled(q, k, v)
    out.backward(torch.ones_like(out))
    assert out.shape == (S, B, H * D) and all(x.grad is not None for x in (q, k, v))


# ---- FlashAttention (forced: NVTE_FUSED_ATTN=0 with flash-attn >= 2.7 installed) ---------------


@pytest.fixture
def flash(patched, monkeypatch):
    """TE picks flash-attn 2 (cuDNN attention off), deterministic so that gradients compare
    bit for bit (flash-attn's backward accumulates dq with atomics otherwise)."""
    from transformer_engine.pytorch.attention.dot_product_attention.utils import (
        FlashAttentionUtils,
    )

    if not FlashAttentionUtils.is_installed:
        pytest.skip("flash-attn is not installed")
    refusal = attention_backends.flash_refusal(2)
    if refusal:
        pytest.skip(f"flash-attn {FlashAttentionUtils.version}: {refusal}")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


def assert_flash_matches_eager(make, shapes, **kwargs):
    """Eager TE (which must have picked FlashAttention) first, then compiled: bit-identical.
    Returns the compiled run's records."""
    from transformer_engine.pytorch.attention.dot_product_attention import (
        dot_product_attention as dpa_module,
    )

    want = run(make, shapes, False, **kwargs)
    assert dpa_module._attention_backends["use_flash_attention"], "eager TE did not pick flash"
    got = run(make, shapes, True, **kwargs)
    assert_same(got, want)
    return got


FLASH_CASES = {
    **CASES,
    "sliding_window": (dict(attn_mask_type="causal", window_size=(32, 0)), [sbhd()] * 3),
    "softcap": (dict(attn_mask_type="causal", softcap=30.0), [sbhd()] * 3),
    # MLA head sizes: TE pads v to 64 for flash-attn 2 and trims the output.
    "mla": (
        dict(attn_mask_type="causal", kv_channels=(D, D // 2)),
        [sbhd(), sbhd(), (S, B, H, D // 2)],
    ),
}


@pytest.mark.parametrize("case", list(FLASH_CASES))
def test_flash_matches_eager(case, flash):
    kwargs, shapes = FLASH_CASES[case]
    kwargs = dict(kwargs)
    channels = kwargs.pop("kv_channels", D)

    def make():
        return te.DotProductAttention(H, channels, **kwargs)

    assert_flash_matches_eager(make, shapes)


def test_flash_padding_mask_matches_eager(flash):
    """Padding mask: TE packs tokens and calls flash-attn's varlen kernel."""
    mask = cases.padding_mask(S, B, pad=17)

    def make():
        dpa = te.DotProductAttention(H, D, attn_mask_type="padding_causal")
        return lambda q, k, v: dpa(q, k, v, attention_mask=mask)

    shapes = [sbhd()] * 3
    assert_flash_matches_eager(make, shapes)


def test_flash_packed_sbh3d_matches_eager(flash):
    """qkv_layer sbh3d with 128-channel heads and s*b >= 512: TE's fa_prepare ops."""

    def make():
        dpa = te.DotProductAttention(4, 128, attn_mask_type="causal")
        return lambda qkv: dpa(qkv_layer=qkv, qkv_interleave_dim=-2)

    shapes = [(S, 4, 4, 3, 128)]
    assert_flash_matches_eager(make, shapes)


def test_flash_dropout_is_eagers(flash):
    """flash-attn draws its dropout Philox state from the default CUDA generator at run time:
    under one seed compiled == eager step by step, and a new mask every step."""

    def make():
        return te.DotProductAttention(H, D, attention_dropout=0.2, attn_mask_type="causal")

    shapes = [sbhd()] * 3
    got = assert_flash_matches_eager(make, shapes, steps=3, seed=7)
    assert not torch.equal(got[0]["out"], got[1]["out"])


def test_flash_multihead_attention_matches_eager(flash):
    """te.MultiheadAttention (fused QKV, 128-channel heads) on FlashAttention."""
    hidden = 4 * 128

    def make():
        torch.manual_seed(5)
        mha = te.MultiheadAttention(
            hidden, 4, params_dtype=BF16, attn_mask_type="causal", fuse_qkv_params=True
        )
        return mha

    shapes = [(S, 4, hidden)]
    assert_flash_matches_eager(make, shapes)


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


@pytest.mark.parametrize("layout", ["sb3hd", "bsh3d", "sbhd_sb2hd"])
def test_packed_gradients_are_not_copied(layout):
    """The backward op hands back TE's packed gradient buffer: no stack/cat kernel runs (the
    values are compared with eager TE's by the tests above)."""
    from torch.profiler import ProfilerActivity, profile

    args = cases.fused_attn_bwd_args(cases.fused_attn_fwd_args(layout, "causal"))
    fused_attn_bwd(*args)  # warm cuDNN's graph cache
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        grads = fused_attn_bwd(*args)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not [k for k in kernels if "Cat" in k or "stack" in k], kernels
    assert grads[-1].is_contiguous()


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
