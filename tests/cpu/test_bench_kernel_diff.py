"""bench/kernel_diff.py: kernels compared by their text with the names taken out, on generated
modules written here (two kernels, one renamed, one changed)."""

from __future__ import annotations

from conftest import file_module

_MODULE = (
    """
@triton.jit
def triton_poi_fused_abs_{n}(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 1024

    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tmp1 = tl_math.abs(tmp0)
    tl.store(out_ptr0 + (x0), tmp1, xmask)

@triton.jit
def triton_red_fused_amax_{m}(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + (r0_0), None{hint})
    tmp1 = {reduce}
"""
    + "\ndef call(args):\n    pass\n"
)


def _kernel_diff():
    return file_module("kernel_diff", "bench/kernel_diff.py")


def test_names_do_not_count_text_does(tmp_path, capsys):
    kd = _kernel_diff()
    old = _MODULE.format(n=0, m=1, hint="", reduce="triton_helpers.max2(tmp0, 1)")
    new = _MODULE.format(n=7, m=1, hint=", eviction_policy='evict_first'", reduce="tl.max(tmp0)")
    assert len(kd.kernels(old)) == 2
    # a renamed kernel with the same text is the same kernel
    assert set(kd.kernels(old).values()) & set(kd.kernels(new).values())
    for folder, text in (("a", old), ("b", new)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "current-forward.py").write_text(text)
    kd.compare(str(tmp_path / "a"), str(tmp_path / "b"), show=True)
    out = capsys.readouterr().out
    assert "current-forward.py: 2 / 2 kernels, 1 the same text" in out
    assert (
        "only in A: triton_red_fused_amax_1" in out and "only in B: triton_red_fused_amax_1" in out
    )
    assert "-    tmp1 = triton_helpers.max2(tmp0, 1)" in out and "+    tmp1 = tl.max(tmp0)" in out
    assert "triton_poi_fused_abs" not in out
