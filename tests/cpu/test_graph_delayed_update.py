"""graph_fp8/delayed_update.py against a scalar transcription of TE's fused DelayedScaling update
(`kernel_bulk` in common/recipe/delayed_scaling.cu), per tensor, over histories with zeros,
NaN, inf, denormal and huge amaxes. Against TE's kernel itself: tests/gpu/test_graph_fp8_gpu.py.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from te_compile.graph_fp8 import delayed_update

FLT_MAX = torch.finfo(torch.float32).max
DENORMAL = 1e-40


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _kernel(history: list[float], scale: float, last: float, algo, fp8_max, margin):
    """One tensor of TE's kernel, written as its threads run (the roll reads row i + 1)."""
    length = len(history)
    if last == 0.0:
        return list(history), scale if not math.isinf(scale) else FLT_MAX
    read = [history[i + 1] if i < length - 1 else last for i in range(length)]
    amax = 0.0
    for a in read:  # fmaxf: a NaN operand loses
        amax = amax if math.isnan(a) else max(amax, a)
    if algo == "most_recent":
        amax = last
    new_history = [0.0] + read[1:]
    scaled_max = _f32(fp8_max * 2.0**-margin)
    if math.isfinite(amax) and amax > 0:
        q = scaled_max / amax
        new_scale = math.inf if abs(q) > FLT_MAX * (1 + 2**-25) else _f32(q)
    else:
        new_scale = scale
    return new_history, FLT_MAX if math.isinf(new_scale) else new_scale


HISTORIES = {
    "plain": ([0.0, 3.0, 7.5, 1.25], 2.0),
    "row0_only": ([4.0, 0.0, 0.0, 0.0], 1.0),
    "nan_rows": ([1.0, math.nan, 2.0, 0.5], 1.0),
    "inf_row": ([0.0, math.inf, 2.0, 0.5], 3.0),
    "denormal": ([0.0, DENORMAL, 0.0, 0.0], 1.0),
    "huge": ([0.0, 3e38, 1.0, 1.0], 1.0),
    "all_zero": ([0.0, 0.0, 0.0, 0.0], 5.0),
    "one_row": ([0.0], 1.0),
}
LATEST = [0.0, 2.5, 448.0, math.nan, math.inf, DENORMAL, 1e-30]


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("name", list(HISTORIES))
def test_update_is_tes_kernel(name, algo, margin, fp8):
    rows, scale = HISTORIES[name]
    n = len(LATEST)
    history = torch.tensor([[r] * n for r in rows], dtype=torch.float32)
    scales = torch.full((n,), scale, dtype=torch.float32)
    last = torch.tensor(LATEST, dtype=torch.float32)
    got_h, got_s = delayed_update.updated(history, scales, last, algo, fp8, margin)
    fp8_max = {"e4m3": 448.0, "e5m2": 57344.0}[fp8]
    for j in range(n):
        col = [_f32(r) for r in history[:, j].tolist()]
        want_h, want_s = _kernel(col, scale, float(last[j]), algo, fp8_max, margin)
        want_h = torch.tensor(want_h, dtype=torch.float32)
        assert torch.equal(got_h[:, j].nan_to_num(-1.0), want_h.nan_to_num(-1.0)), (j, got_h[:, j])
        assert got_s[j].item() == _f32(want_s), (j, got_s[j].item(), want_s)


def test_only_tes_fused_update_with_integer_margins_runs_in_the_graph():
    assert delayed_update.applies("max", 0, True) and delayed_update.applies("most_recent", 3, True)
    assert not delayed_update.applies("max", 0, False)  # NVTE_UNFUSED_FP8_UPDATE: TE's Python
    assert not delayed_update.applies("max", 0.5, True)


def test_slot_helpers_keep_the_values():
    """delayed.in_slots puts each amax at its slot (0 elsewhere, inf kept), and quantize_delayed
    with a module's Scales (reciprocals taken once) gives quantize.quantize_delayed's bytes."""
    from te_compile.graph_fp8 import delayed, quantize
    from te_compile.recipes import QuantConfig

    like = torch.zeros(6)
    got = delayed.in_slots(like, {0: torch.tensor([2.5]), 3: torch.tensor([math.inf])})
    assert got.tolist() == [2.5, 0.0, 0.0, math.inf, 0.0, 0.0]
    cfg = QuantConfig(kind="delayed")
    scale = torch.tensor([3.0, 0.37, 1.0, 1e-30, 7.0, 1.0])
    t = (torch.randn(64, 32) * 100).to(torch.bfloat16)
    for role, gemm in ((0, 0), (1, 0), (0, 1), (1, 1)):
        ours = delayed.quantize_delayed(t, delayed.Scales.of(scale), cfg, role, gemm=gemm)
        slot = role + 3 * gemm
        want = quantize.quantize_delayed(
            quantize.stored_bf16(t), scale[slot : slot + 1], cfg.dtypes[role]
        )
        assert torch.equal(ours[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(ours[1], want[1]) and torch.equal(ours[2], want[2])
