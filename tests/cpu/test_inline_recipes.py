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

# What each recipe's config must say (a field the recipe was given inline reached the op).
INLINE = {
    "delayed": (lambda: R.DelayedScaling(margin=1, amax_history_len=16), "margin=1"),
    "current": (lambda: R.Float8CurrentScaling(), "kind=current"),
    "block": (lambda: R.Float8BlockScaling(), "kind=block"),
    # an MMParams built inside compiled code too; not the default (acc=0,1,1)
    "current_mmparams_inline": (
        lambda: R.Float8CurrentScaling(fp8_gemm_fprop=R.MMParams(use_split_accumulator=True)),
        "acc=1,1,1",
    ),
    # __post_init__ sets more than the fields (fp4_quant_* QParams): copied too
    "nvfp4": (lambda: R.NVFP4BlockScaling(), "kind=nvfp4"),
}
# QParams are no constructor fields in TE 2.20 (Float8CurrentScaling(fp8_quant_fwd_inp=...) is
# dropped by pydantic, eagerly too): a QParams case could only show that it is dropped.
ARCH = {"nvfp4": "blackwell"}


@pytest.fixture
def counters():
    from torch._dynamo.utils import counters

    counters.clear()
    return counters


def _graph_strings(graphs) -> list[str]:
    """The string arguments of every call in the graphs (te_compile ops' recipe configs)."""
    calls = [(*n.args, *n.kwargs.values()) for gm in graphs for n in gm.graph.nodes]
    return [a for args in calls for a in args if isinstance(a, str)]


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
    model, rec = _train(INLINE[name][0], steps=3, arch=ARCH.get(name, "hopper"))
    assert sum(counters["graph_break"].values()) == 0
    assert len(rec.fw) == 1 and len(rec.bw) == 1, "a recompile across steps"
    assert "te_compile.linear_fwd.default" in rec.targets(rec.fw)
    if name == "delayed":
        # the inline recipe's arguments reached TE's state: a 16-step amax history
        assert model.fp8_meta["scaling_fwd"].amax_history.shape[0] == 16


@pytest.mark.parametrize("name", list(INLINE))
def test_inline_recipe_same_graph_as_outside(name, patched):
    arch = ARCH.get(name, "hopper")
    make, expected = INLINE[name]
    _, inline = _train(make, steps=1, arch=arch)
    built = make()  # built eagerly, outside compiled code
    _, outside = _train(lambda: built, steps=1, arch=arch)
    fw, bw = _graph_strings(inline.fw), _graph_strings(inline.bw)
    assert fw == _graph_strings(outside.fw) and bw == _graph_strings(outside.bw)
    assert any(expected in s for s in fw) and any(expected in s for s in bw), (expected, fw, bw)


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
        _train(INLINE["current"][0], steps=1)
