"""te.Linear with DelayedScaling under torch.compile(fullgraph=True), traced on CPU.

Joint (forward + backward) graphs on meta tensors, TE's recipe state allocated on meta too.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

from te_compile.recipes import QuantConfig
from te_compile_testing import (
    JointRecorder,
    build_without_gpu,
    op_targets,
    recipe_state_on,
)

FGS = q.FP8GlobalStateManager
IN, OUT = 64, 32
FWD, BWD = "te_compile.linear_fwd.default", "te_compile.linear_bwd.default"
UPDATE = "te_compile.amax_and_scale_update.default"


@pytest.fixture
def meta_delayed(patched, fake_gpu):
    fake_gpu("hopper")
    with recipe_state_on("meta"):
        yield


def make_linear(bias=True):
    return build_without_gpu(
        lambda: te.Linear(IN, OUT, bias=bias, params_dtype=torch.bfloat16, device="meta"), "meta"
    )


def x_meta(requires_grad=True):
    return torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=requires_grad)


def step_fn(linear, recipe):
    def step(x):
        with te.autocast(recipe=recipe):
            return linear(x)

    return step


@pytest.mark.parametrize("bias", [True, False])
def test_delayed_joint_graph_uses_te_state(bias, meta_delayed, graph_breaks):
    recipe = R.DelayedScaling(amax_history_len=4)
    linear = make_linear(bias)
    rec = JointRecorder()
    compiled = torch.compile(step_fn(linear, recipe), backend=rec.backend, fullgraph=True)
    compiled(x_meta()).sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    fw, bw = op_targets(rec.fw), op_targets(rec.bw)
    assert fw.count(FWD) == 1 and bw.count(BWD) == 1
    # The forward amax/scale update of the outermost autocast exit is in the forward graph.
    assert fw.count(UPDATE) == 1
    # TE's own state exists, with TE's shapes, and is registered for TE's updates.
    meta = linear.fp8_meta
    assert meta["scaling_fwd"].amax_history.shape == (4, 3)
    assert meta["scaling_bwd"].amax_history.shape == (4, 2)
    key = FGS.get_key_in_buffer(True, recipe, None)
    # (other live te.Linear modules get their state at the same trace: persistent_state.py)
    buffer = FGS.quantization_state.global_amax_history_buffer[key]
    assert any(h is meta["scaling_fwd"].amax_history for h in buffer)
    assert FGS.get_unique_autocast_key(recipe, None) in FGS.quantization_state.autocast_arguments
    # The backward op mutates the backward state (its amax/scale update runs there).
    bwd_node = next(
        n for gm in rec.bw for n in gm.graph.nodes if "auto_functionalized" in str(n.target)
    )
    assert "linear_bwd" in str(bwd_node.args[0])
    # [scale, amax_history], a mutated list (functionalization names its length and bases)
    assert bwd_node.kwargs.get("_bwd_state_length") == 2, bwd_node.kwargs.keys()
    assert QuantConfig.from_key(bwd_node.kwargs["config"]).kind == "delayed"


def train_steps(recipes) -> JointRecorder:
    """One compiled fwd+bwd step per recipe, the autocast inside the compiled function reading
    the step's recipe object (so a new object per step reaches the trace's guards)."""
    linear = make_linear()
    rec = JointRecorder()
    current = {}

    def step(x):
        with te.autocast(recipe=current["recipe"]):
            return linear(x)

    compiled = torch.compile(step, backend=rec.backend, fullgraph=True)
    for recipe in recipes:
        current["recipe"] = recipe
        compiled(x_meta()).sum().backward()
    return rec


def test_delayed_no_recompile_over_steps_and_fresh_recipes(meta_delayed):
    rec = train_steps([R.DelayedScaling(amax_history_len=4) for _ in range(3)])  # equal, fresh
    assert len(rec.fw) == 1 and len(rec.bw) == 1


def test_delayed_no_grad_skips_backward_update(meta_delayed):
    linear = make_linear()
    rec = JointRecorder()
    with torch.no_grad():
        torch.compile(step_fn(linear, R.DelayedScaling()), backend=rec.backend, fullgraph=True)(
            x_meta(False)
        )
    fw = op_targets(rec.fw)
    assert fw.count(FWD) == 1 and UPDATE not in fw  # TE skips the exit update without grad


@pytest.mark.parametrize(
    "kwargs,option",
    [
        (dict(amax_compute_algo=lambda h: h.max()), "callable amax_compute_algo"),
        (dict(scaling_factor_compute_algo=lambda a, s, m, r: s), "scaling_factor_compute_algo"),
    ],
)
def test_delayed_callables_are_refused(kwargs, option, meta_delayed):
    linear = make_linear()
    with pytest.raises(Exception, match=option):
        torch.compile(step_fn(linear, R.DelayedScaling(**kwargs)), backend="eager", fullgraph=True)(
            x_meta()
        )


def test_delayed_format_passed_as_margin_is_named(meta_delayed):
    """DelayedScaling's first positional field is margin: a format passed there is named under
    compile, where eager TE fails later, in its first update, on a float() conversion."""
    linear = make_linear()
    recipe = R.DelayedScaling(R.Format.HYBRID, amax_history_len=16)
    with pytest.raises(Exception, match="margin must be a number.*fp8_format=Format.HYBRID"):
        torch.compile(step_fn(linear, recipe), backend="eager", fullgraph=True)(x_meta())


def test_module_lookup_survives_dead_weak_proxies(meta_delayed):
    """Finding a module by id scans gc objects; a dead weakref proxy among them must not raise."""

    class Referent:
        pass

    referent = Referent()
    proxy = weakref.proxy(referent)
    del referent
    gc.collect()
    linear = make_linear()
    rec = JointRecorder()
    torch.compile(step_fn(linear, R.DelayedScaling()), backend=rec.backend, fullgraph=True)(
        x_meta()
    )
    assert len(rec.fw) == 1 and type(proxy) in weakref.ProxyTypes


def test_unreachable_modules_get_no_state(meta_delayed):
    """A te.Linear that is garbage (a reference cycle not yet collected) when the first trace
    creates DelayedScaling state is not registered in TE's global buffers: the compiled
    autocast exit would update its tensors, which no graph input reaches, and CUDA graph trees
    skip graphs that mutate such inputs (seen on an H100 as "mutated inputs (2 instances)")."""
    gc.disable()  # only the collection under test may free the garbage
    try:
        garbage = make_linear()
        garbage.cycle = garbage
        gone = weakref.ref(garbage)
        del garbage
        recipe = R.DelayedScaling()
        linear = make_linear()
        step = torch.compile(
            step_fn(linear, recipe), backend=JointRecorder().backend, fullgraph=True
        )
        step(x_meta())
    finally:
        gc.enable()
    assert gone() is None
    key = FGS.get_key_in_buffer(True, recipe, None)
    buffer = FGS.quantization_state.global_amax_history_buffer[key]
    assert [h is linear.fp8_meta["scaling_fwd"].amax_history for h in buffer] == [True]


def test_changing_recipe_costs_one_recompile(meta_delayed):
    """Equal recipes reuse the graph; switching the recipe kind compiles once more."""
    rec = train_steps([R.Float8CurrentScaling(), R.Float8CurrentScaling(), R.DelayedScaling()])
    assert len(rec.fw) == 2


def test_state_loaded_before_the_first_trace_is_kept(meta_delayed):
    """Resuming from a checkpoint: `load_state_dict` on a fresh module (TE's set_extra_state:
    init_fp8_meta_tensors, then copies into those tensors) before its first compiled step. The
    trace adopts and registers those tensors, it makes none (tests/gpu/test_resume_gpu.py
    compares the values with eager TE)."""
    recipe = R.DelayedScaling(amax_history_len=4)
    linear = make_linear()
    # What set_extra_state does before its copies: the saved fp8_meta items, then the tensors.
    linear.fp8_meta.update({"num_gemms": 1, "recipe": recipe})
    linear.init_fp8_meta_tensors(recipe)

    def state():
        return [
            getattr(linear.fp8_meta[d], name)
            for d in ("scaling_fwd", "scaling_bwd")
            for name in ("scale", "amax_history")
        ]

    loaded = state()
    step = torch.compile(step_fn(linear, recipe), backend=JointRecorder().backend, fullgraph=True)
    step(x_meta()).sum().backward()
    assert all(a is b for a, b in zip(state(), loaded, strict=True))
    key = FGS.get_key_in_buffer(True, recipe, None)
    buffer = FGS.quantization_state.global_amax_history_buffer[key]
    assert [h is loaded[1] for h in buffer] == [True]


def test_module_run_twice_updates_its_backward_state_twice(meta_delayed, graph_breaks):
    """A known difference from eager TE with the autocast traced inside the compiled function
    (docs/training.md, docs/architecture.md): a te.Linear applied twice in one step gets two
    backward ops, each handed the module's backward state [scale, amax_history], which each
    records its gradient amax into and then updates (the history rolls twice); eager TE merges
    both amaxes and updates once at the end of the backward. Under an eager autocast the ops
    only merge and the exit updates once (tests/cpu/test_deferred_update_trace.py,
    tests/gpu/test_deferred_update_gpu.py)."""
    recipe = R.DelayedScaling(amax_history_len=4)
    linear = build_without_gpu(
        lambda: te.Linear(IN, IN, params_dtype=torch.bfloat16, device="meta"), "meta"
    )
    rec = JointRecorder()

    def step(x):
        with te.autocast(recipe=recipe):
            return linear(linear(x))

    torch.compile(step, backend=rec.backend, fullgraph=True)(x_meta()).sum().backward()
    assert graph_breaks() == 0 and len(rec.bw) == 1
    bwd_ops = [
        n
        for n in rec.bw[0].graph.nodes
        if "auto_functionalized" in str(n.target) and "linear_bwd" in str(n.args[0])
    ]
    assert len(bwd_ops) == 2
    assert all(n.kwargs.get("_bwd_state_length") == 2 for n in bwd_ops)
