"""bench/op_body_cost.py: the te.Linear op bodies run on the CPU with TE's entry points
stubbed, every call reaching the stubs (no real TE kernel, no aten GEMM), and the module's
state restored after."""

from __future__ import annotations

import pytest
import torch
from conftest import file_module

import te_compile
from te_compile.kernels import extension


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stubs stand in for a GPU")
@pytest.mark.parametrize("recipe", ["block", "current"])
def test_op_bodies_run_on_the_stubs(recipe, monkeypatch):
    bench = file_module("op_body_cost", "bench/op_body_cost.py")
    gemms = []
    real = bench.StubExtension.generic_gemm
    monkeypatch.setattr(
        bench.StubExtension, "generic_gemm", lambda *a, **k: gemms.append(a[2:5:2]) or real(*a, **k)
    )
    before = (extension.tex, te_compile.configure().aten_fp8_gemm)
    us = bench.measure(recipe, rows=256, hidden=256, calls=2)
    assert set(us) == {"linear_fwd", "linear_bwd"} and all(v > 0 for v in us.values())
    # fprop (TN), then dgrad (NN) and wgrad (NT) per backward, every call through the stub
    assert set(gemms) == {(True, False), (False, False), (False, True)}
    assert (extension.tex, te_compile.configure().aten_fp8_gemm) == before
