"""bench/profile_split.py: session 45's three profiles (docs/perf/session45/) split by kind of
call, with the counts known from their generated code and the step's structure."""

from __future__ import annotations

from pathlib import Path

from conftest import file_module

RUNS = Path(__file__).resolve().parents[2] / "docs" / "perf" / "session45"


def _split(name: str):
    return file_module("profile_split", "bench/profile_split.py").split(str(RUNS / name))


def test_te_step_against_torchao_and_plain_torch():
    te_ms, te = _split("te-transformer-profile-current-compile.txt")
    ao_ms, ao = _split("torchao-transformer-profile-bf16-compile.txt")
    _, plain = _split("torch-transformer-profile-bf16-compile.txt")
    # 4 layers x 4 linear layers x 3 GEMMs (fprop, dgrad, wgrad) in each stack
    assert te["GEMM calls"][0] == ao["GEMM calls"][0] == plain["GEMM calls"][0] == 48
    # per layer: attention fwd + bwd, 2 norms fwd + bwd, GELU's derivative
    assert te["TE's C++ entry points"][0] == 4 * (2 + 4 + 1)
    assert ao["TE's C++ entry points"] == (0, 0.0)
    # torchao launches more Triton kernels than TE's compiled step, and still issues faster
    assert ao["Triton launches"][0] > te["Triton launches"][0] > plain["Triton launches"][0]
    assert ao_ms < te_ms
    # the forward's ops with an autograd formula: 2 norms and attention per layer
    assert te["custom-op autograd layer"][0] == 12
    for rows, ms in ((te, te_ms), (ao, ao_ms)):
        assert abs(sum(v for _, v in rows.values()) - ms) < 1e-6  # the rows add up to the step


def test_rows_that_rest_used_to_hold():
    """te_compile's and TE's own Python, inductor's output allocations and the autograd
    engine's own time, each a row of its own (they were in "rest" before session 60)."""
    te_ms, te = _split("te-transformer-profile-current-compile.txt")
    _, ao = _split("torchao-transformer-profile-bf16-compile.txt")
    assert te["te_compile's Python"][1] > 0 and te["TE's Python"][1] > 0
    assert ao["te_compile's Python"] == ao["TE's Python"] == (None, 0.0)
    assert te["te_compile's Python"][0] is None  # a lower bound of many functions: no count
    # one backward per step; inductor allocates outputs in both stacks
    assert te["autograd engine"][0] == ao["autograd engine"][0] == 1
    assert te["output allocations"][0] > 100 and ao["output allocations"][0] > 100
    assert 0 < te["rest"][1] < te_ms
