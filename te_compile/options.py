"""Library-wide options, read when dynamo traces. Dynamo guards on them: changing one between
calls recompiles the compiled functions that read it (the next call traces again).

    te_compile.configure(graph_fp8=True)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Options:
    # FP8 quantization and GEMMs as graph operations inductor fuses (graph_fp8/), where they
    # apply; TE's own kernels otherwise. Off by default: docs/graph_fp8.md says where the two
    # paths agree bit for bit and where not.
    graph_fp8: bool = False


_current = Options()


def configure(**changes) -> Options:
    """Set options by name (see `Options`); returns the options now in force."""
    global _current
    _current = dataclasses.replace(_current, **changes)
    return _current


def current() -> Options:
    return _current
