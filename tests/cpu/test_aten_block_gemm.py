"""Float8BlockScaling GEMMs through aten's blockwise `_scaled_mm_v2` (kernels/aten_gemm.py,
`configure(aten_block_gemm=True)`), on meta tensors: TE storages laid out as TE's
Float8BlockQuantizer lays them out (its own get_scale_shape / get_columnwise_shape), handed
to aten's meta kernel, which checks the scales' shapes (and on torch 2.11 their strides)
as its Hopper kernel does. Bit identity with TE's GEMM is tests/gpu/test_aten_gemm_gpu.py's."""

from __future__ import annotations

import pytest
import torch

import te_compile
from te_compile.kernels import aten_gemm, extension

E4M3, E5M2 = "e4m3", "e5m2"


def _storage(shape, dims: int, fp8: str = E4M3, rowwise=True, columnwise=True):
    """A Float8BlockwiseQTensorStorage of a `shape` tensor on the meta device, TE's layout."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )

    dtype = {E4M3: tex.DType.kFloat8E4M3, E5M2: tex.DType.kFloat8E5M2}[fp8]
    q = Float8BlockQuantizer(dtype, rowwise=rowwise, columnwise=columnwise, block_scaling_dim=dims)

    def empty(s, dt):
        return torch.empty(tuple(s), dtype=dt, device="meta")

    return Float8BlockwiseQTensorStorage(
        empty(shape, torch.uint8) if rowwise else None,
        empty(q.get_scale_shape(shape, False), torch.float32) if rowwise else None,
        empty(q.get_columnwise_shape(shape), torch.uint8) if columnwise else None,
        empty(q.get_scale_shape(shape, True), torch.float32) if columnwise else None,
        dtype,
        q,
        dims == 2,
    )


@pytest.fixture
def aten_calls(monkeypatch):
    """The arguments of every `_scaled_mm_v2` call, the call itself going through."""
    calls = []
    real = torch.ops.aten._scaled_mm_v2

    def recording(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(torch.ops.aten, "_scaled_mm_v2", recording)
    return calls


def _strides(scales):
    return [tuple(s.stride()) for s in scales]


@pytest.mark.parametrize("lead", [(256,), (64, 4)])
def test_forward_gemm_reads_te_layout_without_copies(lead, aten_calls):
    x, w = _storage((*lead, 512), 1), _storage((384, 512), 2)  # x @ w.T: [*lead, 384]
    bias = torch.empty(384, dtype=torch.bfloat16, device="meta")
    out = aten_gemm.block_scaled_mm(w, x, "TN", torch.bfloat16, bias)
    assert out.shape == (*lead, 384) and out.dtype == torch.bfloat16
    (mat1, mat2, sa, ra, _, sb, rb, _, got_bias, *_rest) = aten_calls[-1]
    assert (ra, rb) == ([4], [5]) and got_bias is bias
    assert mat1.shape == (256, 512) and mat2.shape == (512, 384) and mat2.stride() == (1, 512)
    # aten's Hopper path: 1x128 scales [M, K/128] at strides (1, M); 128x128 ones [L4, N/128]
    # at (1, L4), L4 = K/128 rounded up to 4: TE's scales, transposed, as they lie in memory.
    assert _strides(sa) == [(1, 256)] and sa[0].shape == (256, 4)
    assert _strides(sb) == [(1, 4)] and sb[0].shape == (4, 3)
    assert sa[0].data_ptr() == x._rowwise_scale_inv.data_ptr()


def test_dgrad_and_wgrad_gemms():
    w, x, dy = _storage((384, 512), 2), _storage((256, 512), 1), _storage((256, 384), 1)
    dgrad = aten_gemm.block_scaled_mm(w, dy, "NN", torch.bfloat16, None)
    wgrad = aten_gemm.block_scaled_mm(x, dy, "NT", torch.bfloat16, None)
    assert dgrad.shape == (256, 512) and wgrad.shape == (384, 512)
    wgrad32 = aten_gemm.block_scaled_mm(x, dy, "NT", torch.float32, None)
    assert wgrad32.dtype == torch.float32


@pytest.mark.parametrize(
    "case",
    ["rows_not_multiple_of_4", "e5m2", "both_2d", "fp32_bias", "k_not_multiple_of_16", "half"],
)
def test_declines_where_aten_differs_or_refuses(case):
    """None: the caller runs TE's GEMM (which refuses or handles these itself)."""
    w, x = _storage((384, 512), 2), _storage((256, 512), 1)
    bias, out_dtype = None, torch.bfloat16
    if case == "rows_not_multiple_of_4":  # TE's scale padding would show in aten's stride
        x = _storage((254, 512), 1)
    elif case == "e5m2":  # aten's blockwise GEMM takes E4M3 only
        x = _storage((256, 512), 1, fp8=E5M2)
    elif case == "both_2d":
        x = _storage((256, 512), 2)
    elif case == "fp32_bias":
        bias = torch.empty(384, dtype=torch.float32, device="meta")
    elif case == "k_not_multiple_of_16":
        w, x = _storage((384, 520), 2), _storage((256, 520), 1)
    elif case == "half":  # the forward GEMM reads the row-wise halves
        x = _storage((256, 512), 1, rowwise=False)
    assert aten_gemm.block_scaled_mm(w, x, "TN", out_dtype, bias) is None


def test_per_tensor_operands_are_not_block_ones():
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
        Float8TensorStorage,
    )

    data = torch.empty(256, 512, dtype=torch.uint8, device="meta")
    scale = torch.empty(1, device="meta")
    import transformer_engine_torch as tex

    t = Float8TensorStorage(
        data=data, data_transpose=None, fp8_scale_inv=scale, fp8_dtype=tex.DType.kFloat8E4M3
    )
    assert aten_gemm.block_scaled_mm(t, t, "TN", torch.bfloat16, None) is None


def test_extension_gemm_routes_block_gemms_by_the_option(monkeypatch, aten_calls):
    """On: every GEMM without a bias gradient or an output to accumulate into goes to aten
    (here TE's own GEMM would fail on meta tensors); off (the default): none does."""
    w, x, dy = _storage((384, 512), 2), _storage((256, 512), 1), _storage((256, 384), 1)
    kw = {"out_dtype": torch.bfloat16, "split_accumulator": True, "device_index": 0}
    assert te_compile.configure().aten_block_gemm is False
    te_compile.configure(aten_block_gemm=True)
    try:
        out, dbias = extension.gemm(x, dy, layout="NT", grad=True, **kw)
        assert out.shape == (384, 512) and dbias is None and len(aten_calls) == 1
        extension.gemm(w, dy, layout="NN", grad=True, **kw)
        assert len(aten_calls) == 2
    finally:
        te_compile.configure(aten_block_gemm=False)

    def te_gemm(*args, **kwargs):
        raise AssertionError("reached TE's GEMM")

    monkeypatch.setattr(extension, "tex", lambda: type("T", (), {"generic_gemm": te_gemm}))
    monkeypatch.setattr(extension, "_workspace", lambda i: torch.empty(1))
    with pytest.raises(AssertionError, match="reached TE's GEMM"):
        extension.gemm(x, dy, layout="NT", grad=True, **kw)
    te_compile.configure(aten_block_gemm=True)
    try:  # a bias gradient is TE's epilogue: not aten's
        bias = torch.empty(384, dtype=torch.bfloat16, device="meta")
        with pytest.raises(AssertionError, match="reached TE's GEMM"):
            extension.gemm(x, dy, layout="NT", grad=True, bias=bias, **kw)
    finally:
        te_compile.configure(aten_block_gemm=False)
    assert len(aten_calls) == 2
