"""DelayedScaling's backward scale read on the graph path (graph_fp8.delayed.read_with): TE's
tensor selected by a condition computed from the gradient, in place of a copy op. It must keep
every bit of the scale, and inductor must run every kernel that reads it before the update that
writes it in the same backward graph. Where it is read (the backward graph, from the forward
input itself): tests/cpu/test_deferred_update_trace.py."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

import te_compile
from te_compile.graph_fp8.delayed import read_with
from te_compile_testing import graph_fp8

TINY, HUGE = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
SCALES = [0.0, -0.0, 1.0, 448.0, 2.0**-140, -(2.0**-149), TINY, TINY / 3, HUGE, -HUGE]
SCALES += [float("inf"), float("-inf"), 0.1, 57344.0, 1 / 448.0]


def _scales() -> torch.Tensor:
    """SCALES plus a quiet and a signalling-pattern NaN with payloads, as float32 bits."""
    nans = torch.tensor([0x7FC00001, 0x7F800001, -0x00400001], dtype=torch.int32)
    return torch.cat([torch.tensor(SCALES), nans.view(torch.float32)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("first", [0.0, -0.0, float("nan"), float("inf"), -3.5])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_read_keeps_every_bit(dtype, first, compiled):
    """Whatever the gradient's first element (NaN and infinities included), the read is the
    scale's bits, NaN payloads too; compiled by inductor as well (CPU code)."""
    scale = _scales()
    grad = torch.full((3, 5), 2.0, dtype=dtype)
    grad[0, 0] = first
    fn = torch.compile(read_with, backend="inductor", fullgraph=True) if compiled else read_with
    got = fn(scale, grad)
    assert got.dtype == torch.float32 and got.shape == scale.shape
    assert torch.equal(got.view(torch.int32), scale.view(torch.int32))
    if not compiled:  # new memory: a later write to TE's tensor leaves the read as it was
        kept = got.clone()
        scale.fill_(3.0)
        assert torch.equal(got.view(torch.int32), kept.view(torch.int32))


@pytest.mark.parametrize("triton_update", [True, False], ids=["triton_update", "graph_update"])
def test_update_runs_after_every_read(triton_update, patched):
    """A TransformerLayer under DelayedScaling with the autocast inside the compiled step: the
    backward updates each module's scales in the graph (triton_history_update: our Triton
    kernel in place; else graph operations, written back by inductor). In inductor's code for a
    simulated H100, each backward scale tensor's readers (the kernels the read fuses into, TE's
    dbias cast) are launched before its update: the last launch naming the tensor is the
    update. (Read in place, a fused cast once ran after TE's update op's write: torch 2.11;
    the ops here are other ones, and each torch this runs on checks them.)"""
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import kernel_count

    before = te_compile.options.current().triton_history_update
    try:
        with graph_fp8(None):
            te_compile.configure(triton_history_update=triton_update)
            backward = kernel_count.wrapper_code(
                kernel_count.generated_sources("delayed", 128, 64)[1]
            )
    finally:
        te_compile.configure(triton_history_update=before)
    calls = [line for line in backward.splitlines() if re.search(r"\.run\(|te_compile\.", line)]
    updates = [i for i, line in enumerate(calls) if "roll" in line.split(".run(")[0]]
    assert updates
    # each tensor an update kernel touches (TE's scales and histories): every other launch
    # naming it comes before the first update kernel naming it
    for name in {n for i in updates for n in re.findall(r"\bprimals_\d+\b", calls[i])}:
        named = [i for i, line in enumerate(calls) if re.search(rf"\b{name}\b", line)]
        first_update = min(set(named) & set(updates))
        assert all(i < first_update for i in named if i not in updates), (name, calls)
    # the reads fused into inductor's kernels (no copy op): the projection's and MLP's FC2
    # casts, which are graph operations (their biases are the layer's own adds)
    assert "scale_in_backward" not in backward
    state = {n for i in updates for n in re.findall(r"\bprimals_\d+\b", calls[i])}
    fused = [line for i, line in enumerate(calls) if ".run(" in line and i not in updates]
    read = {n for line in fused for n in re.findall(r"\bprimals_\d+\b", line)} & state
    assert len(read) == 2, read
