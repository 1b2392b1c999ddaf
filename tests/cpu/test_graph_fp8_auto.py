"""The default `graph_fp8=None` traced on CPU with a pretend Hopper: small per-tensor (current,
delayed) GEMMs take the graph path, large ones, block scaling and `graph_fp8=False` TE's kernel
ops, and `True` the graph path at any size. (The choice never changes numerics: both paths are
bit-identical to eager TE where the default picks the graph path, tests/gpu/.)"""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile.graph_fp8.linear import AUTO_MAX_MACS
from te_compile_testing import JointRecorder, graph_fp8

TE_OPS = ("linear_fwd", "layernorm_linear_fwd", "layernorm_mlp_fwd")


def _forward_ops(make, recipe, rows: int, setting) -> list[str]:
    """The te_compile ops and scaled GEMMs of one compiled forward of `make()` on `rows` rows,
    with graph_fp8=`setting`."""
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"), graph_fp8(setting):
        module = make()
        x = torch.randn(rows, module_in(module), device="cuda", dtype=torch.bfloat16)
        x.requires_grad_()

        def fn(x):
            with te.autocast(recipe=recipe):
                return module(x)

        torch.compile(fn, backend=rec.backend, fullgraph=True)(x).float().sum().backward()
    return [t.split(".")[1] for t in rec.targets(rec.fw) if "te_compile" in t or "_scaled_mm" in t]


def module_in(m) -> int:
    return m.in_features if hasattr(m, "in_features") else m.fc1_weight.shape[1]


def _linear(k, n):
    return lambda: te.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")


def _mlp():
    return te.LayerNormMLP(64, 256, params_dtype=torch.bfloat16, device="cuda")


def _ln_linear():
    return te.LayerNormLinear(64, 96, params_dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("make", [_linear(64, 32), _ln_linear, _mlp], ids=["linear", "ln", "mlp"])
def test_small_current_scaling_takes_the_graph_path(make, patched, graph_breaks):
    ops = _forward_ops(make, R.Float8CurrentScaling(), 32, None)
    assert graph_breaks() == 0
    assert not any(op in TE_OPS for op in ops) and "_scaled_mm" in ops, ops


@pytest.mark.parametrize("setting", [None, True])
def test_large_gemm_stays_on_te_kernels_unless_forced(setting, patched):
    """rows x in x out one step past AUTO_MAX_MACS: TE's op by default, the graph path when
    asked for; exactly at it, the graph path."""
    k = n = 4096
    over = AUTO_MAX_MACS // (k * n) * 2
    ops = _forward_ops(_linear(k, n), R.Float8CurrentScaling(), over, setting)
    assert ("linear_fwd" in ops) == (setting is None), ops
    at = _forward_ops(_linear(k, n), R.Float8CurrentScaling(), AUTO_MAX_MACS // (k * n), None)
    # (a 4096 x 4096 weight: its GEMM and TE's transposed copy of it in one op)
    assert "linear_fwd" not in at and "scaled_mm_transposing" in at, at


@pytest.mark.parametrize("make", [_linear(64, 32), _ln_linear, _mlp], ids=["linear", "ln", "mlp"])
def test_small_delayed_scaling_takes_the_graph_path(make, patched, graph_breaks):
    """DelayedScaling too (its fused dbias casts run on TE's kernels inside the graph path)."""
    ops = _forward_ops(make, R.DelayedScaling(), 32, None)
    assert graph_breaks() == 0
    assert not any(op in TE_OPS for op in ops) and "_scaled_mm" in ops, ops


def test_block_scaling_stays_on_te_kernels(patched):
    """Block scaling, which the graph path lacks, stays on TE's kernels."""
    for make, op in ((_linear(64, 32), "linear_fwd"), (_mlp, "layernorm_mlp_fwd")):
        assert op in _forward_ops(make, R.Float8BlockScaling(), 32, None)


def test_off_keeps_te_kernels(patched):
    for make, op in ((_linear(64, 32), "linear_fwd"), (_ln_linear, "layernorm_linear_fwd")):
        assert op in _forward_ops(make, R.Float8CurrentScaling(), 32, False)


@pytest.mark.parametrize("deferred", [True, False], ids=["eager_autocast", "traced_autocast"])
def test_amax_reduction_takes_the_graph_path_when_deferred(deferred):
    """DelayedScaling with an amax reduction over ranks: under an eager autocast the exit reduces
    and updates every state (the backward only merges amaxes), so the graph path runs; with the
    autocast traced inside, each backward op reduces over the group itself, which only the
    TE-kernel ops do."""
    from te_compile.graph_fp8 import linear
    from te_compile.recipes import QuantConfig

    key = (
        "kind=delayed;dtypes=e4m3,e4m3,e5m2;pow2=0,0,0;eps=0.0,0.0,0.0;blocks=1,2,1;acc=0,1,1;"
        f"transpose=1;rht=0,0,0;sr=0,0,0;algo=max;margin=0.0;fused=1;defer={int(deferred)};"
        "group=world"
    )
    cfg = QuantConfig.from_key(key)
    assert cfg.amax_group and cfg.defers_backward_update == deferred
    x = torch.empty(64, 128, dtype=torch.bfloat16, device="meta")
    w = torch.empty(256, 128, dtype=torch.bfloat16, device="meta")
    reason = linear.applies(cfg, x, w, torch.bfloat16)
    assert (reason == "") == deferred, reason
