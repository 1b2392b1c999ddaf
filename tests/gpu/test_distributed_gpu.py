"""2-GPU suite: examples/distributed_gpt.py under torchrun (DDP, FSDP2 compiled per block and
FSDP2 with the whole model compiled x DelayedScaling with amax reduction, Float8CurrentScaling
and Float8BlockScaling, compiled vs eager; FSDP2 per block with FP8 primary weights
(te.quantized_model_init), all-gathered in FP8; DelayedScaling state across ranks; checkpoint
resume), then its checks read back from the JSON it writes. Skips without 2 CUDA GPUs.
Run: `python3 -m pytest tests/gpu -k distributed`; or check the JSON of a run launched by hand
(a long run under a time limit): TE_COMPILE_DISTRIBUTED_JSON=path/distributed-gpt.json.
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
CASES = ["ddp/delayed", "ddp/current", "ddp/block", "fsdp2/delayed", "fsdp2/current"]
CASES += ["fsdp2/block", "fsdp2-whole/delayed", "fsdp2-whole/current"]
# FSDP2 per block, FP8 primary weights: recipe -> the type of TE's FP8 parameter shards.
FP8_PARAM_TYPES = {
    "fsdp2-fp8/delayed": "Float8Tensor",
    "fsdp2-fp8/current": "Float8Tensor",
    "fsdp2-fp8/block": "Float8BlockwiseQTensor",
}
CASES += list(FP8_PARAM_TYPES)
# Compiled, refused by name: FSDP2 gathers block-scaled FP8 weights row-wise only for forward
# (TE's fsdp_pre_all_gather), and the compiled path needs both halves (docs/distributed.md).
REFUSED_COMPILED = {"fsdp2-fp8/block": "FP8 block-scaled parameter without both row-wise"}
FP8_WEIGHTS = 2 * 4  # per TransformerLayer: fused QKV, attention projection, fc1, fc2
# FSDP2 with bf16 weights and DelayedScaling: compiled against eager DDP (ddp/delayed runs first).
# Eager TE's FSDP2 backward quantizes the weight for dgrad with the scale the autocast exit has
# updated; compiled code keeps TE's arithmetic without FSDP2 (docs/distributed.md).
DDP_REFERENCE = {"fsdp2/delayed", "fsdp2-whole/delayed"}
LOSS_BOUND = 0.25  # max |compiled - eager| over 50 steps (inductor's fusion, amplified)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    given = os.environ.get("TE_COMPILE_DISTRIBUTED_JSON")
    if given:  # the JSON of a run launched by hand (same --cases, with --resume)
        return json.loads(Path(given).read_text())
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    out = tmp_path_factory.mktemp("distributed")
    args = ["--out", out, "--resume", "--cases", ",".join(CASES)]
    proc = torchrun(ROOT / "examples" / "distributed_gpt.py", 2, args, timeout=1200)
    path = out / "distributed-gpt.json"
    assert path.exists(), proc.stderr[-3000:]
    results = json.loads(path.read_text())
    dest = os.environ.get("OUT")
    if dest:  # keep the JSON and PNG with the GPU logs
        for f in out.iterdir():
            (Path(dest) / f.name).write_bytes(f.read_bytes())
    return results


@pytest.mark.parametrize("case", CASES)
def test_compiled_trains_like_eager(run, case):
    result = run[case]
    if case in REFUSED_COMPILED:
        assert REFUSED_COMPILED[case] in result.get("error", ""), result.get("error")
        return
    assert "error" not in result, result.get("error")
    eager, compiled = result["eager"]["losses"], result["compiled"]["losses"]
    assert compiled[-1] < compiled[0] - 1.0, "compiled run did not learn"
    diff = result["max_diff_vs_ddp_eager" if case in DDP_REFERENCE else "max_diff"]
    assert diff < LOSS_BOUND, diff
    print(case, "eager", eager[-1], "compiled", compiled[-1], "max diff", diff)


@pytest.mark.parametrize("case", list(FP8_PARAM_TYPES))
def test_fsdp2_gathers_fp8_weights_in_fp8(run, case):
    """FP8 primary weights under FSDP2, eager and compiled: the sharded GEMM weights are TE
    QuantizedTensors, FSDP2 hands the modules unsharded QuantizedTensors, and what TE's
    fsdp_pre_all_gather gives FSDP2 to all-gather (counted by the example on rank 0) is the
    FP8 data, one byte per element (uint8; block scaling adds its float32 scales): about half
    of what the same weights would gather in bf16, on every step. The eager run is checked
    first: the example keeps it when the compiled run fails."""
    result = run[case]
    quantized = FP8_PARAM_TYPES[case]
    dtypes = {"uint8", "float32"} if quantized == "Float8BlockwiseQTensor" else {"uint8"}
    for mode in ("eager",) if case in REFUSED_COMPILED else ("eager", "compiled"):
        assert mode in result, result.get("error")
        gathered = result[mode]["fp8_allgather"]
        print(case, mode, gathered)
        assert "fsdp2_state_error" not in gathered, gathered["fsdp2_state_error"]
        n = len(gathered["fp8_params"])
        assert n == FP8_WEIGHTS, gathered["fp8_params"]
        assert gathered["sharded_types"].get(quantized) == n, gathered["sharded_types"]
        assert gathered["unsharded_types"].get(quantized) == n, gathered["unsharded_types"]
        assert gathered["pre_all_gather_calls"] >= gathered["steps"] * n
        by_dtype = gathered["input_bytes"]
        assert set(by_dtype) == dtypes, by_dtype
        assert 2 * by_dtype.get("uint8", 0) == gathered["param_dtype_bytes"], by_dtype
        assert sum(by_dtype.values()) < 0.55 * gathered["param_dtype_bytes"], by_dtype
        assert gathered["all_gather_output_dtypes"].get("uint8") == n, gathered


def test_delayed_state_reduced_and_equal_to_eager(run):
    state = run["delayed_state"]
    assert "error" not in state, state.get("error")
    assert state["equal_across_ranks"], state
    assert state["equal_to_eager"], state


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_checkpoint_resume_matches_uninterrupted(run, wrapper):
    """DelayedScaling, compiled: a torch.distributed.checkpoint save at step 5 loaded into a
    fresh compiled model; steps 6-10 and the final DelayedScaling state equal the uninterrupted
    run's (TE's deterministic attention backward)."""
    resume = run["resume"]
    assert "error" not in resume, resume.get("error")
    assert resume[wrapper]["losses_equal"], resume[wrapper]
    assert resume[wrapper]["fp8_state_equal"], resume[wrapper]
