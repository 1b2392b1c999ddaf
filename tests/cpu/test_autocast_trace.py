"""te.autocast under torch.compile(fullgraph=True), traced on CPU with a pretend GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import transformer_engine.pytorch as te
from autocast_cases import RECIPE_CODES, in_autocast, state_code
from conftest import RECIPE_GENERATION, compile_fullgraph, recipe_instances
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

FGS = q.FP8GlobalStateManager


def check_one_graph(fn, backend, graph_breaks, x):
    compiled = compile_fullgraph(fn, backend)
    got = compiled(x)
    assert len(backend.graphs) == 1
    assert graph_breaks() == 0
    return got


X = torch.zeros(4)


@pytest.mark.parametrize("name", list(RECIPE_GENERATION))
def test_every_recipe_traces_inside(name, patched, fake_gpu, backend, graph_breaks):
    fake_gpu(RECIPE_GENERATION[name])
    recipe = recipe_instances()[name]
    fn = in_autocast(recipe=recipe)
    inside, after = check_one_graph(fn, backend, graph_breaks, X)
    assert inside[0].item() == 10 + RECIPE_CODES[type(recipe)]
    eager_inside, eager_after = fn(X)
    assert torch.equal(inside, eager_inside) and torch.equal(after, eager_after)
    assert FGS.quantization_state.autocast_depth == 0
    assert not FGS.is_fp8_enabled()


@pytest.mark.parametrize("name", list(RECIPE_GENERATION))
def test_every_recipe_autocast_outside(name, patched, fake_gpu, backend, graph_breaks):
    fake_gpu(RECIPE_GENERATION[name])
    recipe = recipe_instances()[name]
    compiled = compile_fullgraph(lambda x: x + state_code(), backend)
    with te.autocast(recipe=recipe):
        got = compiled(X)
        want = X + state_code()
    assert torch.equal(got, want) and got[0].item() == 10 + RECIPE_CODES[type(recipe)]
    assert len(backend.graphs) == 1 and graph_breaks() == 0


@pytest.mark.parametrize(
    "generation,expected", [("hopper", R.DelayedScaling), ("blackwell", R.MXFP8BlockScaling)]
)
def test_recipe_none_resolves_default_without_hardware_queries(
    generation, expected, patched, fake_gpu, backend, graph_breaks, monkeypatch
):
    fake_gpu(generation)
    fn = in_autocast(recipe=None)
    inside, _ = check_one_graph(fn, backend, graph_breaks, X)
    assert inside[0].item() == 10 + RECIPE_CODES[expected]
    # Nothing but the additions reached the graph: no device query was traced.
    assert all(t in ("<built-in function add>",) for t in backend.targets()), backend.targets()


def test_recipe_none_fails_without_patch(fake_gpu, backend):
    fake_gpu("hopper")
    with pytest.raises(Exception, match="Creating Recipe objects inside compiled regions"):
        compile_fullgraph(in_autocast(recipe=None), backend)(X)


def test_delayed_scaling_fails_without_patch(fake_gpu, backend):
    """The check that proves these tests can fail: vanilla TE rejects DelayedScaling."""
    fake_gpu("hopper")
    with pytest.raises(Exception, match="DelayedScaling is not supported under torch.compile"):
        compile_fullgraph(in_autocast(recipe=R.DelayedScaling()), backend)(X)


def test_enabled_false_and_calibrating(patched, fake_gpu, backend, graph_breaks):
    fake_gpu("hopper")
    delayed = R.DelayedScaling()

    def fn(x):
        with te.autocast(enabled=False, recipe=delayed):
            off = x + state_code()
        with te.autocast(enabled=False, calibrating=True, recipe=delayed):
            calib = x + state_code()
        return off, calib

    off, calib = check_one_graph(fn, backend, graph_breaks, X)
    assert off[0].item() == 1 and calib[0].item() == 101
    eager = fn(X)
    assert torch.equal(off, eager[0]) and torch.equal(calib, eager[1])


def test_nested_autocasts_restore_outer(patched, fake_gpu, backend, graph_breaks):
    fake_gpu("hopper")
    delayed, current = R.DelayedScaling(), R.Float8CurrentScaling()

    def fn(x):
        with te.autocast(recipe=delayed):
            a = x + state_code()
            with te.autocast(recipe=current):
                b = x + state_code()
                with te.autocast(enabled=False):
                    c = x + state_code()
                d = x + state_code()
            e = x + state_code()
        return torch.stack([a, b, c, d, e])

    got = check_one_graph(fn, backend, graph_breaks, X)
    assert got[:, 0].tolist() == [11, 12, 1, 12, 11]
    assert torch.equal(got, fn(X))
    assert FGS.quantization_state.autocast_depth == 0


def test_reset_does_not_recompile(patched, fake_gpu, backend):
    fake_gpu("hopper")
    compiled = compile_fullgraph(in_autocast(recipe=R.DelayedScaling()), backend)
    first = compiled(X)
    FGS.reset()
    second = compiled(X)
    assert len(backend.graphs) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_changing_recipe_outside_costs_one_recompile(patched, fake_gpu, backend):
    fake_gpu("hopper")
    compiled = compile_fullgraph(lambda x: x + state_code(), backend)
    for recipe in [R.DelayedScaling(), R.DelayedScaling(), R.Float8CurrentScaling()]:
        with te.autocast(recipe=recipe):
            compiled(X)
    assert len(backend.graphs) == 2


def test_autocast_arguments_stay_bounded(patched, fake_gpu, backend):
    fake_gpu("hopper")
    recipe = R.DelayedScaling()
    compiled = compile_fullgraph(in_autocast(recipe=recipe), backend)
    for _ in range(10_000):
        compiled(X)
    for _ in range(10_000):  # eager entries with fresh, equal recipes: TE's own path
        with te.autocast(recipe=R.DelayedScaling()):
            pass
    assert len(FGS.quantization_state.autocast_arguments) <= 1
    assert len(backend.graphs) == 1


def test_unsupported_recipe_names_te_reason(patched, fake_gpu, backend):
    fake_gpu("hopper")
    with pytest.raises(RuntimeError) as info:
        compile_fullgraph(in_autocast(recipe=R.MXFP8BlockScaling()), backend)(X)
    message = str(info.value)
    assert "MXFP8BlockScaling cannot run on this GPU" in message
    assert "compute capability 10.0" in message
    assert type(info.value).__name__ not in ("InternalTorchDynamoError", "AssertionError")


def test_graph_mode_autocast_is_named(patched, fake_gpu, backend):
    fake_gpu("hopper")
    with pytest.raises(RuntimeError, match="_graph=True"):
        compile_fullgraph(in_autocast(recipe=R.Float8CurrentScaling(), _graph=True), backend)(X)


def test_delayed_update_runs_at_outermost_exit(patched, backend):
    """With a module's DelayedScaling state registered, the forward amax/scale update is in the
    graph, once, at the outermost exit, and only with grad enabled (as in eager TE)."""
    import te_compile

    recipe = R.DelayedScaling(amax_history_len=4)
    with te_compile.simulate_gpu("hopper"):
        linear = te.Linear(16, 16, params_dtype=torch.bfloat16).cuda()

        def fn(x):
            with te.autocast(recipe=recipe):
                with te.autocast(recipe=recipe):
                    y = linear(x)
            return y

        x = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        compile_fullgraph(fn, backend)(x)
        assert backend.targets().count("te_compile.amax_and_scale_update") == 1
        torch._dynamo.reset()
        backend.graphs.clear()
        with torch.no_grad():
            compile_fullgraph(fn, backend)(x)
        assert "te_compile.amax_and_scale_update" not in backend.targets()


def test_delayed_update_skips_state_no_compiled_module_owns(patched, backend):
    """State eager TE registered for a module the compiled path never uses (a stand-in for
    DotProductAttention's after an eager DelayedScaling step) is not updated in the graph: it
    would be a mutated input no compiled module reaches (CUDA graph trees skip such graphs)."""
    import te_compile

    recipe = R.DelayedScaling(amax_history_len=4)
    with te_compile.simulate_gpu("hopper"):
        linear = te.Linear(16, 16, params_dtype=torch.bfloat16).cuda()

        def fn(x):
            with te.autocast(recipe=recipe):
                return linear(x)

        x = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        compile_fullgraph(fn, backend)(x)  # creates and registers the Linear's state
        key = FGS.get_key_in_buffer(True, recipe, None)
        state = FGS.quantization_state
        foreign = torch.zeros(4, 3, device="cuda")
        state.global_amax_buffer[key].append(foreign[0])
        state.global_amax_history_buffer[key].append(foreign)
        state.global_scale_buffer[key].append(torch.ones(3, device="cuda"))
        torch._dynamo.reset()
        backend.graphs.clear()
        compile_fullgraph(fn, backend)(x)
    (update,) = [
        n
        for gm in backend.graphs
        for n in gm.graph.nodes
        if "amax_and_scale_update" in str(n.target)
    ]
    histories = update.args[0] if update.args else update.kwargs["amax_histories"]
    assert len(histories) == 1, histories


def test_no_assert_control_flow_under_python_O():
    """Support checks must raise under `python -O` too (asserts are stripped there).

    torch 2.11's dynamo cannot trace any plain `if` under -O (its assert rewrite looks for the
    bytecode `assert` leaves, which -O removed, and raises StopIteration; torch 2.14 skips it
    under -O): the script turns that rewrite off, which -O makes moot anyway."""
    script = textwrap.dedent(
        """
        import sys, torch
        import torch._dynamo.config as dynamo_config
        dynamo_config.rewrite_assert_with_torch_assert = False
        from te_compile_testing import GENERATIONS
        from transformer_engine.pytorch import quantization as q, utils
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as R
        import te_compile
        cc, answers = GENERATIONS["hopper"]
        for k, v in answers.items():
            setattr(q, k, v)
        q.get_device_compute_capability = utils.get_device_compute_capability = lambda: cc
        te_compile.patch()
        mxfp8 = R.MXFP8BlockScaling()
        def fn(x):
            with te.autocast(recipe=mxfp8):
                return x + 1
        try:
            torch.compile(fn, backend="eager", fullgraph=True)(torch.zeros(1))
        except RuntimeError as e:
            print("RAISED", "compute capability 10.0" in str(e))
        else:
            print("NO ERROR")
        """
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", script], capture_output=True, text=True, check=False
    )
    assert "RAISED True" in out.stdout, out.stdout + out.stderr
