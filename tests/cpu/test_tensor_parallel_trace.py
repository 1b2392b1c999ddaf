"""Tensor and sequence parallelism of te.Linear under torch.compile, traced on CPUs: 2 gloo
processes, fake CUDA tensors (te_compile.simulate_gpu), a Megatron MLP (fc1 column-parallel,
GELU, fc2 row-parallel, biases) with tp_group = the 2 ranks, fullgraph.

Per rank and case (recipe x sequence_parallel): one forward and one backward graph, no break;
each GEMM op carries its ParallelSpec (mode, sequence parallelism, the group's name, resolvable
in that process); the fake shapes are TE's: under sequence parallelism fc1's output has the
whole sequence and the step's output and input gradient the local shard. The communication's
numerics run on 2 GPUs (tests/gpu/test_tensor_parallel_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from test_distributed_trace import WORLD, _spawn

H, FFN, SEQ, BATCH = 64, 128, 32, 2
RECIPES = ["none", "current", "delayed", "block"]


def _make_mlp(te, group, sequence_parallel):
    kw = dict(params_dtype=torch.bfloat16, tp_group=group, tp_size=WORLD)
    kw.update(sequence_parallel=sequence_parallel, device="cuda")
    fc1 = te.Linear(H, FFN, parallel_mode="column", **kw)
    fc2 = te.Linear(FFN, H, parallel_mode="row", **kw)
    return fc1, fc2


def _traces(dist) -> dict:
    import transformer_engine.pytorch as te
    from torch._dynamo.utils import counters
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS

    import te_compile
    from te_compile.kernels import process_groups
    from te_compile.spec import ParallelSpec
    from te_compile_testing import JointRecorder, op_args, te_op_nodes

    te_compile.patch()
    group = dist.new_group(list(range(WORLD)))
    recipes = {
        "none": None,
        "current": R.Float8CurrentScaling(),
        "delayed": R.DelayedScaling(reduce_amax=True),
        "block": R.Float8BlockScaling(),
    }
    out = {}
    for name, recipe in recipes.items():
        for sp in (False, True):
            torch.compiler.reset()
            counters.clear()
            FGS.reset()
            with te_compile.simulate_gpu("hopper"):
                fc1, fc2 = _make_mlp(te, group, sp)
                rows = SEQ // WORLD if sp else SEQ
                x = torch.randn(rows, BATCH, H, device="cuda", dtype=torch.bfloat16)
                x.requires_grad_()

                def step(x, fc1=fc1, fc2=fc2, recipe=recipe):
                    fp8 = recipe is not None
                    with te.autocast(enabled=fp8, recipe=recipe, amax_reduction_group=group):
                        h = fc1(x)
                        return h.shape, fc2(torch.nn.functional.gelu(h, approximate="tanh"))

                rec = JointRecorder()
                fc1_shape, y = torch.compile(step, backend=rec.backend, fullgraph=True)(x)
                y.sum().backward()
            specs = [
                ParallelSpec.from_key(key) if key else None
                for op, node in te_op_nodes(rec.fw + rec.bw)
                if op in ("linear_fwd", "linear_bwd")
                for key in [op_args(node)["parallel"]]
            ]
            out[f"{name}/{'sp' if sp else 'tp'}"] = {
                "graphs": (len(rec.fw), len(rec.bw)),
                "breaks": sum(counters["graph_break"].values()),
                "specs": [(s.mode, s.sequence, s.size) if s else None for s in specs],
                "resolvable": all(
                    s.group == process_groups.WORLD or s.group in process_groups._GROUPS
                    for s in specs
                    if s
                ),
                "groups": sorted({s.group for s in specs if s}),
                "group_name": group.group_name,
                "fc1_out": list(fc1_shape),
                "y": list(y.shape),
                "x_grad": list(x.grad.shape),
            }
    return out


@pytest.fixture(scope="module")
def traces():
    return _spawn(_traces)


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_tp_traces_whole_with_specs(traces, rank, recipe, sp):
    result = traces[rank]
    assert "error" not in result, result.get("error")
    case = result[f"{recipe}/{'sp' if sp else 'tp'}"]
    assert case["graphs"] == (1, 1) and case["breaks"] == 0
    assert set(case["specs"]) == {("column", sp, WORLD), ("row", sp, WORLD)}, case["specs"]
    assert case["groups"] == [case["group_name"]] and case["resolvable"]
    rows = SEQ // WORLD if sp else SEQ
    assert case["fc1_out"] == [SEQ, BATCH, FFN // WORLD]
    assert case["y"] == [rows, BATCH, H] and case["x_grad"] == [rows, BATCH, H]
