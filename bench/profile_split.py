"""Where a profiled step's CPU goes, by kind of call, from `bench/profile_step.py`'s cProfile
files (`profile-<recipe>-<mode>.txt`), one column per file.

    python bench/profile_split.py FILE [FILE ...]

Per step: calls, and ms under cProfile (which inflates Python calls, not C++ ones much: compare
the columns, not a row with the step's real issue time). Rows:

- Triton launches: inductor's launcher (`triton_heuristics...run`), cumulative;
- GEMM calls: `torch._scaled_mm` (also as `torch.ops.aten`), `torch.mm`, `torch.addmm`, own time
  (cuBLAS's host work);
- TE's C++ entry points (`transformer_engine_torch.*`), own time;
- dynamo's frame entry (`compile_wrapper`, own time: the guard check runs inside it);
- compiled wrappers: inductor's generated `call` functions, own time (the Python between kernels);
- custom-op autograd layer: torch.library's `forward_no_grad` and `redispatch`, own time (an op
  with an autograd formula, called from a compiled forward);
- te_compile's Python: own time of functions in te_compile/ (its op bodies, storages rebuilt
  from saved parts), and TE's Python: own time of transformer_engine/'s .py functions (its
  storage and quantizer constructors);
- output allocations: inductor's `empty_strided_cuda`, own time;
- autograd engine: `run_backward`'s own time (the engine's C++ between backward nodes);
- the rest of the step.

Only the functions in the file's top lists count (profile_step.py keeps the top 150 by own time
and by cumulative time since session 60; older files 40 and 60), so a row of many small
functions, te_compile's Python above all, is a lower bound and its calls are not counted.
"""

from __future__ import annotations

import re
import sys

# row: (own or cumulative time, the functions' pattern, profiled frames per call)
ROWS = {
    "Triton launches": ("cum", r"triton_heuristics\.py:\d+\(run\)", 1),
    "GEMM calls": ("own", r"\{built-in method torch\.(_ops\.aten\.)?(_scaled_mm|mm|addmm)\}", 1),
    "TE's C++ entry points": ("own", r"transformer_engine_torch\.", 1),
    "dynamo's frame entry (guards)": ("own", r"eval_frame\.py:\d+\(compile_wrapper\)", 1),
    "compiled wrappers": ("own", r"torchinductor_.*\(call\)", 1),
    "custom-op autograd layer": (
        "own",
        r"_library/autograd\.py:\d+\(forward_no_grad\)|_ops\.py:\d+\(redispatch\)",
        2,
    ),
    "te_compile's Python": ("own", r"/te_compile/[\w/]*\.py:\d+\(", None),
    "TE's Python": ("own", r"/transformer_engine/[\w/]*\.py:\d+\(", None),
    "output allocations": ("own", r"\{built-in method [\w.]*_empty_strided_cuda\}", 1),
    "autograd engine": ("own", r"\{method 'run_backward' of", 1),
}
LINE = re.compile(r"\s*([\d/]+)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s+(.*)$")


def split(path: str) -> tuple[float, dict]:
    text = open(path).read()
    steps = int(re.match(r"(\d+) steps", text).group(1))
    seen = {}  # each function once (the file lists the top by own time, then by cumulative)
    for line in text.splitlines():
        m = LINE.match(line)
        if m and m.group(4) not in seen:
            seen[m.group(4)] = (
                int(m.group(1).split("/")[-1]),
                float(m.group(2)),
                float(m.group(3)),
            )
    step_ms = max(cum for _, _, cum in seen.values()) / steps * 1e3
    out = {}
    for row, (kind, pattern, frames) in ROWS.items():
        hits = [v for name, v in seen.items() if re.search(pattern, name)]
        calls = None if frames is None else sum(n for n, _, _ in hits) / steps / frames
        ms = sum(own if kind == "own" else cum for _, own, cum in hits) / steps * 1e3
        out[row] = (calls, ms)
    out["rest"] = (None, step_ms - sum(ms for _, ms in out.values()))
    return step_ms, out


def main() -> None:
    paths = sys.argv[1:]
    cols = [split(p) for p in paths]
    print("| per step: calls / ms under cProfile | " + " | ".join(paths) + " |")
    print("|---|" + "---|" * len(paths))
    print("| the step | " + " | ".join(f"{ms:.2f} ms" for ms, _ in cols) + " |")
    for row in [*ROWS, "rest"]:
        cells = (
            f"{ms:.2f}" if calls is None else f"{calls:.0f} / {ms:.2f}"
            for calls, ms in (c[row] for _, c in cols)
        )
        print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
