"""te-compile's ops in a profiled step, side by side: calls and CPU per step from
`bench/profile_step.py`'s torch.profiler tables (`torchprof-<recipe>-<mode>.txt`), one column
per file.

    python bench/profile_ops.py FILE [FILE ...] [--match REGEX]

Per op (default: the ops named `te_compile::...`; `--match` picks other rows, e.g.
`aten::(clone|copy_)`): calls per step x CPU total per call = CPU ms per step, torch.profiler's
own overhead included (compare columns of one host, not a row with the step's issue time).
The first row is the profiler's CPU total per step. "-": not among the table's rows
(profile_step.py keeps the top 50 by own CPU), not proof of no call. Session 47 used it to find what a
DelayedScaling step calls that a current-scaling step does not (docs/perf/history.md, session 47).
"""

from __future__ import annotations

import argparse
import re

_UNIT_US = {"us": 1.0, "ms": 1e3, "s": 1e6}


def _us(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    return float(m.group(1)) * _UNIT_US[m.group(2)]


def read(path: str, match: str) -> tuple[float, dict[str, tuple[float, float]]]:
    """(profiler CPU ms per step, {op: (calls per step, CPU total us per call)}) from the first
    table of one file (ops by own CPU time; the GPU table below it repeats names)."""
    text = open(path).read()
    steps = int(re.match(r"(\d+) steps", text).group(1))
    table = text.split("By GPU time:")[0]
    total = re.search(r"Self CPU time total: (\S+)", table)
    ops = {}
    for line in table.splitlines():
        # name (may hold spaces), self CPU %, self CPU, CPU total %, CPU total, CPU avg, ...,
        # # of calls: the 10 numeric columns split from the right
        cols = line.strip().rsplit(None, 10)
        if len(cols) == 11 and re.search(match, cols[0]) and cols[0] not in ops:
            ops[cols[0]] = (int(cols[-1]) / steps, _us(cols[5]))
    return _us(total.group(1)) / steps / 1e3, ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--match", default=r"^te_compile::")
    args = p.parse_args()
    cols = [read(f, args.match) for f in args.files]
    names = sorted({name for _, ops in cols for name in ops})
    print("| per step | " + " | ".join(args.files) + " |")
    print("|---|" + "---|" * len(cols))
    print("| profiler CPU total | " + " | ".join(f"{ms:.2f} ms" for ms, _ in cols) + " |")
    for name in names:
        cells = []
        for _, ops in cols:
            calls, us = ops.get(name, (0, 0.0))
            cells.append(f"{calls:g} x {us:.0f} us = {calls * us / 1e3:.2f} ms" if calls else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
