"""te_compile.prepare(model, recipe): the compile-time state of every TE GEMM module created
before torch.compile, so the trace finds it and scans no garbage-collector objects; traced
without a GPU on the meta tensors of te_compile.simulate_gpu("hopper").

Each compiled case checks 1 forward + 1 backward graph (fullgraph: a break raises) over two
steps, and the scan counter (persistent_state.scans) around the compile: unchanged for a
prepared model, grown for one that is not (the fallback, which must still work)."""

from __future__ import annotations

import gc
from contextlib import nullcontext

import attention_cases as cases
import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

import te_compile
from te_compile.modules import persistent_state as ps
from te_compile.recipes import DelayedFields
from te_compile_testing import JointRecorder

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing")

FGS = q.FP8GlobalStateManager
CASE = cases.LAYER_CASES["llama"]
GEMM_CLASSES = (te.Linear, te.LayerNormLinear, te.LayerNormMLP)


class Stack(torch.nn.Module):
    """Two te.TransformerLayer blocks and a te.Linear head."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            cases.make_layer(CASE, layer_number=i + 1) for i in range(layers)
        )
        self.head = te.Linear(cases.HIDDEN, 64, params_dtype=CASE.dtype, device="cuda")

    def forward(self, x, **kwargs):
        for layer in self.layers:
            x = layer(x, **kwargs)
        return self.head(x)


def gemm_modules(model) -> list:
    return [m for m in model.modules() if isinstance(m, GEMM_CLASSES)]


def train(model, recipe, regional: bool = False) -> tuple[JointRecorder, int, int]:
    """Two compiled steps (the autocast inside the compiled function, or around the compiled
    blocks with `regional`); returns the recorder, graph breaks and scans during them."""
    from torch._dynamo.utils import counters

    counters.clear()
    rec = JointRecorder()
    kwargs = cases.call_kwargs(CASE)
    scans = ps.scans()
    if regional:
        for block in [*model.layers, model.head]:
            block.compile(backend=rec.backend, fullgraph=True)
        step = model
    else:

        def forward(x, **kw):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return model(x, **kw)

        step = torch.compile(forward, backend=rec.backend, fullgraph=True)
    for _ in range(2):
        x = cases.layer_input(CASE)
        outer = (
            te.autocast(enabled=recipe is not None, recipe=recipe) if regional else nullcontext()
        )
        with outer:
            out = step(x, **kwargs)
        out.float().sum().backward()
    assert x.grad is not None
    return rec, sum(counters["graph_break"].values()), ps.scans() - scans


def assert_delayed_state(model, recipe) -> None:
    fields = DelayedFields.values_of(recipe)
    key = FGS.get_key_in_buffer(True, recipe, None)
    buffer = FGS.quantization_state.global_amax_history_buffer.get(key, [])
    modules = gemm_modules(model)
    assert len(modules) == 2 * 3 + 1  # per layer: QKV LayerNormLinear, proj Linear, MLP
    for m in modules:
        assert getattr(m, ps.DELAYED_ATTR) == fields and ps.is_prepared(m)
        slots = 3 * ps.num_gemms(m)
        assert m.fp8_meta["scaling_fwd"].amax_history.shape == (recipe.amax_history_len, slots)
        assert any(h is m.fp8_meta["scaling_fwd"].amax_history for h in buffer)
    assert FGS.get_unique_autocast_key(recipe, None) in FGS.quantization_state.autocast_arguments


@pytest.mark.parametrize("regional", [False, True], ids=["whole", "regional"])
def test_prepared_delayed_model_compiles_without_scan(regional, patched):
    recipe = R.DelayedScaling(amax_history_len=8)
    with te_compile.simulate_gpu("hopper"):
        torch.manual_seed(0)
        model = Stack()
        scans = ps.scans()
        assert te_compile.prepare(model, recipe) is model
        assert ps.scans() == scans, "prepare walks model.modules(), not the garbage collector"
        assert_delayed_state(model, recipe)  # before any compile
        rec, breaks, scanned = train(model, recipe, regional)
        assert breaks == 0 and scanned == 0
        # regional: the 2 identical blocks share one graph; the head is one more
        assert (len(rec.fw), len(rec.bw)) == ((2, 2) if regional else (1, 1))

        # The same model not prepared: the fallback scans, and traces the same op graph
        # (alone in TE's buffers, as the prepared one was: the autocast exit updates them all).
        fw_ops, bw_ops = JointRecorder.targets(rec.fw), JointRecorder.targets(rec.bw)
        del model, rec
        gc.collect()
        FGS.reset()
        torch._dynamo.reset()
        torch.manual_seed(0)
        plain = Stack()
        plain_rec, plain_breaks, plain_scanned = train(plain, recipe, regional)
    assert plain_breaks == 0 and plain_scanned > 0 and not ps.is_prepared(plain.head)
    assert fw_ops == JointRecorder.targets(plain_rec.fw)
    assert bw_ops == JointRecorder.targets(plain_rec.bw)
    # the forward update at the outermost autocast exit: in the graph, or eager TE's (regional)
    assert ("te_compile.amax_and_scale_update.default" in fw_ops) == (not regional)


def test_prepare_is_idempotent_and_keeps_te_eager_state(patched):
    recipe = R.DelayedScaling()
    with te_compile.simulate_gpu("hopper"):
        model = Stack()
        te_compile.prepare(model, recipe)
        key = FGS.get_key_in_buffer(True, recipe, None)
        buffer = list(FGS.quantization_state.global_amax_history_buffer[key])
        metas = [m.fp8_meta["scaling_fwd"] for m in gemm_modules(model)]
        te_compile.prepare(model, R.DelayedScaling())  # equal recipe, fresh object
        # TE's own initialisation, as an eager FP8 forward runs it, keeps the state.
        with te.autocast(recipe=R.DelayedScaling()):
            for m in gemm_modules(model):
                m.init_fp8_metadata(num_gemms=ps.num_gemms(m))
    assert [m.fp8_meta["scaling_fwd"] for m in gemm_modules(model)] == metas
    after = FGS.quantization_state.global_amax_history_buffer[key]
    assert len(after) == len(buffer) and all(a is b for a, b in zip(after, buffer, strict=True))


def test_prepare_default_recipe_is_tes(patched):
    """recipe=None: TE's default recipe on this GPU, DelayedScaling on Hopper."""
    with te_compile.simulate_gpu("hopper"):
        model = te_compile.prepare(Stack())
    assert_delayed_state(model, R.DelayedScaling())


@pytest.mark.parametrize("recipe", [R.Float8CurrentScaling, R.Float8BlockScaling])
def test_prepare_stateless_recipe_registers_only(recipe, patched):
    """Recipes without state across steps: modules registered, no FP8 state created."""
    with te_compile.simulate_gpu("hopper"):
        model = te_compile.prepare(Stack(), recipe())
        assert all(ps.is_prepared(m) and not m.fp8_initialized for m in gemm_modules(model))
        rec, breaks, scanned = train(model, recipe())
    assert breaks == 0 and scanned == 0 and (len(rec.fw), len(rec.bw)) == (1, 1)
    assert not FGS.quantization_state.global_amax_history_buffer


def test_prepare_refuses_what_compile_refuses(patched):
    with te_compile.simulate_gpu("hopper"), pytest.raises(te_compile.UnsupportedUnderCompileError):
        te_compile.prepare(Stack(1), R.DelayedScaling(amax_compute_algo=lambda h: h[0]))


@pytest.mark.parametrize("recipe", [R.DelayedScaling, R.Float8CurrentScaling])
def test_prepared_fp8_parameters_compile_without_scan(recipe, patched):
    """FP8 primary weights (te.quantized_model_init): their gradient carriers come from the
    prepared modules too."""
    from test_fp8_params_trace import fp8_model, linear

    with te_compile.simulate_gpu("hopper"):
        model = te_compile.prepare(fp8_model(linear, recipe()), recipe())
        rec = JointRecorder()
        step = torch.compile(model, backend=rec.backend, fullgraph=True)
        scans = ps.scans()
        for _ in range(2):
            x = torch.randn(32, model.in_features, device="cuda", dtype=torch.bfloat16)
            with te.autocast(recipe=recipe()):
                step(x.requires_grad_()).float().sum().backward()
    assert ps.scans() == scans and (len(rec.fw), len(rec.bw)) == (1, 1)
