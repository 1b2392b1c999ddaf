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
- the rest of the step.
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
        calls = sum(n for n, _, _ in hits) / steps / frames
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
