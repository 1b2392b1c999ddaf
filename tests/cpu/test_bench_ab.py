"""bench/ab.py: the rotation of variants over rounds, the per-round ratios, the variant syntax,
and the dynamo behaviour it relies on (one function compiled with two sets of options keeps
both)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ab():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("ab", ROOT / "bench" / "ab.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_every_round_runs_every_variant_in_a_rotated_order(ab):
    order = []
    measured = ab.alternate(lambda v: order.append(v) or (1.0, 1.0), 3, 4)
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
    assert [len(m) for m in measured] == [4, 4, 4]


def test_ratio_is_the_median_of_per_round_ratios(ab):
    """A drift shared by every variant of a round cancels out of the ratio."""
    drift = [1.0, 1.5, 0.8, 1.2, 2.0]
    measured = [[(10.0 * d, 1.0) for d in drift], [(8.0 * d, 1.0) for d in drift]]
    rows = ab.summary(["a", "b"], measured, [1.0, 1.0])
    assert rows[1]["speedup_vs_first"] == pytest.approx(1.25)
    assert rows[1]["speedup_range"] == pytest.approx([1.25, 1.25])
    assert rows[0]["step_ms"] == pytest.approx(12.0)  # the median over rounds moves with the drift


def test_variant_syntax(ab):
    assert ab.parse_variant("te-transformer/delayed@cpp_wrapper=1,triton.descriptive_names=0") == (
        "te-transformer",
        "delayed",
        "cpp_wrapper=1,triton.descriptive_names=0",
    )
    assert ab.parse_variant("torch-transformer") == ("torch-transformer", None, "")
    with pytest.raises(ValueError, match="RECIPE"):
        ab.parse_variant("te-transformer")
    with pytest.raises(ValueError, match="RECIPE"):
        ab.parse_variant("torch-transformer/current")


def test_te_variants_share_one_recipe(ab):
    with pytest.raises(ValueError, match="share one stack and recipe"):
        ab.build_steps(["te-transformer/current", "te-transformer/delayed"], "64x16x1x1", "compile")


def test_one_function_compiled_with_two_option_sets_keeps_both():
    """ab.py compiles the same step function once per variant; alternating them must not
    recompile (dynamo keeps one cache entry per backend)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)

    def compiled(options):
        def step(inp):
            return model(inp)

        return torch.compile(step, fullgraph=True, **({"options": options} if options else {}))

    before = counters["stats"]["unique_graphs"]
    a, b = compiled(None), compiled({"triton.descriptive_names": False})
    for _ in range(3):
        for f in (a, b):
            f(x).sum().backward()
    assert counters["stats"]["unique_graphs"] - before == 2


class _HostEvent:
    """torch.cuda.Event's timing on the host clock, for a run without a GPU."""

    def __init__(self, enable_timing=False):
        self.t = 0.0

    def record(self):
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def _cpu_flow(ab, monkeypatch):
    """ab.py on the CPU: inputs there, no CUDA synchronize, a small plain-PyTorch stack."""
    torch._dynamo.reset()
    monkeypatch.setitem(ab.suite.INDUCTOR, "spec", "")  # build_steps sets it per variant
    monkeypatch.setattr(ab, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(
        ab.suite, "build", lambda name, hidden, layers: torch.nn.Linear(16, 16).bfloat16()
    )


def test_two_variants_compile_alternate_and_report(ab, monkeypatch):
    """The whole flow on the CPU with a small plain-PyTorch stack in place of the CUDA ones:
    each variant compiled once (two graphs: forward and backward), rounds alternated without
    recompiling, one summary row per variant."""
    from torch._dynamo.utils import counters

    _cpu_flow(ab, monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)

    def build(name, hidden, layers):
        assert name == "torch"
        return torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU()).bfloat16()

    monkeypatch.setattr(ab.suite, "build", build)
    variants = ["torch", "torch@triton.descriptive_names=0"]
    before = counters["stats"]["unique_graphs"]
    steps = ab.build_steps(variants, "64x16x1", "compile")
    compile_s = ab.first_calls(steps, warmup=1)
    compiled = counters["stats"]["unique_graphs"] - before
    measured = ab.alternate(lambda v: ab.one_round(steps[v][0], 2), len(steps), 3)
    rows = ab.summary(variants, measured, compile_s)
    assert compiled == 2 and counters["stats"]["unique_graphs"] - before == 2
    assert [r["variant"] for r in rows] == variants
    assert all(r["step_ms"] > 0 and len(r["rounds"]) == 3 for r in rows)


def test_a_variant_that_reuses_another_compile_is_refused(ab, monkeypatch):
    """torch.compile's inductor backends compare equal when their options do, and dynamo then
    runs the first variant's code for the second: first_calls must say so, not time it."""
    _cpu_flow(ab, monkeypatch)
    steps = ab.build_steps(["torch", "torch"], "16x8x1", "compile")
    with pytest.raises(RuntimeError, match="compiled nothing"):
        ab.first_calls(steps, warmup=0)


def test_the_cpp_wrapper_variant_compiles_its_own_code(ab, monkeypatch):
    """Session 37 on an H200: `@cpp_wrapper=1`, applied as a global setting with the same
    options as the first variant, had reused the first variant's compile (0.0 s)."""
    from torch._dynamo.utils import counters

    _cpu_flow(ab, monkeypatch)
    steps = ab.build_steps(["torch", "torch@cpp_wrapper=1"], "16x8x1", "compile")
    before = counters["stats"]["unique_graphs"]
    ab.first_calls(steps, warmup=0)
    assert counters["stats"]["unique_graphs"] - before == 2  # one dynamo graph per variant


def test_settings_syntax_and_restore(ab):
    """`%NAME=VALUE,...`: te_compile.configure options by plain name, module attributes by
    dotted name, each set for the variant's step and restored after it."""
    import te_compile
    from te_compile.graph_fp8 import quantize

    text = "te-transformer/current@combo_kernels=1%graph_fp8=False,te_compile.graph_fp8.quantize._ONE_KERNEL_ROWS=0"
    assert ab.parse_variant(text) == ("te-transformer", "current", "combo_kernels=1")
    settings = ab.parse_settings(text)
    assert settings == {"graph_fp8": False, "te_compile.graph_fp8.quantize._ONE_KERNEL_ROWS": 0}
    assert ab.parse_settings("torch-transformer") == {}
    seen = []
    step = ab.with_settings(
        lambda: seen.append((te_compile.options.current().graph_fp8, quantize._ONE_KERNEL_ROWS)),
        settings,
    )
    before = (te_compile.options.current().graph_fp8, quantize._ONE_KERNEL_ROWS)
    step()
    assert seen == [(False, 0)]
    assert (te_compile.options.current().graph_fp8, quantize._ONE_KERNEL_ROWS) == before


def test_amax_grouping_setting_gets_its_own_compiled_entry(ab):
    """What the grouped-amax A/B relies on: dynamo guards on quantize._ONE_KERNEL_ROWS, so the
    two settings compile once each, then alternate without compiling, with equal values."""
    from torch._dynamo.utils import counters

    from te_compile.graph_fp8 import quantize

    torch._dynamo.reset()
    x, w = torch.randn(32, 64), torch.randn(128, 64) * 3

    @torch.compile(fullgraph=True)
    def step():
        return torch.cat(quantize.amaxes(x, w))

    one_by_one = ab.with_settings(step, {"te_compile.graph_fp8.quantize._ONE_KERNEL_ROWS": 0})
    before = counters["stats"]["unique_graphs"]
    grouped_out, single_out = step(), one_by_one()
    assert counters["stats"]["unique_graphs"] - before == 2
    for _ in range(2):
        assert torch.equal(step(), grouped_out) and torch.equal(one_by_one(), single_out)
    assert counters["stats"]["unique_graphs"] - before == 2
    assert torch.equal(grouped_out, single_out)
    assert torch.equal(grouped_out, torch.stack([x.abs().max(), w.abs().max()]))
