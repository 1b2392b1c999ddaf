"""Per-tensor FP8 GEMMs through aten's `_scaled_mm` (kernels/aten_gemm.py) against TE's own
`generic_gemm` on the same TE storages, bit for bit: the three layouts TE's GEMM layers use,
both accumulation modes, E4M3 and HYBRID (E5M2 gradients), bias, 3-D inputs, current and
delayed quantizers. Then Float8BlockScaling's GEMMs through aten's blockwise `_scaled_mm_v2`
(`configure(aten_block_gemm=True)`), the same way, and a TransformerLayer trained with them. The module-level GPU tests (compiled vs eager TE) then run the path in
training.

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_aten_gemm_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import torch

import te_compile

pytestmark = pytest.mark.gpu

# (1000 rows: TE allows multiples of 8 in fprop/dgrad; the wgrad GEMM, whose inner dimension
# they are, is refused by TE's GEMM and declined by ours)
SHAPES = [(16, 16, 16), (128, 256, 64), (1000, 256, 128), (1008, 768, 2048), (2048, 4096, 1024)]
SHAPES += [(4096, 1024, 4096)]


def _quantizer(kind: str, fp8: str):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import (
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
    )

    dtype = {"e4m3": tex.DType.kFloat8E4M3, "e5m2": tex.DType.kFloat8E5M2}[fp8]
    dev = torch.device("cuda")
    if kind == "current":
        q = Float8CurrentScalingQuantizer(dtype, dev, rowwise=True, columnwise=True)
    else:  # a DelayedScaling scale that is not a power of two
        scale = torch.full((1,), 0.37, device=dev)
        q = Float8Quantizer(scale, torch.zeros(1, device=dev), dtype, rowwise=True, columnwise=True)
    q.internal = True  # TE storages, as the ops' quantizers return them
    return q


def _both_paths(a, b, layout, option="aten_fp8_gemm", **kw):
    """extension.gemm with `option` off (TE's GEMM), then on (aten's)."""
    from te_compile.kernels import extension

    before = getattr(te_compile.options.current(), option)
    outs = []
    for aten in (False, True):
        te_compile.configure(**{option: aten})
        try:
            outs.append(extension.gemm(a, b, layout=layout, device_index=0, **kw)[0])
        finally:
            te_compile.configure(**{option: before})
    return outs


def _assert_same_bits(ref, ours):
    assert ref.shape == ours.shape and ref.dtype == ours.dtype
    diff = (ours.float() - ref.float()).abs().max().item()
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16)), f"max |diff| {diff}"


@pytest.mark.parametrize("kind", ["current", "delayed"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_three_gemms_match_te(m, n, k, split, kind):
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    qx, qw = _quantizer(kind, "e4m3")(x), _quantizer(kind, "e4m3")(w)
    qdy = _quantizer(kind, "e5m2")(dy)
    kw = {"out_dtype": torch.bfloat16, "split_accumulator": split}
    _assert_same_bits(*_both_paths(qw, qx, "TN", bias=bias, **kw))  # fprop
    _assert_same_bits(*_both_paths(qw, qx, "TN", **kw))
    _assert_same_bits(*_both_paths(qw, qdy, "NN", **kw))  # dgrad
    if m % 16:  # the wgrad's inner dimension: TE's GEMM refuses it too ("Caller must pad")
        from te_compile.kernels.aten_gemm import scaled_mm

        assert scaled_mm(qx, qdy, "NT", torch.bfloat16, split, None) is None
        return
    _assert_same_bits(*_both_paths(qx, qdy, "NT", **kw))  # wgrad
    fp32 = {"out_dtype": torch.float32, "split_accumulator": split}
    _assert_same_bits_f32(*_both_paths(qx, qdy, "NT", **fp32))


def _assert_same_bits_f32(ref, ours):
    assert ref.shape == ours.shape and ref.dtype == ours.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))


def test_3d_input_keeps_leading_dimensions():
    x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    qx, qw = _quantizer("current", "e4m3")(x), _quantizer("current", "e4m3")(w)
    ref, ours = _both_paths(qw, qx, "TN", out_dtype=torch.bfloat16, split_accumulator=False)
    assert ours.shape == ref.shape
    _assert_same_bits(ref, ours)


def test_falls_back_where_it_does_not_apply():
    from te_compile.kernels.aten_gemm import scaled_mm

    x = torch.randn(64, 40, device="cuda", dtype=torch.bfloat16)  # K not a multiple of 16
    w = torch.randn(32, 40, device="cuda", dtype=torch.bfloat16)
    qx, qw = _quantizer("current", "e4m3")(x), _quantizer("current", "e4m3")(w)
    assert scaled_mm(qw, qx, "TN", torch.bfloat16, False, None) is None
    assert scaled_mm(w, x, "TN", torch.bfloat16, False, None) is None  # not FP8


# ---- Float8BlockScaling through aten's blockwise `_scaled_mm_v2` (configure(aten_block_gemm=True))

BLOCK_SHAPES = [(128, 128, 128), (256, 384, 512), (1008, 256, 128), (1008, 768, 2048)]
BLOCK_SHAPES += [(2048, 4096, 1024), (4096, 1024, 4096)]


def _block_quantizer(dims: int):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    q = Float8BlockQuantizer(
        tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dims
    )
    q.internal = True
    return q


def _both_block_paths(a, b, layout, **kw):
    """TE's GEMM, then aten's (checked to take the call: else it would compare TE with TE)."""
    from te_compile.kernels import aten_gemm

    bias = None if kw.get("grad") else kw.get("bias")
    assert aten_gemm.block_scaled_mm(a, b, layout, kw["out_dtype"], bias) is not None
    return _both_paths(a, b, layout, option="aten_block_gemm", **kw)


@pytest.mark.parametrize("m,n,k", BLOCK_SHAPES)
def test_block_gemms_match_te(m, n, k):
    """Forward (input 1x128 x weight 128x128, with and without a bias), dgrad (grad 1x128 x
    weight 128x128) and wgrad (1x128 x 1x128, bf16 and float32 out) bit for bit."""
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    qx, qw, qdy = _block_quantizer(1)(x), _block_quantizer(2)(w), _block_quantizer(1)(dy)
    kw = {"out_dtype": torch.bfloat16, "split_accumulator": True}
    _assert_same_bits(*_both_block_paths(qw, qx, "TN", bias=bias, **kw))  # fprop
    _assert_same_bits(*_both_block_paths(qw, qx, "TN", **kw))
    _assert_same_bits(*_both_block_paths(qw, qdy, "NN", grad=True, **kw))  # dgrad
    _assert_same_bits(*_both_block_paths(qx, qdy, "NT", grad=True, **kw))  # wgrad
    fp32 = {"out_dtype": torch.float32, "split_accumulator": True, "grad": True}
    _assert_same_bits_f32(*_both_block_paths(qx, qdy, "NT", **fp32))


def test_block_3d_input_keeps_leading_dimensions():
    x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    qx, qw = _block_quantizer(1)(x), _block_quantizer(2)(w)
    kw = {"out_dtype": torch.bfloat16, "split_accumulator": True}
    ref, ours = _both_block_paths(qw, qx, "TN", **kw)
    assert ours.shape == ref.shape == (64, 4, 512)
    _assert_same_bits(ref, ours)


def test_block_transformer_layer_trains_as_eager_te(patched, monkeypatch):
    """A causal TransformerLayer (LayerNormLinear, Linear, LayerNormMLP, biases), three SGD
    steps compiled with every block-scaled GEMM through aten, against eager TE bit for bit."""
    import test_transformer_layer_gpu as layer_tests

    te_compile.configure(aten_block_gemm=True)
    try:
        layer_tests.check("causal", "block", monkeypatch, n=3, lr=0.01)
    finally:
        te_compile.configure(aten_block_gemm=False)
