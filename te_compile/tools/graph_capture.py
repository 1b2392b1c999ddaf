"""`te_compile.capture`: a compiled function captured in a manual `torch.cuda.graph`.

For users who capture CUDA graphs themselves (a whole training step, or a piece of one) instead
of `torch.compile(mode="reduce-overhead")`. The rules it follows, and that any manual capture of
compiled TE code must follow (docs/cuda_graphs.md):

- Warm up on a side stream first: the first calls compile (dynamo, inductor), create TE's
  persistent state (DelayedScaling amax/scale, FP8 weight caches) and TE's cuBLAS workspace,
  and initialise cuBLAS/cuDNN handles. None of that may happen during capture. The side stream
  waits for the current stream before, and the current stream waits for it after
  (`wait_stream`), so the warm-up is ordered with the work around it.
- Capture on the graph's own stream (`torch.cuda.graph` provides it). Forward and backward
  are captured together: autograd runs each backward op on the stream its forward op ran on.
- Parameters' `.grad` are set to None before capture, so backward allocates them from the
  graph's memory pool: each replay then writes fresh gradients into those same tensors.
- Between replays only the *values* of the static inputs may change (`copy_` into them); their
  shapes, dtypes and addresses, the recipe, the module configuration and Python-side state are
  fixed at capture. Persistent FP8 state (DelayedScaling amax history and scale) lives in
  tensors that each replay updates in place, as eager steps would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch


@dataclasses.dataclass
class CapturedGraph:
    """A captured CUDA graph with its static inputs and outputs. Call it with new input values
    (copied into the static inputs), or `replay()` after writing them yourself."""

    graph: torch.cuda.CUDAGraph
    static_inputs: tuple
    static_outputs: Any

    def __call__(self, *inputs):
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        with torch.no_grad():
            for static, new in zip(self.static_inputs, inputs, strict=True):
                if isinstance(static, torch.Tensor):
                    static.copy_(new)
                elif static is not new and static != new:
                    raise ValueError("non-tensor inputs are fixed at capture")
        return self.replay()

    def replay(self):
        self.graph.replay()
        return self.static_outputs


def capture(
    fn: Callable,
    *static_inputs,
    warmup: int = 3,
    reset_grads: Iterable[torch.Tensor] = (),
    pool=None,
) -> CapturedGraph:
    """Warm `fn(*static_inputs)` up `warmup` times on a side stream, then capture one call in a
    CUDA graph. `fn` may be compiled (`torch.compile`) and may run backward (forward and
    backward are then captured together). `reset_grads`: tensors (parameters, inputs) whose
    `.grad` is set to None before capture, so that the captured backward allocates their
    gradients from the graph's pool (pass the parameters the step differentiates). `pool`: a
    memory pool shared with other graphs (`torch.cuda.graph_pool_handle()`)."""
    if warmup < 1:
        raise ValueError("capture needs at least one warm-up call (compilation, lazy init)")
    reset_grads = list(reset_grads)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            _set_grads_to_none(reset_grads)
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    _set_grads_to_none(reset_grads)
    with torch.cuda.graph(graph, pool=pool):
        static_outputs = fn(*static_inputs)
    return CapturedGraph(graph, static_inputs, static_outputs)


def _set_grads_to_none(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None
