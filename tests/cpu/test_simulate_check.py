"""te_compile.simulate_gpu, te_compile.check and `python -m te_compile check`, as a user runs
them (public API only; scripts run in subprocesses), and configure_tf32's API choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.pytorch import quantization, utils

import te_compile

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_user_script_traces_every_recipe():
    run = _run("examples/simulate_trace.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": 1 graph") == 4, run.stdout
    for name in ("none", "delayed", "current", "block"):
        assert f"te.Linear fwd+bwd, {name}: ok, 2 graphs" in run.stdout, run.stdout
    assert "linear_fwd, linear_bwd" in run.stdout


def test_cli_check_norm_family():
    run = _run("-m", "te_compile", "check", "examples/check_model.py:build_norm_family")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "20 of 20 cases passed" in run.stdout
    for row in ("qkv     LayerNormLinear", "mlp     LayerNormMLP", "norm    RMSNorm"):
        assert row in run.stdout, run.stdout
    assert "layernorm_linear, linear, layernorm_mlp, norm" in run.stdout, run.stdout


def test_cli_check_passes_and_prints_a_table():
    run = _run("-m", "te_compile", "check", "examples/check_model.py:build")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "20 of 20 cases passed" in run.stdout
    assert "1.fc2   Linear      delayed  ok      2 " in run.stdout, run.stdout
    # Float8CurrentScaling at this size: the default graph path, whose one te_compile op is the
    # bias gradient (the subprocess runs with the library's defaults).
    assert "1.fc2   Linear      current  ok      2                 bias_grad" in run.stdout
    assert "1.fc2   Linear      block    ok      2                 linear" in run.stdout


def test_cli_check_inductor():
    """--backend inductor: every graph also compiled by inductor as for an H100 (code generated,
    nothing run), DelayedScaling included."""
    target = "examples/check_model.py:build"
    run = _run(
        "-m", "te_compile", "check", target, "--recipe", "current,delayed", "--backend", "inductor"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "graphs compiled by inductor for it" in run.stdout
    assert "10 of 10 cases passed" in run.stdout, run.stdout


def test_cli_check_passes_a_model_whose_eager_code_differs():
    """The model's eager code calls .item() on its activations (meta tensors cannot answer),
    compiled code skips it, as HF transformers' mask code does: the per-module cases take their
    inputs from the whole-model trace and pass; exit 0."""
    run = _run("-m", "te_compile", "check", "examples/check_model.py:build_eager_only_code")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "12 of 12 cases passed" in run.stdout and "not reached" not in run.stdout


def test_cli_check_fails_on_an_unsupported_option():
    target = "examples/check_model.py:build_unsupported"
    run = _run("-m", "te_compile", "check", target, "--recipe", "current")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "refused" in run.stdout and "delay_wgrad_compute=True" in run.stdout
    assert "0.fc1   Linear      current  ok" in run.stdout, run.stdout  # others still checked


def test_check_reports_teS_reason_for_an_unsupported_recipe(patched):
    with te_compile.simulate_gpu("hopper"):
        model = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    report = te_compile.check(model, x, recipes=["mxfp8"], per_module=False)
    assert not report.ok
    assert "10.0 or higher required for MXFP8" in report.results[0].reason


def test_check_on_blackwell_traces_mxfp8_and_nvfp4(patched):
    with te_compile.simulate_gpu("sm100"):
        model = te.Linear(128, 128, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    report = te_compile.check(model, x, arch="blackwell", recipes=["mxfp8", "nvfp4"])
    assert report.ok, report.table()
    assert all(r.graphs == 2 and "linear_bwd" in r.ops for r in report.results)


def test_simulate_restores_everything():
    available = torch.cuda.is_available
    answers = {n: getattr(quantization, n) for n in ("_FP8_SUPPORT", "_MXFP8_SUPPORT")}
    capability = utils.get_device_compute_capability
    arange, tensor = torch.arange, torch.tensor
    with te_compile.simulate_gpu("blackwell") as gpu:
        assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)
        assert utils.get_device_compute_capability() == gpu.capability
        assert quantization.check_mxfp8_support() == (True, "")
        assert torch.empty(2, device="cuda").device.type == "meta"
        assert torch.zeros(2).to("cuda").device.type == "meta"
        assert torch.nn.Linear(2, 2).cuda().weight.device.type == "meta"
        assert torch.arange(3, device="cuda").device.type == "meta"
        assert torch.tensor([1.0], device="cuda").device.type == "meta"
    assert torch.arange is arange and torch.tensor is tensor
    assert torch.cuda.is_available is available and not torch.cuda.is_available()
    assert utils.get_device_compute_capability is capability
    assert {n: getattr(quantization, n) for n in answers} == answers
    assert torch.empty(2).device.type == "cpu"


@pytest.mark.parametrize("factory", ["arange", "randn", "zeros", "eye"])
def test_simulate_places_traced_factories_on_meta(factory):
    """Factories called in compiled code land on meta too: dynamo 2.11 traces torch.arange,
    torch.randn, ... past the TorchFunctionMode (TE's unfused attention mask is built with
    torch.arange(..., device="cuda"))."""
    make = {
        "arange": lambda: torch.arange(4, dtype=torch.float32, device="cuda"),
        "randn": lambda: torch.randn(4, device="cuda"),
        "zeros": lambda: torch.zeros(4, device="cuda"),
        "eye": lambda: torch.eye(4, device="cuda")[0],
    }[factory]
    torch._dynamo.reset()
    with te_compile.simulate_gpu("hopper"):
        x = torch.ones(4, device="cuda")
        out = torch.compile(lambda x: x * make(), backend="eager", fullgraph=True)(x)
    assert out.device.type == "meta" and out.shape == (4,)


def test_check_does_not_compile_the_model_s_compiled_helpers_on_their_own(patched):
    """A torch.compile'd helper the model calls between TE modules (as TE's jit fusions are) is
    inlined into the whole-model case and never compiled on its own: the per-module cases take
    their inputs from that trace (and where the model runs eagerly, as a fallback, such helpers
    run eagerly: inductor on meta tensors failed in torch 2.11)."""
    compiled_helpers = []

    def backend(gm, example_inputs):
        compiled_helpers.append(gm)
        return gm.forward

    helper = torch.compile(lambda t: t * 2 + 1, backend=backend)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = te.Linear(64, 64, params_dtype=torch.bfloat16)
            self.fc2 = te.Linear(64, 64, params_dtype=torch.bfloat16)

        def forward(self, x):
            return self.fc2(helper(self.fc1(x)))

    with te_compile.simulate_gpu("hopper"):
        model = Model()
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    report = te_compile.check(model, x, recipes=["current"])
    assert report.ok, report.table()
    assert [r.target for r in report.results] == ["model", "fc1", "fc2"]
    assert compiled_helpers == []


def test_simulate_rejects_unknown_arch():
    with pytest.raises(ValueError, match="unknown arch 'ampere'"):
        with te_compile.simulate_gpu("ampere"):
            pass


# ---- configure_tf32 ----------------------------------------------------------------------------


@pytest.fixture
def tf32_state():
    """Restore torch's TF32 flags through the API each test used."""
    b = torch.backends
    new = (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision)
    yield
    b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision = new


def test_tf32_picks_the_new_api_where_torch_has_it(tf32_state):
    from te_compile.tools.tf32 import tf32_enabled

    assert te_compile.configure_tf32() == "fp32_precision"  # torch 2.14 has it
    assert tf32_enabled() == {"matmul": True, "cudnn": True}
    assert te_compile.configure_tf32(False) == "fp32_precision"
    assert tf32_enabled() == {"matmul": False, "cudnn": False}
    # "ieee" agrees with the legacy flags' default: reading them does not raise
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_tf32_new_api_then_legacy_read_is_torch_s_mixed_error(tf32_state):
    """Documented in tf32.py: with fp32_precision="tf32", torch refuses legacy matmul reads."""
    te_compile.configure_tf32(api="fp32_precision")
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        _ = torch.backends.cuda.matmul.allow_tf32


def test_tf32_legacy_api_keeps_both_readable(tf32_state):
    from te_compile.tools.tf32 import tf32_enabled

    assert te_compile.configure_tf32(api="allow_tf32") == "allow_tf32"
    assert tf32_enabled("allow_tf32") == {"matmul": True, "cudnn": True}
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the new API reads it too
    te_compile.configure_tf32(False, api="allow_tf32")
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_check_a_te_module_as_the_model_lists_its_te_children(patched):
    """A TransformerLayer as the model: the model case, then its outermost TE children (not the
    layer twice, not its nested linears), each traced fwd+bwd on its own."""
    with te_compile.simulate_gpu("hopper"):
        layer = te.TransformerLayer(
            128, 256, 4, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0
        )
        x = torch.randn(32, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    report = te_compile.check(layer, x, recipes=["current"])
    assert report.ok, report.table()
    assert [r.target for r in report.results] == ["model", "self_attention", "layernorm_mlp"]
    assert "fused_attn_bwd" in report.results[1].ops
