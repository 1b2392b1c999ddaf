"""Issue 20's targets, each met or missed with its measured value, from bench/suite.py's JSON.

    python bench/targets.py docs/perf/session34/s1024.json docs/perf/session34/s2048.json \
        docs/perf/session34/guide.json [another run's JSON ...]

A ratio takes both its times from one file, that is from one run on one machine (the suite's
rule: the lent hosts' CPU time moves between machines by more than most changes); a target that
several files can answer (a rerun) shows each file's value, in the order given. The shapes are
the issue's: 4 te.TransformerLayers at H=1024, S=512, B=1 and at H=2048, S=1024, B=2 (heads of
64), and TE's guide layer (H=4096, S=2048, B=8, one layer); the stacks the suite's
`te-transformer`, `torch-transformer` (plain PyTorch bf16) and `torchao-transformer` (torchao
float8 tensorwise). Needs no GPU and no torch: the table is printed from the files alone.
A recipe the suite ran with options gets a column of its own: the bench parts' second file
(`<part>-cudagraphs.json`) adds `current-tekernels` and `delayed-tekernels`, the CUDA-graph
rows on TE's kernels (`configure(graph_fp8=False)`, docs/training.md's setting under CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

SMALL, MID, GUIDE = "1024x512x4x1", "2048x1024x4x2", "4096x2048x1x8"
TE, TORCH, TORCHAO = "te-transformer", "torch-transformer", "torchao-transformer"
COMPILED = ("compile", "reduce-overhead")
RECIPE_ORDER = ("current", "delayed", "block", "guide")


class Run:
    """One suite file's cells that ran, by (shape, stack, recipe, mode)."""

    def __init__(self, path: str):
        with open(path) as f:
            data = json.load(f)
        self.path = path
        self.cells = {
            (c["shape"], c["stack"], c["recipe"], c["mode"]): c
            for c in data["cells"]
            if c["status"] == "ok"
        }

    def ms(self, shape, stack, recipe, mode) -> float | None:
        cell = self.cells.get((shape, stack, recipe, mode))
        return cell["step_ms"] if cell else None

    def best_compiled(self, shape, stack, recipe) -> float | None:
        times = [self.ms(shape, stack, recipe, m) for m in COMPILED]
        return min((t for t in times if t), default=None)

    def te_cells(self, recipe: str) -> list[dict]:
        return [c for (_, s, r, _), c in self.cells.items() if s == TE and r == recipe]


def _ratio(theirs, ours) -> float | None:
    return theirs / ours if theirs and ours else None


@dataclass(frozen=True)
class Target:
    """One line of the issue's targets: `value(run, recipe)` (None: the run cannot say) against
    `bound`, met when at least it (`at_least`) or at most it; `unit` formats the value."""

    name: str
    value: Callable[[Run, str], float | None]
    bound: float
    at_least: bool = True
    unit: str = "x"

    def verdict(self, value: float) -> str:
        met = value >= self.bound if self.at_least else value <= self.bound
        text = f"{value:.2f}{self.unit}" if self.unit == "x" else f"{value:.2f} {self.unit}"
        return f"**{text}**" if met else text


def _ro_vs_bf16(shape):
    return lambda run, r: _ratio(
        run.ms(shape, TORCH, None, COMPILED[1]), run.ms(shape, TE, r, COMPILED[1])
    )


def _default_vs_eager(shape):
    return lambda run, r: _ratio(run.ms(shape, TE, r, "eager"), run.ms(shape, TE, r, "compile"))


def _default_vs_torchao(shape):
    return lambda run, r: _ratio(
        run.ms(shape, TORCHAO, None, "compile"), run.ms(shape, TE, r, "compile")
    )


def _guide_vs_eager(run, r):
    return _ratio(run.ms(GUIDE, TE, r, "eager"), run.best_compiled(GUIDE, TE, r))


def _guide_vs_peer(stack):
    return lambda run, r: _ratio(
        run.best_compiled(GUIDE, stack, None), run.best_compiled(GUIDE, TE, r)
    )


TARGETS = (
    Target("reduce-overhead >= 1.1x plain bf16, H=2048", _ro_vs_bf16(MID), 1.1),
    Target("reduce-overhead >= 0.9x plain bf16, H=1024", _ro_vs_bf16(SMALL), 0.9),
    Target("default >= 1.5x eager TE, H=1024", _default_vs_eager(SMALL), 1.5),
    Target("default >= 1.5x eager TE, H=2048", _default_vs_eager(MID), 1.5),
    Target("default >= torchao compiled, H=1024", _default_vs_torchao(SMALL), 1.0),
    Target("default >= torchao compiled, H=2048", _default_vs_torchao(MID), 1.0),
    Target(
        "guide layer <= 21.67 ms (best compiled mode)",
        lambda run, r: run.best_compiled(GUIDE, TE, r),
        21.67,
        at_least=False,
        unit="ms",
    ),
    Target("guide layer >= 1.15x eager TE", _guide_vs_eager, 1.15),
    Target("guide layer >= 1.3x torchao compiled", _guide_vs_peer(TORCHAO), 1.3),
    Target("guide layer >= 1.7x plain bf16 compiled", _guide_vs_peer(TORCH), 1.7),
)


def cell_checks(run: Run, recipe: str) -> list[str]:
    """The issue's last target line for one recipe's TE cells in `run`: what it breaks of
    1 graph, 0 recompiles and 0 cudagraph skips per compiled cell, a first call under 60 s for
    the 4-layer shapes, and peak memory at or below eager TE's (MiB over it, per shape)."""
    broken = []
    for cell in run.te_cells(recipe):
        if cell["mode"] == "eager":
            continue
        where = f"{cell['shape']} {cell['mode']}"
        if cell.get("graphs") != 1 or cell.get("recompiles") or cell.get("cudagraph_skips"):
            broken.append(
                f"{where}: {cell.get('graphs')} graphs, {cell.get('recompiles')} recompiles"
            )
        if cell["shape"] != GUIDE and cell["compile_s"] >= 60:
            broken.append(f"{where}: first call {cell['compile_s']:.0f} s")
        eager = run.cells.get((cell["shape"], TE, recipe, "eager"))
        if eager and cell["peak_mib"] > eager["peak_mib"]:
            broken.append(f"{where}: peak +{cell['peak_mib'] - eager['peak_mib']:.0f} MiB")
    return broken


def table(runs: list[Run]) -> str:
    recipes = sorted(
        {r for run in runs for (_, s, r, _) in run.cells if s == TE and r},
        key=lambda r: (RECIPE_ORDER.index(r) if r in RECIPE_ORDER else len(RECIPE_ORDER), r),
    )
    rows = [["target (issue 20)", *recipes]]
    for target in TARGETS:
        row = [target.name]
        for recipe in recipes:
            values = [v for v in (target.value(run, recipe) for run in runs) if v is not None]
            row.append("; ".join(target.verdict(v) for v in values) or "-")
        rows.append(row)
    row = ["1 graph, 0 recompiles, 0 cudagraph skips, first call < 60 s, peak <= eager TE"]
    for recipe in recipes:
        ran = [run for run in runs if run.te_cells(recipe)]
        broken = [b for run in ran for b in cell_checks(run, recipe)]
        row.append(("; ".join(broken) if broken else "**met**") if ran else "-")
    rows.append(row)
    lines = [rows[0], ["---"] * len(rows[0]), *rows[1:]]
    legend = "bold: met. Files, in order: " + ", ".join(run.path for run in runs)
    return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n\n" + legend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="bench/suite.py JSON files")
    print(table([Run(path) for path in parser.parse_args().files]))


if __name__ == "__main__":
    main()
