"""bench/profile_ops.py: session 47's two torch.profiler tables (docs/perf/session47/), the
ops one recipe calls and the other does not, with the counts the step's structure gives."""

from __future__ import annotations

from pathlib import Path

from conftest import file_module

RUNS = Path(__file__).resolve().parents[2] / "docs" / "perf" / "session47"


def _read(name: str, match: str = r"^te_compile::"):
    return file_module("profile_ops", "bench/profile_ops.py").read(str(RUNS / name), match)


def test_delayed_step_against_current_step():
    cur_ms, cur = _read("torchprof-current-compile.txt")
    dly_ms, dly = _read("torchprof-delayed-compile.txt")
    assert cur_ms < dly_ms  # 19.38 against 22.31 ms of profiled CPU per step
    # both: per layer attention fwd + bwd, 2 norms fwd + bwd (4 layers)
    for ops in (cur, dly):
        assert ops["te_compile::fused_attn_fwd"][0] == ops["te_compile::fused_attn_bwd"][0] == 4
        assert ops["te_compile::norm_fwd"][0] == ops["te_compile::norm_bwd"][0] == 8
    # DelayedScaling alone: a scale snapshot per GEMM module's forward (3 per layer), a copy
    # tied to the gradient for the two GEMMs without a bias in the GEMM, TE's fused grad casts
    assert dly["te_compile::scale_snapshot"][0] == 12
    assert dly["te_compile::scale_in_backward"][0] == 8
    assert dly["te_compile::delayed_grad_quantize"][0] == 8
    assert not {"te_compile::scale_snapshot", "te_compile::delayed_grad_quantize"} & set(cur)
    # the copies are what the snapshot ops run: one clone each
    clones = _read("torchprof-delayed-compile.txt", r"^aten::clone$")[1]
    assert clones["aten::clone"][0] == 12 + 8
    assert "aten::clone" not in _read("torchprof-current-compile.txt", r"^aten::clone$")[1]
