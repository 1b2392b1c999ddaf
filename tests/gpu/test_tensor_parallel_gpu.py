"""Tensor and sequence parallelism on 2 GPUs: examples/tensor_parallel.py under torchrun (a
stack of LayerNorm + column-parallel te.Linear + ReLU + row-parallel te.Linear blocks, and a
stack of te.TransformerLayer with set_parallel_mode; every Hopper recipe, with and without
sequence parallelism, 50 steps eager TE vs compiled), then its JSON read back. With 2 GPUs, one rank per GPU over NCCL; with one GPU, the 2 ranks share it
over gloo (NCCL refuses two ranks on one GPU): the same computation, gloo's collectives.
Run: `python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py`; or check the JSON of a run
launched by hand: TE_COMPILE_TP_JSON=path/tensor-parallel.json.
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
RECIPES = ["none", "current", "delayed", "block"]
CASES = [f"{k}{r}/{m}" for k in ("", "layer:") for r in RECIPES for m in ("tp", "sp")]
# Graphs besides the model's one: the bf16 TransformerLayer's bias-free LayerNormMLP runs TE's
# own torch.compile'd GELU forward and backward (transformer_engine.pytorch.jit) inside our op,
# one compiled entry each (kernels/activation.py); more would be a recompile.
TE_FUSION_GRAPHS = {"layer:none/tp": 2, "layer:none/sp": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    given = os.environ.get("TE_COMPILE_TP_JSON")
    if given:
        return json.loads(Path(given).read_text())
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    out = tmp_path_factory.mktemp("tensor_parallel")
    # gloo has no coalesced collectives (TE's blockwise gather) and its group is unusable after
    # trying one: those cases are not run there
    cases = [c for c in CASES if backend == "nccl" or not c.endswith("block/sp")]
    args = ["--out", out, "--cases", ",".join(cases), "--backend", backend]
    proc = torchrun(ROOT / "examples" / "tensor_parallel.py", 2, args, timeout=1200)
    path = out / "tensor-parallel.json"
    assert path.exists(), proc.stderr[-3000:]
    dest = os.environ.get("OUT")
    if dest:
        (Path(dest) / path.name).write_bytes(path.read_bytes())
    return json.loads(path.read_text())


def _result(run, case):
    if case.endswith("block/sp") and run.get("backend") == "gloo":
        pytest.skip("TE's blockwise FP8 all-gather coalesces collectives, which gloo lacks")
    return run[case]


@pytest.mark.parametrize("case", CASES)
def test_compiled_equals_eager_te_bit_for_bit(run, case):
    r = _result(run, case)
    assert "error" not in r, r.get("error")
    assert r["losses_equal"] and r["params_equal"], (r["max_diff"], r)
    c = r["compiled"]
    assert c["graphs"] == 1 + TE_FUSION_GRAPHS.get(case, 0) and c["breaks"] == 0, c
    assert c["losses"][-1] < 0.9 * c["losses"][0], "did not learn"


@pytest.mark.parametrize("mode", ["tp", "sp", "layer:tp", "layer:sp"])
def test_delayed_state_equal_to_eager_and_across_ranks(run, mode):
    kind, _, mode = mode.rpartition(":")
    r = run[f"{kind + ':' if kind else ''}delayed/{mode}"]
    assert "error" not in r, r.get("error")
    assert r["n_histories"] > 0 and r["histories_equal"], r
    assert r["histories_equal_across_ranks"], r


@pytest.mark.parametrize("case", [c for c in CASES if "none/" not in c])
def test_fp8_really_quantized(run, case):
    """FP8 losses differ from the bf16 run's of the same mode (the same data and weights)."""
    kind, _, rest = case.rpartition(":")
    bf16 = run[f"{kind}{':' if kind else ''}none/{rest.split('/')[1]}"]["eager"]["losses"]
    assert _result(run, case)["eager"]["losses"] != bf16
