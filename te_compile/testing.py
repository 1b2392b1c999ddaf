"""Helpers for tests and the CPU demo; library code never imports this module.

`pretend_gpu("hopper")` makes TE believe it sits on a GPU generation by pinning the answers TE
caches for its support checks and its compute-capability query. It lets a machine without a GPU
trace TE code for that generation; nothing runs on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

_MXFP8_NO = "Device compute capability 10.0 or higher required for MXFP8 execution."
_NVFP4_NO = "Device compute capability 10.0 or higher required for NVFP4 execution."

# name: (compute capability, the support answers TE would cache on that GPU)
GENERATIONS = {
    "hopper": (
        (9, 0),
        {
            "_FP8_SUPPORT": (True, ""),
            "_FP8_BLOCK_SCALING_SUPPORT": (True, ""),
            "_MXFP8_SUPPORT": (False, _MXFP8_NO),
            "_NVFP4_SUPPORT": (False, _NVFP4_NO),
        },
    ),
    "blackwell": (
        (10, 0),
        {
            "_FP8_SUPPORT": (True, ""),
            "_FP8_BLOCK_SCALING_SUPPORT": (True, ""),
            "_MXFP8_SUPPORT": (True, ""),
            "_NVFP4_SUPPORT": (True, ""),
        },
    ),
}


@contextlib.contextmanager
def pretend_gpu(generation: str):
    """Within the block, TE's support checks answer as on `generation` (see GENERATIONS)."""
    from transformer_engine.pytorch import quantization as q
    from transformer_engine.pytorch import utils

    cc, answers = GENERATIONS[generation]
    saved = [(q, name, getattr(q, name)) for name in answers]
    saved += [
        (m, "get_device_compute_capability", m.get_device_compute_capability) for m in (q, utils)
    ]
    try:
        for name, value in answers.items():
            setattr(q, name, value)
        for mod in (q, utils):
            # TE's own is an assume_constant_result function: keep that, compiled code differs
            mod.get_device_compute_capability = torch.compiler.assume_constant_result(lambda: cc)
        yield cc
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


@dataclasses.dataclass
class RecordingBackend:
    """A torch.compile backend that keeps every graph it is handed and runs it as is."""

    graphs: list = dataclasses.field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self) -> list[str]:
        """Names of every call_function target in every graph."""
        return [
            str(n.target) for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"
        ]
