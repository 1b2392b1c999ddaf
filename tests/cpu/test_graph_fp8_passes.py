"""How many times the graph path's generated code reads each tensor it quantizes, from inductor's
code for the simulated GPU (nothing runs). The quantization kernels are memory-bound, so the
passes over a tensor are their GPU time:

- DelayedScaling: the cast and the amax the cast records read the tensor in one kernel, as TE's
  cast kernel does (the amax is taken row by row, which inductor fuses with the cast's loop;
  a whole-tensor amax was a split reduction of its own, a second pass).
- A GEMM weight is quantized from its stored bfloat16 values without quantize.stored_bf16's
  re-rounding (the identity on a load), which put integer work into every pass over it.
- Current scaling's amax pass over a fused producer's value skips the per-element re-rounding
  (the amax is rounded once); the cast keeps it.

On the H100 (docs/perf/history.md, session 23) these took a 4-layer DelayedScaling
TransformerLayer stack's CUDA-graph step at H=2048 from 4.92 to 4.56 ms of GPU time."""

from __future__ import annotations

import re

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile.tools.check_inductor import InductorRecorder
from te_compile_testing import graph_fp8

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")

_SHAPE = re.compile(r"assert_size_stride\((primals_\d+), \(([\d, ]+)\)")
# torch 2.14's form for several inputs: names, then their shapes, in one call
_SHAPES = re.compile(r"assert_size_stride_grouped\(\(([\w, ]+)\), \(((?:\([\d, ]+\),? ?)+)\)")
_LAUNCH = re.compile(r"(triton_\w+)\.run\((.*)\)")
_KERNEL = re.compile(r"\n(triton_\w+) = async_compile\.triton\('\w+', '''(.*?)'''", re.S)


def rounds_to_bf16(source: str, kernel: str) -> bool:
    """Whether `kernel`'s Triton code has quantize.stored_bf16's bit arithmetic (its mask of the
    bits a bfloat16 keeps, 0xFFFF0000 as int32)."""
    return "-65536" in dict(_KERNEL.findall(source))[kernel]


def kernels_reading(source: str) -> dict[tuple[int, ...], list[str]]:
    """The Triton kernels each graph input of the forward is passed to, by the input's shape."""
    body = source[source.index("    def call(self, args):") :]
    found = _SHAPE.findall(body)
    for names, dims in _SHAPES.findall(body):
        names = [n.strip() for n in names.split(",") if n.strip()]
        found += zip(names, re.findall(r"\(([\d, ]+)\)", dims), strict=True)
    shapes = {
        name: tuple(int(d) for d in dims.split(",") if d.strip())
        for name, dims in found
        if name.startswith("primals_")
    }
    reads: dict[tuple[int, ...], list[str]] = {shape: [] for shape in shapes.values()}
    for kernel, args in _LAUNCH.findall(body):
        passed = {a.strip() for a in args.split(",")}
        for name, shape in shapes.items():
            if name in passed:
                reads[shape].append(kernel)
    return reads


def forward_source(recipe) -> str:
    """Inductor's forward code of a bias-free te.Linear (on the graph path) training step."""
    rec = InductorRecorder("hopper")
    with te_compile.simulate_gpu("hopper"), graph_fp8(None), rec.context():
        m = te.Linear(256, 512, bias=False, params_dtype=torch.bfloat16).cuda()
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step(x):
            with te.autocast(recipe=recipe):
                return m(x)

        torch.compile(step, backend=rec.backend, fullgraph=True)(x).float().sum().backward()
    return rec.sources[0]


def test_delayed_scaling_reads_input_and_weight_once(patched):
    source = forward_source(R.DelayedScaling())
    reads = kernels_reading(source)
    assert len(reads[(128, 256)]) == 1, reads  # the input: cast and amax in one kernel
    assert len(reads[(512, 256)]) == 1, reads  # the weight
    assert not rounds_to_bf16(source, reads[(512, 256)][0])  # a stored weight: no re-rounding


def test_current_scaling_weight_passes_do_no_rounding(patched):
    source = forward_source(R.Float8CurrentScaling())
    reads = kernels_reading(source)
    # current scaling: an amax pass, then the cast with the scale from it (TE: two kernels too)
    assert len(reads[(512, 256)]) == 2, reads
    assert not any(rounds_to_bf16(source, k) for k in reads[(512, 256)]), reads
    # the input (in general a fused producer's value): stored_bf16 kept in the cast only; the
    # amax pass takes the unrounded maximum and rounds that once (quantize_current's `stored`)
    amax_pass, cast = reads[(128, 256)]
    assert "amax" in amax_pass and "amax" not in cast, reads
    assert not rounds_to_bf16(source, amax_pass) and rounds_to_bf16(source, cast), reads
