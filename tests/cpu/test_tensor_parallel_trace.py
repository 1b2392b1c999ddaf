"""Tensor and sequence parallelism under torch.compile, traced on CPUs: 2 gloo processes, fake
CUDA tensors (te_compile.simulate_gpu), tp_group = the 2 ranks, fullgraph: a Megatron MLP of
two te.Linear (fc1 column-parallel, GELU, fc2 row-parallel, biases), the same with a
te.LayerNormLinear first, a te.LayerNormMLP and a te.TransformerLayer (set_parallel_mode).

Per rank and case (module x recipe x sequence_parallel): one forward and one backward graph,
no break; each GEMM op carries its ParallelSpec (mode, sequence parallelism, the group's name,
resolvable in that process); the fake shapes are TE's: under sequence parallelism the
column-parallel GEMM's output has the whole sequence, the step's output and input gradient
the local shard. The communication's numerics: tests/gpu/test_tensor_parallel_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from test_distributed_trace import WORLD, _spawn

H, FFN, SEQ, BATCH = 64, 128, 32, 2
RECIPES = ["none", "current", "delayed", "block"]


KINDS = ["linear", "layernorm_linear", "layernorm_mlp", "transformer_layer"]
GEMM_OPS = {"linear_fwd", "linear_bwd", "layernorm_linear_fwd", "layernorm_linear_bwd"}
GEMM_OPS |= {"layernorm_mlp_fwd", "layernorm_mlp_bwd"}


def _make(te, kind, group, sp):
    """A tensor-parallel block of `kind` on the 2 ranks; forward(x) -> (an inner shape, y)."""
    kw = dict(params_dtype=torch.bfloat16, tp_group=group, tp_size=WORLD, device="cuda")
    kw.update(sequence_parallel=sp)
    if kind == "transformer_layer":
        layer = te.TransformerLayer(H, FFN, 4, set_parallel_mode=True, hidden_dropout=0.0, **kw)
        layer.attention_dropout = 0.0
        return lambda x: (x.shape, layer(x))
    if kind == "layernorm_mlp":
        mlp = te.LayerNormMLP(H, FFN, set_parallel_mode=True, **kw)
        return lambda x: (x.shape, mlp(x))
    first = te.LayerNormLinear if kind == "layernorm_linear" else te.Linear
    fc1 = first(H, FFN, parallel_mode="column", **kw)
    fc2 = te.Linear(FFN, H, parallel_mode="row", **kw)

    def forward(x):
        h = fc1(x)
        return h.shape, fc2(torch.nn.functional.gelu(h, approximate="tanh"))

    return forward


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
    for kind in KINDS:
        for name, recipe in recipes.items():
            for sp in (False, True):
                torch.compiler.reset()
                counters.clear()
                FGS.reset()
                with te_compile.simulate_gpu("hopper"):
                    block = _make(te, kind, group, sp)
                    rows = SEQ // WORLD if sp else SEQ
                    x = torch.randn(rows, BATCH, H, device="cuda", dtype=torch.bfloat16)
                    x.requires_grad_()

                    def step(x, block=block, recipe=recipe):
                        fp8 = recipe is not None
                        with te.autocast(enabled=fp8, recipe=recipe, amax_reduction_group=group):
                            return block(x)

                    rec = JointRecorder()
                    inner_shape, y = torch.compile(step, backend=rec.backend, fullgraph=True)(x)
                    y.sum().backward()
                specs = [
                    ParallelSpec.from_key(key) if key else None
                    for op, node in te_op_nodes(rec.fw + rec.bw)
                    if op in GEMM_OPS
                    for key in [op_args(node)["parallel"]]
                ]
                out[f"{kind}/{name}/{'sp' if sp else 'tp'}"] = {
                    "graphs": (len(rec.fw), len(rec.bw)),
                    "breaks": sum(counters["graph_break"].values()),
                    "specs": sorted({(s.mode, s.sequence, s.size) if s else None for s in specs}),
                    "resolvable": all(
                        s.group == process_groups.WORLD or s.group in process_groups._GROUPS
                        for s in specs
                        if s
                    ),
                    "groups": sorted({s.group for s in specs if s}),
                    "group_name": group.group_name,
                    "inner": list(inner_shape),
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
@pytest.mark.parametrize("kind", KINDS)
def test_tp_traces_whole_with_specs(traces, rank, kind, recipe, sp):
    result = traces[rank]
    assert "error" not in result, result.get("error")
    case = result[f"{kind}/{recipe}/{'sp' if sp else 'tp'}"]
    assert case["graphs"] == (1, 1) and case["breaks"] == 0
    # every GEMM op communicates: column (LayerNormMLP: FC1 column, FC2 its row partner)
    want = [("column", sp, WORLD)]
    if kind in ("linear", "layernorm_linear", "transformer_layer"):
        want.append(("row", sp, WORLD))
    assert case["specs"] == sorted(want), case["specs"]
    assert case["groups"] == [case["group_name"]] and case["resolvable"]
    rows = SEQ // WORLD if sp else SEQ
    if kind in ("linear", "layernorm_linear"):  # the column-parallel GEMM's output
        assert case["inner"] == [SEQ, BATCH, FFN // WORLD]
    assert case["y"] == [rows, BATCH, H] and case["x_grad"] == [rows, BATCH, H]


def test_parallel_spec_round_trips_and_gives_tes_shapes():
    """The key an op carries decodes to the same spec; first dimensions follow TE's gathers
    (column, sequence parallel: forward output x size, dgrad / size) and reductions (row:
    the reverse); without sequence parallelism they do not change."""
    from te_compile.kernels.tensor_parallel import decode_pair
    from te_compile.spec import ParallelSpec

    column = ParallelSpec(mode="column", sequence=True, group="7", size=2)
    assert ParallelSpec.from_key(column.key) == column
    assert column.leading(8, forward=True) == 16 and column.leading(16, forward=False) == 8
    fc1, fc2 = decode_pair(column.key)
    assert fc1 == column and (fc2.mode, fc2.group, fc2.size) == ("row", "7", 2)
    assert fc2.leading(16, forward=True) == 8 and fc2.leading(8, forward=False) == 16
    assert column.gathers_input and fc2.gathers_grad and not fc2.gathers_input
    plain = ParallelSpec(mode="row", sequence=False, group="7", size=2)
    assert plain.leading(8, forward=True) == 8 and not plain.gathers_grad
    assert decode_pair("") == (None, None)
