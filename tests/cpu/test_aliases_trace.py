"""TE's deprecated aliases `te.fp8_autocast` and `te.fp8_model_init` (te_compile/aliases.py):
traced like `te.autocast` / `te.quantized_model_init` while compiling, TE's own (deprecation
warning included) when not, and restored by `unpatch()`. Traced on CPU with a pretend GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import compile_fullgraph
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

import te_compile
from te_compile_testing import JointRecorder

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing"),
    pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered:UserWarning"),
]

with warnings.catch_warnings():  # TE's deprecated module, imported before any patch() (the
    warnings.simplefilter("ignore", DeprecationWarning)  # Patcher swaps re-exports it finds)
    from transformer_engine.pytorch import fp8 as te_fp8

FGS = q.FP8GlobalStateManager
RECIPES = {"delayed": R.DelayedScaling, "current": R.Float8CurrentScaling}
X = torch.zeros(4)


def _aliases():
    return {
        "q.fp8_autocast": q.fp8_autocast,
        "te.fp8_autocast": te.fp8_autocast,
        "fp8.fp8_autocast": te_fp8.fp8_autocast,
        "q.fp8_model_init": q.fp8_model_init,
        "te.fp8_model_init": te.fp8_model_init,
        "fp8.fp8_model_init": te_fp8.fp8_model_init,
    }


def trace_linear(use_alias: bool, recipe_name: str) -> JointRecorder:
    """A te.Linear forward + backward compiled with its FP8 context inside the function."""
    recorder = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        torch.manual_seed(0)
        layer = te.Linear(64, 64, params_dtype=torch.bfloat16)
        recipe = RECIPES[recipe_name]()

        def fn(x):
            if use_alias:
                with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                    return layer(x)
            with te.autocast(enabled=True, recipe=recipe):
                return layer(x)

        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        compiled = torch.compile(fn, backend=recorder.backend, fullgraph=True)
        for _ in range(2):
            compiled(x).sum().backward()
    return recorder


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_fp8_autocast_gives_te_autocast_graph(recipe_name, patched, graph_breaks):
    alias = trace_linear(True, recipe_name)
    assert graph_breaks() == 0
    assert (len(alias.fw), len(alias.bw)) == (1, 1), "one forward + one backward graph"
    torch._dynamo.reset()
    FGS.reset()
    plain = trace_linear(False, recipe_name)
    assert [g.code for g in alias.fw] == [g.code for g in plain.fw]
    assert [g.code for g in alias.bw] == [g.code for g in plain.bw]
    assert any("linear_fwd" in t for t in alias.targets(alias.fw)), "no te_compile GEMM op"


def test_fp8_autocast_without_a_recipe_and_disabled(patched, fake_gpu, backend, graph_breaks):
    """fp8_recipe=None resolves TE's default (DelayedScaling on Hopper); enabled=False too."""
    fake_gpu("hopper")

    def fn(x):
        with te.fp8_autocast():
            on = (
                x
                + float(FGS.is_fp8_enabled())
                + 10 * isinstance(FGS.get_fp8_recipe(), R.DelayedScaling)
            )
        with te.fp8_autocast(enabled=False):
            off = x + float(FGS.is_fp8_enabled())
        return on, off

    on, off = compile_fullgraph(fn, backend)(X)
    assert graph_breaks() == 0 and len(backend.graphs) == 1
    assert on[0].item() == 11 and off[0].item() == 0
    assert FGS.quantization_state.autocast_depth == 0


def test_fp8_model_init_traces(patched, fake_gpu, backend, graph_breaks):
    fake_gpu("hopper")

    def fn(x):
        with te.fp8_model_init(enabled=False):
            return x + float(FGS.with_fp8_parameters())

    assert compile_fullgraph(fn, backend)(X)[0].item() == 0
    assert graph_breaks() == 0 and len(backend.graphs) == 1


@pytest.mark.parametrize("alias", ["fp8_autocast", "fp8_model_init"])
def test_unpatched_alias_breaks_on_its_warning(alias, fake_gpu, backend):
    """Why the twins exist: TE's own aliases call warnings.warn, which dynamo cannot trace."""
    fake_gpu("hopper")
    fn = getattr(te, alias)

    def traced(x):
        with fn(enabled=False):
            return x + 1

    with pytest.raises(Exception, match=r"warnings\.warn"):
        compile_fullgraph(traced, backend)(X)


def test_eager_fp8_autocast_is_te_own_with_its_warning(patched):
    """Not compiling, the twin calls TE's function: the same DeprecationWarning, attributed to
    the caller's line as TE's stacklevel=2 attributes it, and a te.autocast object back."""
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated") as caught:
        ctx = te.fp8_autocast(enabled=False)
    assert isinstance(ctx, te.autocast)
    assert {w.filename for w in caught} == {__file__}, [w.filename for w in caught]
    with te_compile.simulate_gpu("hopper"):
        with ctx:
            assert not FGS.is_fp8_enabled()
        with pytest.warns(DeprecationWarning, match="fp8_model_init is deprecated"):
            with te.fp8_model_init(enabled=False):
                assert not FGS.with_fp8_parameters()


def test_eager_fp8_autocast_warning_follows_the_filters(patched):
    """The re-issued warning goes through the caller's filters like TE's: ignored when the
    caller ignores it, an error when the caller asks for errors."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore", DeprecationWarning)
        te.fp8_autocast(enabled=False)
    assert not caught
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(DeprecationWarning):
            te.fp8_autocast(enabled=False)


def test_patch_swaps_every_alias_and_unpatch_restores_them():
    before = _aliases()
    te_compile.patch()
    try:
        during = _aliases()
        assert all(during[k] is not before[k] for k in before), during
        assert during["te.fp8_autocast"] is during["q.fp8_autocast"] is during["fp8.fp8_autocast"]
        assert during["te.fp8_model_init"] is during["q.fp8_model_init"]
        assert during["q.fp8_autocast"].__wrapped__ is before["q.fp8_autocast"]
    finally:
        te_compile.unpatch()
    after = _aliases()
    assert all(after[k] is before[k] for k in before), after
