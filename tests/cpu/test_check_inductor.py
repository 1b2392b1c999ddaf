"""te_compile.check(..., backend="inductor"): each graph compiled by inductor as for an H100, on
a machine without a GPU (te_compile/tools/check_inductor.py), so CPU CI catches inductor-only
failures."""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe

import te_compile
from te_compile.tools.check_inductor import InductorRecorder

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")


class Block(torch.nn.Module):
    """te.Linear, gelu, te.Linear and a residual: elementwise work inductor fuses into Triton
    kernels around the te_compile ops."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.fc1 = te.Linear(hidden, 2 * hidden, params_dtype=torch.bfloat16)
        self.fc2 = te.Linear(2 * hidden, hidden, params_dtype=torch.bfloat16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _block():
    with te_compile.simulate_gpu("hopper"):
        model = Block().cuda()
        x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return model, x


def test_inductor_check_float8_current_scaling(patched):
    model, x = _block()
    report = te_compile.check(model, x, recipes=["current"], backend="inductor")
    assert report.ok, report.table()
    assert [r.target for r in report.results] == ["model", "fc1", "fc2"]
    assert all(r.graphs == 2 and "linear_bwd" in r.ops for r in report.results)
    assert "compiled by inductor" in report.table().splitlines()[0]


def test_inductor_check_delayed_scaling(patched):
    """DelayedScaling's backward GEMM op mutates the backward scale and amax history (an
    auto_functionalized_v2 node), which inductor's post-grad passes must decompose. Inductor on
    the meta tensors themselves refused that ("auto_functionalized_v2 was not removed" on
    torch 2.14: its pattern passes skip nodes with meta inputs); the check compiles on fake CUDA
    tensors, as on a GPU, where it decomposes and compiles."""
    model, x = _block()
    report = te_compile.check(model, x, recipes=["delayed"], backend="inductor")
    assert report.ok, report.table()


def test_inductor_generates_triton_kernels_around_the_te_ops(patched):
    """A real compile for the GPU: the Triton kernels of the fused elementwise ops and calls
    of the te_compile ops (extern kernels), forward and backward."""
    model, x = _block()
    rec = InductorRecorder("hopper")
    with te_compile.simulate_gpu("hopper"), rec.context():
        with te.autocast(recipe=recipe.Float8CurrentScaling()):
            out = torch.compile(model, backend=rec.backend, fullgraph=True)(x)
        out.float().sum().backward()
    forward, backward = rec.sources
    assert "@triton.jit" in forward and "torch.ops.te_compile.linear_fwd" in forward
    assert "torch.ops.te_compile.linear_bwd" in backward
    assert "gelu" in backward and rec.triton_kernels() >= 3
    # (torch 2.11 writes device='cuda:0', 2.14 device='cuda')
    assert "device='cuda" in forward and "device='meta'" not in forward + backward


def _fails_in_inductor(graph):
    raise AssertionError("an inductor-only failure")


def test_an_inductor_only_failure_fails_the_check(patched):
    """A failure in inductor's post-grad passes (a custom pass standing in for a bug there)
    fails the inductor check and not the default one."""
    model, x = _block()
    with torch._inductor.config.patch(post_grad_custom_post_pass=_fails_in_inductor):
        report = te_compile.check(model, x, recipes=["current"], per_module=False)
        assert report.ok, report.table()
        report = te_compile.check(
            model, x, recipes=["current"], per_module=False, backend="inductor"
        )
    (result,) = report.results
    assert result.status == "error"
    assert result.reason == "InductorError: AssertionError: an inductor-only failure"


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tvm'"):
        te_compile.check(lambda x: x, torch.ones(1), backend="tvm")
