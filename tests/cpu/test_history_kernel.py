"""graph_fp8/history_kernel.py (the `triton_history_update` option) against the graph operations
it replaces, delayed.in_slots then delayed_update.updated (themselves checked against TE's
kernel: test_graph_delayed_update.py), bit for bit, in Triton's interpreter on the CPU; and what
it does to a DelayedScaling TransformerLayer's backward graph on the simulated GPU. On a GPU:
tests/gpu/test_history_kernel_gpu.py (against TE's fused update kernel, and in training).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import te_compile
from te_compile_testing import graph_fp8

# Run in a process of its own: Triton picks its interpreter when a kernel is defined, so the
# variable must be set before history_kernel is imported, which another test may have done.
_COMPARE = textwrap.dedent(
    """
    import itertools, torch
    from te_compile.graph_fp8 import delayed, delayed_update, history_kernel

    try:
        torch.library.wrap_triton(history_kernel._roll_and_scale)
    except RuntimeError:  # torch 2.11 refuses Triton's interpreted functions; outside a trace
        torch.library.wrap_triton = lambda kernel: kernel  # it only launches the kernel

    VALUES = [0.0, 1e-40, 1e-30, 0.5, 2.5, 448.0, 57344.0, 3e38, float("inf"), float("nan")]
    g = torch.Generator().manual_seed(0)
    def pick(shape):
        return torch.tensor(VALUES)[torch.randint(0, len(VALUES), shape, generator=g)]
    bad = runs = 0
    for length, slots, algo, fp8, margin in itertools.product(
        [1, 2, 5, 16, 1024], [[0], [0, 2]], ["max", "most_recent"], ["e4m3", "e5m2"], [0, 2]
    ):
        n = 2 * len(slots)
        for _ in range(6):
            history, scale = pick((length, n)), pick((n,)).abs() + 0.25
            amaxes = [pick((1,)) for _ in slots]
            latest = torch.maximum(history[0], delayed.in_slots(history[0], dict(zip(slots, amaxes))))
            want_h, want_s = delayed_update.updated(history, scale, latest, algo, fp8, margin)
            got_h, got_s = history.clone(), scale.clone()
            torch.ops.te_compile.delayed_history_update(
                got_h, got_s, amaxes, slots, algo == "most_recent", delayed_update.scaled_max(fp8, margin)
            )
            runs += 1
            same_h = torch.equal(got_h.view(torch.int32), want_h.view(torch.int32))
            same_s = torch.equal(got_s.view(torch.int32), want_s.view(torch.int32))
            bad += not (same_h and same_s)
    print("runs", runs, "differing", bad)
    """
)


def test_kernel_equals_graph_update_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", _COMPARE], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "runs 480 differing 0" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.fixture
def triton_history_update(patched):
    before = te_compile.options.current().triton_history_update
    with graph_fp8(None):  # te_compile's default (CPU traces pin False): the graph path
        te_compile.configure(triton_history_update=True)
        yield
        te_compile.configure(triton_history_update=before)


def test_transformer_layer_backward_launches(triton_history_update):
    """One kernel per module's update, in place on TE's tensors (no copy back), for inductor's
    3, reading the amaxes where they are (the graph gathers them first): a TransformerLayer's
    backward graph has 5 launches fewer here. (7 on a GPU: without a CUDA driver inductor
    cannot read the kernel's Triton IR, takes every argument as written and copies two.)"""
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import kernel_count

    sources = kernel_count.generated_sources("delayed", 1024, 512)
    forward, backward = map(kernel_count.launches, sources)
    # in place: its history and scale arguments are the graph's inputs, TE's own tensors
    calls = re.findall(r"_roll_and_scale_0\.run\((\w+), (\w+),", sources[1])
    assert calls and all(h.startswith("primals") and s.startswith("primals") for h, s in calls)
    te_compile.configure(triton_history_update=False)
    forward_before, backward_before = map(
        kernel_count.launches, kernel_count.generated_sources("delayed", 1024, 512)
    )
    assert len(forward) == len(forward_before)
    assert len(backward) == len(backward_before) - 5, (len(backward), len(backward_before))
    assert backward.count("_roll_and_scale_0") == 3 and "_roll_and_scale_0" not in backward_before


def test_without_triton_the_graph_operations_update(monkeypatch):
    """The option is on by default; where Triton is missing, update_backward_state takes the
    graph operations (the kernel would need Triton), and they give TE's update."""
    import torch

    from te_compile.graph_fp8 import delayed, delayed_update
    from te_compile.recipes import QuantConfig

    assert te_compile.options.current().triton_history_update
    monkeypatch.setattr(delayed, "HAS_TRITON", False)
    cfg = QuantConfig(kind="delayed")
    history = torch.tensor([[0.0, 3.0], [1.0, 2.0], [4.0, 0.5]])  # [len, grad_output/grad_input]
    scale, amax = torch.tensor([1.0, 2.0]), torch.tensor([9.0])
    latest = torch.maximum(history[0], delayed.in_slots(history[0], {0: amax}))
    want_h, want_s = delayed_update.updated(
        history, scale, latest, cfg.amax_algo, cfg.dtypes[2], cfg.margin
    )
    delayed.update_backward_state(cfg, scale, history, [amax])  # GEMM 0's grad_output: slot 0
    assert torch.equal(history, want_h) and torch.equal(scale, want_s)
    assert history.tolist() == [[0.0, 0.0], [4.0, 0.5], [9.0, 3.0]] and scale[0].item() != 1.0
