"""scripts/gpu_suite.sh's queue over several GPUs (`PARTS=...`), run on this CPU machine: each
listed part runs exactly once, on one of the `GPUS` workers, and the summary gives each part's
pytest count (here every GPU test skips), or says when a part was stopped by PART_TIMEOUT."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")
ROOT = Path(__file__).resolve().parents[2]


def run_suite(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """scripts/gpu_suite.sh with `env` added, its output folder `tmp_path`."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, **env}
    script = str(ROOT / "scripts/gpu_suite.sh")
    return subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=600)


def fake_python(tmp_path: Path, pytest_body: str) -> str:
    """A `python` for the suite that runs `pytest_body` (bash) in place of pytest, and nothing
    for the suite's other Python steps (the doctor)."""
    fake = tmp_path / "fake_python"
    fake.write_text('#!/bin/bash\n[ "$2" = pytest ] || exit 0\n' + pytest_body)
    fake.chmod(0o755)
    return str(fake)


def run_queue(tmp_path: Path, parts: str, gpus: int, timeout: int = 0):
    done = run_suite(tmp_path, PARTS=parts, GPUS=str(gpus), PART_TIMEOUT=str(timeout))
    return done.returncode, done.stdout, (tmp_path / "queue.log").read_text()


def test_each_part_runs_once_on_the_gpu_workers(tmp_path):
    rc, out, queue = run_queue(tmp_path, "2a loops2 1", gpus=2)
    assert rc == 0, out
    starts = re.findall(r"GPU (\d): PART=(\w+) from", queue)
    assert sorted(part for _, part in starts) == ["1", "2a", "loops2"]
    assert {gpu for gpu, _ in starts} == {"0", "1"}
    assert re.search(r"PART=loops2: 6 skipped, 20 deselected", out), out
    assert re.search(r"PART=2a: \d+ skipped", out), out


def test_a_part_stopped_by_the_timeout_says_so(tmp_path):
    rc, out, _ = run_queue(tmp_path, "2a", gpus=1, timeout=1)
    assert rc != 0
    assert "PART=2a: no pytest summary (stopped by PART_TIMEOUT, or crashed)" in out


def test_two_parts_side_by_side_on_one_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PER_GPU", "2")
    rc, out, queue = run_queue(tmp_path, "loops2 2a", gpus=1)
    assert rc == 0, out
    events = re.findall(r"GPU (\d): PART=(\w+) (from|done)", queue)
    assert {gpu for gpu, _, _ in events} == {"0"}
    assert [kind for _, _, kind in events][:2] == ["from", "from"], queue  # both ran at once
    assert re.search(r"PART=loops2: 6 skipped, 20 deselected", out), out


def test_a_stopped_part_reports_its_progress(tmp_path):
    """A part cut by PART_TIMEOUT: its summary counts the progress pytest printed before."""
    fake = fake_python(tmp_path, "printf 'collected\\n........ss [ 40%%]\\n..F.x'\nsleep 60\n")
    done = run_suite(tmp_path / "out", PARTS="2a", GPUS="1", PYTHON=fake, PART_TIMEOUT="3")
    assert done.returncode != 0
    want = "progress before the stop: 11 passed, 1 failed, 2 skipped, 1 xfailed"
    assert want in done.stdout, done.stdout


def test_each_test_start_and_end_is_recorded_as_it_happens(tmp_path):
    """tests/conftest.py's progress file: one line as each test starts and one as it ends (here
    every GPU test skips in its setup), in the part's folder."""
    rc, out, _ = run_queue(tmp_path, "checkpointcg", gpus=1)
    assert rc == 0 and re.search(r"PART=checkpointcg: 4 skipped, 11 deselected", out), out
    lines = [
        line.split("\t")
        for line in (tmp_path / "partcheckpointcg/progress.txt").read_text().splitlines()
    ]
    assert [kind for kind, _, _ in lines] == ["started", "skipped"] * 4, lines
    assert all("under_cuda_graphs" in nodeid for _, _, nodeid in lines), lines


def test_a_stopped_part_names_the_test_it_was_in(tmp_path):
    """Sessions 58 and 59 stopped the checkpoint file after 14 of its 15 cases and could not say
    which case held it: the summary now names it, from the progress file."""
    fake = fake_python(
        tmp_path,
        "t=$(date +%s)\n"
        'printf "started\\t$t\\ttests/a.py::one\\npassed\\t0.5\\ttests/a.py::one\\n'
        'started\\t$t\\ttests/a.py::two[delayed]\\n" >>"$TE_COMPILE_TEST_PROGRESS"\n'
        "printf '.'\nsleep 60\n",
    )
    done = run_suite(tmp_path / "out", PARTS="2a", GPUS="1", PYTHON=fake, PART_TIMEOUT="3")
    assert done.returncode != 0
    assert "running at the stop: tests/a.py::two[delayed] (for " in done.stdout, done.stdout


def test_the_queue_timeout_bounds_the_whole_queue(tmp_path):
    """QUEUE_TIMEOUT: the running part stops at the queue's deadline, and a part that would start
    after it is reported as not started (session 55: a queue of parts under PART_TIMEOUT alone
    outran the device call that held it, which then returned no report)."""
    fake = fake_python(tmp_path, "printf '...'\nsleep 60\n")
    env = dict(PARTS="2a 2d", GPUS="1", PYTHON=fake, QUEUE_TIMEOUT="3", QUEUE_MARGIN="1")
    env["PART_TIMEOUT"] = "0"  # timeout(1)'s "no limit": the queue's deadline still applies
    start = time.monotonic()
    done = run_suite(tmp_path / "out", **env)
    assert time.monotonic() - start < 30, done.stdout
    assert "PART=2a: no pytest summary" in done.stdout and "3 passed" in done.stdout, done.stdout
    assert "PART=2d: not started (QUEUE_TIMEOUT)" in done.stdout, done.stdout


@pytest.mark.parametrize("var", ["PART", "PARTS"])
def test_a_misspelt_part_is_refused_before_anything_runs(tmp_path, var):
    """Session 37's `PART=loops` (for loops1/loops2) fell through to the whole suite and ran it
    until its stop: an unknown name now stops the script at once, naming the part."""
    done = run_suite(tmp_path, **{var: "loops" if var == "PART" else "2a loops"})
    assert done.returncode == 2 and "no part named loops" in done.stderr, done.stderr
    assert not (tmp_path / "queue.log").exists() and not (tmp_path / "doctor.txt").exists()
