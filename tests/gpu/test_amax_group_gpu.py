"""DelayedScaling under `te.autocast(amax_reduction_group=<subgroup>)` on 2 GPUs: compiled
modules' state registered and reduced under the autocast's group, equal to eager TE bit for
bit (tests/gpu/amax_group_worker.py runs under torchrun). Each rank's group holds that rank
alone and the ranks' inputs differ, so a reduction over the default group (what te_compile
did before session 31) would make the ranks' amaxes equal and unlike eager TE's. Skips
without 2 CUDA GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    out = tmp_path_factory.mktemp("amax_group")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += [str(Path(__file__).with_name("amax_group_worker.py")), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("mode", ["traced", "outside"])
@pytest.mark.parametrize("rank", [0, 1])
def test_compiled_state_equals_eager_te(ranks, rank, mode):
    eager, compiled = ranks[rank]["eager"], ranks[rank][mode]
    assert eager.keys() == compiled.keys()
    for name, want in eager.items():
        assert torch.equal(compiled[name], want), name


def test_ranks_were_not_reduced_together(ranks):
    """The check above can fail: eager TE's ranks hold different amaxes (their own groups)."""
    a, b = ranks[0]["eager"], ranks[1]["eager"]
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith("history"))
    assert any(ranks[0]["eager"][k].abs().sum() > 0 for k in a if k.endswith("history"))
