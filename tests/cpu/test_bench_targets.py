"""bench/targets.py: issue 20's target table from bench/suite.py's JSON, on session 34's files
(docs/perf/session34/) and on fabricated cells where the answer is known."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import file_module

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs" / "perf" / "session34"


def _targets():
    return file_module("targets", "bench/targets.py")


def _rows(text: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return {row[0].strip(): [c.strip() for c in row[1:]] for row in rows}


def test_session34_table_holds_its_measured_ratios():
    """The ratios docs/perf/history.md states for session 34, recomputed from its raw JSON;
    a rerun's values follow the first run's in the same cell."""
    t = _targets()
    files = ["s1024.json", "s2048.json", "guide.json", "ro-1024-rerun.json"]
    rows = _rows(t.table([t.Run(str(RUNS / f)) for f in files]))
    assert rows["target (issue 20)"] == ["current", "delayed", "block", "guide"]
    assert rows["reduce-overhead >= 0.9x plain bf16, H=1024"][:2] == [
        "**1.16x**; 0.66x",
        "0.63x; 0.87x",
    ]
    assert rows["reduce-overhead >= 1.1x plain bf16, H=2048"][:3] == [
        "1.05x",
        "**1.14x**",
        "**1.12x**",
    ]
    assert rows["default >= 1.5x eager TE, H=2048"][1] == "0.86x"
    assert rows["guide layer <= 21.67 ms (best compiled mode)"][3] == "**21.20 ms**"
    assert rows["guide layer >= 1.3x torchao compiled"][3] == "1.24x"
    checks = rows["1 graph, 0 recompiles, 0 cudagraph skips, first call < 60 s, peak <= eager TE"]
    assert checks[:3] == ["**met**"] * 3 and "peak +256 MiB" in checks[3]


def _cell(shape, stack, recipe, mode, ms, **extra):
    cell = {"shape": shape, "stack": stack, "recipe": recipe, "mode": mode, "status": "ok"}
    cell.update(step_ms=ms, compile_s=5.0, peak_mib=100.0, graphs=1, recompiles=0)
    cell.update(cudagraph_skips=0, **extra)
    return cell


def test_bounds_and_cell_checks_on_fabricated_cells(tmp_path):
    """A ratio exactly at its bound is met, one below is not; a recompile, a slow first call
    and a peak above eager TE's are each named; a cell that failed counts as absent."""
    t = _targets()
    small, te, torch_ = t.SMALL, t.TE, t.TORCH
    cells = [
        _cell(small, torch_, None, "reduce-overhead", 0.9),
        _cell(small, te, "current", "reduce-overhead", 1.0),  # 0.90x: met
        _cell(small, te, "delayed", "reduce-overhead", 1.01, recompiles=1),  # 0.89x: missed
        _cell(small, te, "delayed", "eager", 2.0, graphs=None, peak_mib=90.0),
        _cell(small, te, "delayed", "compile", 1.0, compile_s=61.0),
        _cell(small, te, "current", "eager", 2.0, graphs=None),
        {**_cell(small, te, "current", "compile", 1.0), "status": "error"},
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"cells": cells}))
    rows = _rows(t.table([t.Run(str(path))]))
    assert rows["reduce-overhead >= 0.9x plain bf16, H=1024"] == ["**0.90x**", "0.89x"]
    assert rows["default >= 1.5x eager TE, H=1024"] == ["-", "**2.00x**"]
    current, delayed = rows[
        "1 graph, 0 recompiles, 0 cudagraph skips, first call < 60 s, peak <= eager TE"
    ]
    assert current == "**met**"
    assert "1 recompiles" in delayed and "first call 61 s" in delayed and "peak +10 MiB" in delayed
