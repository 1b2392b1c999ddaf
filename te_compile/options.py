"""Library-wide options. `graph_fp8` is read when dynamo traces, which guards on it: changing it
between calls recompiles the compiled functions that read it (the next call traces again).
`aten_fp8_gemm` and `aten_block_gemm` are read by the ops when they run (they change no graph).

    te_compile.configure(graph_fp8=False)   # TE's kernels for every GEMM, whatever its size
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Options:
    # FP8 quantization and GEMMs as graph operations inductor fuses (graph_fp8/), where they
    # apply; TE's own kernels otherwise. None (the default): the graph path for per-tensor
    # (current, delayed) GEMMs small enough that issuing TE's kernels, not running them, bounds
    # the step (graph_fp8/linear.py's AUTO_MAX_MACS), where the two paths agree bit for bit;
    # True: wherever it applies; False: never. docs/graph_fp8.md. Under CUDA graphs
    # (mode="reduce-overhead") False measured faster: a replayed step costs its kernels' GPU
    # time, and TE's fused kernels take less than the graph path's (docs/training.md).
    graph_fp8: bool | None = None
    # Per-tensor FP8 GEMMs through aten's `_scaled_mm` (kernels/aten_gemm.py), bit-identical
    # to TE's `generic_gemm` call and cheaper to issue; False: every GEMM through TE.
    aten_fp8_gemm: bool = True
    # Float8BlockScaling GEMMs (forward, dgrad, wgrad) through aten's blockwise `_scaled_mm_v2`
    # (kernels/aten_gemm.py) instead of TE's `generic_gemm`. Bit-identical to TE's call on an
    # H200 but off: aten's blockwise call costs more host time than TE's (34-55 against 20-32
    # us), so a CPU-bound step got slower (0.76-0.86x; docs/performance.md, session 60).
    aten_block_gemm: bool = False
    # Float8CurrentScaling GEMM weights quantized by graph operations inductor fuses
    # (graph_fp8/weight.py, bit-identical to TE's quantize) instead of a TE call per weight.
    # Off by default: measured no faster (docs/perf/history.md, session 11).
    graph_weight_quantize: bool = False
    # DelayedScaling's grad_output cast in a module with a bias on the graph path as graph
    # operations, its bias gradient summed in the order of TE's fused cast kernel
    # (graph_fp8/te_dbias.py) instead of a call into that kernel (one per biased module's
    # backward). Bit-identical to that kernel on an H200; off by default: measured no faster
    # (docs/perf/history.md, session 41).
    graph_dbias: bool = False
    # DelayedScaling's per-module backward update on the graph path (the history roll and the
    # scale) as one Triton kernel of te_compile's own (graph_fp8/history_kernel.py) instead of
    # the 3 inductor makes of the same arithmetic; TE's fused update bit for bit on an H200.
    # On by default since session 43 (docs/perf/history.md); False: the graph operations.
    triton_history_update: bool = True


_current = Options()


def configure(**changes) -> Options:
    """Set options by name (see `Options`); returns the options now in force."""
    global _current
    _current = dataclasses.replace(_current, **changes)
    return _current


def current() -> Options:
    return _current
