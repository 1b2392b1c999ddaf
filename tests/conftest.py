"""Shared test harness: TE availability, patch state, a recording backend, a pretend-GPU fixture.

CPU tests never touch a CUDA driver. `fake_gpu` makes TE believe it sits on a given GPU
generation by setting the answers TE caches for its support checks (tests only); fake CUDA
tensors come from FakeTensorMode (see `fake_cuda`).
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

from te_compile_testing import GENERATIONS, RecordingBackend, inductor_options, recipe_supported

warnings.filterwarnings("ignore", module="transformer_engine")

try:
    import transformer_engine.pytorch as te  # noqa: F401
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch import quantization as q
    from transformer_engine.pytorch import utils as te_utils

    TE_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001
    TE_IMPORT_ERROR = e

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_te = pytest.mark.skip(reason=f"Transformer Engine does not import: {TE_IMPORT_ERROR}")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        elif TE_IMPORT_ERROR is not None:
            item.add_marker(skip_te)


def pytest_configure(config):
    """TE_COMPILE_TEST_GC_EVERY_ALLOCATION=1: the garbage collector runs after every allocation,
    so a finalizer that disturbs a compile (docs/gpu.md, "Seen once") runs at the first chance,
    at the same point in every run, instead of wherever the collector's timing puts it."""
    if os.environ.get("TE_COMPILE_TEST_GC_EVERY_ALLOCATION") == "1":
        import gc

        gc.set_threshold(1, 1, 1)


def _progress(line: str) -> None:
    """TE_COMPILE_TEST_PROGRESS=FILE: one line per test start and end, written as they happen, so
    that a run stopped by a time limit names the test it was in and what each before it took
    (sessions 58 and 59 had only pytest's dots: scripts/gpu_suite.sh reads this file)."""
    path = os.environ.get("TE_COMPILE_TEST_PROGRESS")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def pytest_runtest_logstart(nodeid, location):
    _progress(f"started\t{time.time():.1f}\t{nodeid}")


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _progress(f"{report.outcome}\t{report.duration:.1f}\t{report.nodeid}")


@pytest.fixture(scope="session", autouse=True)
def inductor_config_from_env():
    """TE_COMPILE_TEST_INDUCTOR="combo_kernels=1,triton.cooperative_reductions=1" runs the suite
    with that inductor config (e.g. the GPU suite's bit-identity checks under an option a user
    may set; docs/perf/history.md, session 31). Tests only: inductor's config is private."""
    spec = os.environ.get("TE_COMPILE_TEST_INDUCTOR", "")
    if not spec:
        yield
        return
    from torch._inductor import config

    with config.patch(inductor_options(spec)):
        yield


@pytest.fixture
def backend():
    return RecordingBackend()


def compile_fullgraph(fn, backend, **kw):
    return torch.compile(fn, backend=backend, fullgraph=True, **kw)


@pytest.fixture
def graph_breaks():
    """Counts dynamo graph breaks (private counters: tests only)."""
    from torch._dynamo.utils import counters

    counters.clear()
    return lambda: sum(counters["graph_break"].values())


@pytest.fixture(autouse=True)
def _clean_state():
    """Fresh dynamo caches and TE global FP8 state around every test."""
    torch._dynamo.reset()
    if TE_IMPORT_ERROR is None:
        q.FP8GlobalStateManager.reset()
    yield
    torch._dynamo.reset()
    if TE_IMPORT_ERROR is None:
        q.FP8GlobalStateManager.reset()


# GPU tests run with te_compile's default graph_fp8 (None) unless TE_COMPILE_GRAPH_FP8 is "0"
# (TE's kernels for every GEMM) or "1": scripts/gpu_suite.sh's PART=3 runs the current-scaling
# cases with "0", so the TE-kernel path of small Float8CurrentScaling GEMMs stays tested.
_GPU_GRAPH_FP8 = {"0": False, "1": True}.get(os.environ.get("TE_COMPILE_GRAPH_FP8", ""))


@pytest.fixture(autouse=True)
def _graph_fp8_setting(request):
    """CPU traces pin `graph_fp8=False`: they check the TE-kernel ops' schemas, fakes and
    autograd, which the default (None: the graph path for small Float8CurrentScaling GEMMs)
    would bypass. The graph path's own traces turn it on (`te_compile_testing.graph_fp8`) and
    tests/cpu/test_graph_fp8_auto.py traces the default's choice. GPU tests: see above."""
    folder = request.node.path.parent.name
    setting = False if folder == "cpu" else _GPU_GRAPH_FP8 if folder == "gpu" else None
    if setting is None or TE_IMPORT_ERROR is not None:
        yield
        return
    from te_compile_testing import graph_fp8

    with graph_fp8(setting):
        yield


@pytest.fixture
def patched():
    import te_compile

    te_compile.patch()
    yield te_compile
    te_compile.unpatch()


def constant_capability(cc):
    return torch.compiler.assume_constant_result(lambda: cc)


@pytest.fixture
def fake_gpu(monkeypatch):
    """`fake_gpu("hopper")` makes TE believe it runs on that GPU generation (tests only)."""
    if HAS_CUDA:
        pytest.skip("pretending a GPU generation is for CPU-only runs")

    def pretend(generation: str):
        cc, answers = GENERATIONS[generation]
        for name, value in answers.items():
            monkeypatch.setattr(q, name, value)
        for mod in (q, te_utils):
            # Keep TE's assume_constant_result wrapper: compiled code sees what it sees on a GPU.
            monkeypatch.setattr(mod, "get_device_compute_capability", constant_capability(cc))
        return cc

    return pretend


@pytest.fixture
def fake_cuda():
    """A FakeTensorMode in which `torch.empty(..., device="cuda")` works without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


# The GPU generation each recipe needs (MXFP8 and NVFP4 need Blackwell).
RECIPE_GENERATION = {
    "delayed": "hopper",
    "current": "hopper",
    "block": "hopper",
    "mxfp8": "blackwell",
    "nvfp4": "blackwell",
    "custom": "hopper",
}


def recipe_instances() -> dict:
    """One instance of every recipe class TE 2.20 has (CustomRecipe with a trivial factory)."""
    return {
        "delayed": R.DelayedScaling(),
        "current": R.Float8CurrentScaling(),
        "block": R.Float8BlockScaling(),
        "mxfp8": R.MXFP8BlockScaling(),
        "nvfp4": R.NVFP4BlockScaling(),
        "custom": R.CustomRecipe(qfactory=_identity_factory),
    }


def file_module(name: str, relative_path: str):
    """The repository's file `relative_path` (not in a package: examples/, bench/) as a module,
    loaded once under `name` (registered before it runs: dataclasses look their module up)."""
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / relative_path
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def example_models():
    """examples/models.py as a module (the GPT and Llama-style models the tests train)."""
    return file_module("te_example_models", "examples/models.py")


def recipe_for(name: str):
    """The recipe instance a test names ("none": no FP8, None)."""
    return None if name == "none" else recipe_instances()[name]


def skip_unless_supported(name: str) -> None:
    """Skip the calling test where this GPU cannot run recipe `name` (TE's reason)."""
    ok, reason = recipe_supported(name)
    if not ok:
        pytest.skip(reason)


def _identity_factory(role):
    return None  # never called by the autocast tests; modules that need quantizers use their own


if TE_IMPORT_ERROR is not None:
    # Without TE only the TE-free tests can even be imported.
    collect_ignore_glob = ["cpu/*", "gpu/*"]
