"""examples/distributed_gpt.py on one GPU (torchrun, one rank): FSDP2 and DDP without a second
GPU, so the data-parallel wrappers' compiled paths are checked in every single-GPU run.

DelayedScaling under FSDP2 with the layers compiled per block and te.autocast entered eagerly
is a known divergence (session 32, docs/distributed.md "Known issue"): compiled losses differ
from eager TE's by about 1.0 over 50 steps, on TE's kernels and on the graph path alike, while
the same model under DDP differs by 0.04. It is a strict xfail: a fix makes it pass, and the
suite then says so. Skips without a CUDA GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from te_compile_testing import torchrun

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
LOSS_BOUND = 0.25  # as test_distributed_gpu.py: max |compiled - eager| over 50 steps
KNOWN_DIVERGENCE = "fsdp2/delayed_local"
CASES = ["ddp/delayed_local", "ddp-outside/delayed_local", "fsdp2/current", KNOWN_DIVERGENCE]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path_factory.mktemp("fsdp2_one_rank")
    args = ["--out", out, "--no-state", "--cases", ",".join(CASES)]
    port = {"PET_MASTER_PORT": os.environ.get("PET_MASTER_PORT", "29517")}  # beside a 2-GPU run
    proc = torchrun(ROOT / "examples" / "distributed_gpt.py", 1, args, timeout=900, env=port)
    path = out / "distributed-gpt.json"
    assert path.exists(), proc.stderr[-3000:]
    return json.loads(path.read_text())


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason="docs/distributed.md"))
        if c == KNOWN_DIVERGENCE
        else c
        for c in CASES
    ],
)
def test_compiled_trains_like_eager_on_one_rank(run, case):
    result = run[case]
    assert "error" not in result, result.get("error")
    compiled = result["compiled"]["losses"]
    assert compiled[-1] < compiled[0] - 1.0, "compiled run did not learn"
    assert result["max_diff"] < LOSS_BOUND, result["max_diff"]
