"""patch()/unpatch() on the real TE: idempotent, reversible, version-gated."""

from __future__ import annotations

import pytest
import torch
from autocast_cases import in_autocast
from conftest import compile_fullgraph
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import fp8 as te_fp8
from transformer_engine.pytorch import quantization as q

import te_compile

FGS = q.FP8GlobalStateManager


def _patched_names():
    return (
        q.check_recipe_support,
        q.get_default_fp8_recipe,
        vars(FGS)["autocast_enter"],
        vars(FGS)["reduce_and_update_fp8_tensors"],
    )


def test_patch_unpatch_restore_te_exactly():
    before = _patched_names()
    before_reexport = te_fp8.check_recipe_support
    te_compile.patch()
    te_compile.patch()
    try:
        assert te_compile.is_patched()
        during = _patched_names()
        assert all(a is not b for a, b in zip(before, during, strict=True))
        # TE's re-exports of a patched function are patched too
        assert te_fp8.check_recipe_support is q.check_recipe_support
    finally:
        te_compile.unpatch()
        te_compile.unpatch()
    assert not te_compile.is_patched()
    assert all(a is b for a, b in zip(before, _patched_names(), strict=True))
    assert te_fp8.check_recipe_support is before_reexport


def test_unpatch_brings_back_te_behaviour(fake_gpu, backend):
    fake_gpu("hopper")
    te_compile.patch()
    compile_fullgraph(in_autocast(recipe=R.DelayedScaling()), backend)(torch.zeros(1))
    te_compile.unpatch()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="DelayedScaling is not supported under torch.compile"):
        compile_fullgraph(in_autocast(recipe=R.DelayedScaling()), backend)(torch.zeros(1))


def test_patch_refuses_unsupported_te(monkeypatch):
    monkeypatch.setattr("te_compile.versions.te_version", lambda: "2.19.0")
    with pytest.raises(te_compile.UnsupportedVersionError, match="2.19.0"):
        te_compile.patch()
    assert not te_compile.is_patched()


def test_eager_autocast_is_te_own_when_patched(patched, fake_gpu):
    """Outside compile the twins call TE's originals: eager TE still builds a fresh default."""
    fake_gpu("hopper")
    assert q.get_default_fp8_recipe() is not q.get_default_fp8_recipe()
    with pytest.raises(RuntimeError, match="10.0 or higher"):  # TE: MXFP8 needs Blackwell
        q.check_recipe_support(R.MXFP8BlockScaling())


def test_doctor_reports(patched):
    report = te_compile.doctor()
    assert "transformer-engine" in report and "patched" in report and "True" in report


def test_doctor_cudnn_graph_note():
    """cuDNN <= 9.15 (TE's `<= 91500` rule): the doctor names the CUDA-graph sequence limit."""
    from te_compile.tools.doctor import _cudnn_graph_note

    assert "multiples of 128" in _cudnn_graph_note((9, 15, 0))
    assert "multiples of 128" in _cudnn_graph_note((9, 10, 2))
    assert _cudnn_graph_note((9, 15, 1)) == "9.15.1"
    assert _cudnn_graph_note((9, 16, 0)) == "9.16.0"


def test_doctor_torch_cudnn_refused(monkeypatch):
    """torch refusing the loaded cuDNN (seen on a lent H200: built for 9.19, TE loaded 9.14) is
    reported with torch's own words, and a usable one by its version."""
    from te_compile.tools.doctor import _torch_cudnn

    def refuse():
        raise RuntimeError("cuDNN version incompatibility: PyTorch was compiled against (9, 19, 0)")

    monkeypatch.setattr(torch.backends.cudnn, "version", refuse)
    assert _torch_cudnn().startswith("UNUSABLE by torch: cuDNN version incompatibility")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert _torch_cudnn() == "91900"


def test_doctor_names_the_curand_way_out(monkeypatch):
    """TE's import failing for want of cuRAND (torch 2.15 no longer installs it) is reported with
    the package that fixes it; other failures are reported as they are."""
    import importlib

    from te_compile.tools import doctor

    real = importlib.import_module

    def no_curand(name, *args):
        if name == "transformer_engine.pytorch":
            raise RuntimeError("curand shared object not found.")
        return real(name, *args)

    monkeypatch.setattr(doctor.importlib, "import_module", no_curand)
    report = te_compile.doctor()
    assert "import TE" in report and "pip install nvidia-curand" in report
    assert doctor._import_hint(RuntimeError("something else")) == ""
