"""Recipes constructed inside compiled code (te_compile/inline_recipes.py), traced under
te_compile.simulate_gpu: 0 graph breaks, no recompile across steps, the same graph as a recipe
built outside, and TE's own constructor (validation included) when not compiling."""

from __future__ import annotations

import pydantic
import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile_testing import JointRecorder

POWER_2 = R.QParams(power_2_scale=True, amax_epsilon=0.0)  # recipe pieces: built outside
INLINE = {
    "delayed": lambda: R.DelayedScaling(margin=1, amax_history_len=16),
    "current": lambda: R.Float8CurrentScaling(),
    "block": lambda: R.Float8BlockScaling(),
    "current_qparams": lambda: R.Float8CurrentScaling(fp8_quant_fwd_inp=POWER_2),
    # QParams/MMParams built inside compiled code too
    "current_qparams_inline": lambda: R.Float8CurrentScaling(
        fp8_quant_fwd_inp=R.QParams(power_2_scale=True, amax_epsilon=0.0),
        fp8_gemm_fprop=R.MMParams(use_split_accumulator=True),  # not the default: acc=1
    ),
    # __post_init__ sets more than the fields (fp4_quant_* QParams): copied too
    "nvfp4": lambda: R.NVFP4BlockScaling(),
}
ARCH = {"nvfp4": "blackwell"}


@pytest.fixture
def counters():
    from torch._dynamo.utils import counters

    counters.clear()
    return counters


def _graph_strings(graphs) -> list[str]:
    """The string arguments of every call in the graphs (te_compile ops' recipe configs)."""
    return [a for gm in graphs for n in gm.graph.nodes for a in n.args if isinstance(a, str)]


def _train(recipe_factory, steps: int, arch: str = "hopper"):
    """`steps` compiled fwd+bwd steps of a te.Linear whose forward builds its recipe inline."""
    with te_compile.simulate_gpu(arch):
        model = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        rec = JointRecorder()

        def step(x):
            with te.autocast(recipe=recipe_factory()):
                return model(x)

        compiled = torch.compile(step, backend=rec.backend, fullgraph=True)
        for _ in range(steps):
            compiled(x).sum().backward()
    return model, rec


@pytest.mark.parametrize("name", list(INLINE))
def test_inline_recipe_traces_once(name, patched, counters):
    model, rec = _train(INLINE[name], steps=3, arch=ARCH.get(name, "hopper"))
    assert sum(counters["graph_break"].values()) == 0
    assert len(rec.fw) == 1 and len(rec.bw) == 1, "a recompile across steps"
    assert "te_compile.linear_fwd.default" in rec.targets(rec.fw)
    if name == "delayed":
        # the inline recipe's arguments reached TE's state: a 16-step amax history
        assert model.fp8_meta["scaling_fwd"].amax_history.shape[0] == 16


@pytest.mark.parametrize("name", list(INLINE))
def test_inline_recipe_same_graph_as_outside(name, patched):
    arch = ARCH.get(name, "hopper")
    _, inline = _train(INLINE[name], steps=1, arch=arch)
    built = INLINE[name]()  # built eagerly, outside compiled code
    _, outside = _train(lambda: built, steps=1, arch=arch)
    assert _graph_strings(inline.fw) == _graph_strings(outside.fw)
    assert _graph_strings(inline.bw) == _graph_strings(outside.bw)
    kinds = ("current", "delayed", "block", "nvfp4")
    assert any(k in s for k in kinds for s in _graph_strings(inline.fw))


def test_validation_error_at_trace_time(patched):
    def bad():
        return R.Float8CurrentScaling(fp8_format=R.Format.E5M2)

    with pytest.raises(Exception, match="Pure E5M2 training is not supported"):
        _train(bad, steps=1)


def test_eager_construction_stays_te(patched):
    # pydantic's own validation error, and equality by value, as in TE
    with pytest.raises(pydantic.ValidationError):
        R.DelayedScaling(amax_history_len="not a number")
    assert R.DelayedScaling(margin=2) == R.DelayedScaling(margin=2)
    assert R.DelayedScaling(margin=2).margin == 2


def test_unpatch_restores_pydantic_marker():
    te_compile.patch()
    assert "__is_pydantic_dataclass__" not in vars(R.DelayedScaling)
    te_compile.unpatch()
    assert "__is_pydantic_dataclass__" in vars(R.DelayedScaling)
    assert "__wrapped__" not in vars(vars(R.DelayedScaling)["__init__"])


def test_without_patch_inline_recipe_breaks(counters):
    """The check that proves these tests can fail: TE alone graph-breaks on the constructor."""
    with pytest.raises(Exception, match="[Pp]ydantic"):
        _train(INLINE["current"], steps=1)
