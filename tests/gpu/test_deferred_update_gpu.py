"""DelayedScaling's backward update deferred to an eager autocast's exit (te_compile/
delayed_updates.py) against all-eager TE, bit for bit, the way users train: a model whose middle
te.Linear runs twice per step (the case a per-module backward update gets wrong), AdamW, eager
steps first, a forward under autocast whose backward never runs (a metric), the whole model
compiled or each module compiled on its own, default mode and CUDA graphs, the graph path and
TE's kernels. The state is compared through `state_dict()` (which flushes each module's
pending update) without an explicit flush, then through TE's tensors after
`te_compile.flush_delayed_updates()`."""

from __future__ import annotations

import pickle

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import skip_unless_supported
from torch._dynamo.utils import counters
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

import te_compile
from te_compile_testing import graph_fp8

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
RECIPE = R.DelayedScaling(amax_history_len=4)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = te.LayerNormMLP(64, 128, params_dtype=BF16)
        self.shared = te.Linear(64, 64, params_dtype=BF16)
        self.head = te.Linear(64, 64, params_dtype=BF16)

    def forward(self, x):
        h = self.shared(self.mlp(x))
        return self.head(self.shared(h))  # `shared` again: its amaxes merge, one update a step


def _fp8_modules(model):
    return [model.mlp, model.shared, model.head]


def _run(compile_how: str | None, mode: str, graph_path: bool, steps: int = 5):
    """Per step: output, input grad and parameter grads; then the extra states state_dict
    saved, then TE's tensors after a flush."""
    q.FP8GlobalStateManager.reset()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kwargs = {"fullgraph": True} | ({"mode": mode} if mode != "default" else {})
    if compile_how == "whole":
        run = torch.compile(model, **kwargs)
    elif compile_how == "per_module":
        for name in ("mlp", "shared", "head"):
            setattr(model, name, torch.compile(getattr(model, name), **kwargs))
        run = model
    else:
        run = model
    records = []
    with graph_fp8(graph_path):
        for i in range(steps):
            g = torch.Generator().manual_seed(100 + i)
            x = torch.randn(32, 64, generator=g).to("cuda", BF16).requires_grad_()
            torch.compiler.cudagraph_mark_step_begin()
            with te.autocast(recipe=RECIPE):
                y = run(x)
            y.float().square().mean().backward()
            records += [
                y.detach().clone(),
                x.grad.clone(),
                *(p.grad.clone() for p in model.parameters()),
            ]
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i == 1 and mode == "default":  # a metric: a forward with grad, no backward
                with te.autocast(recipe=RECIPE):
                    records.append(run(x.detach()).detach().clone())
    torch.cuda.synchronize()
    saved = [v for k, v in model.state_dict().items() if k.endswith("_extra_state")]
    records += [_unpickled(v) for v in saved]
    te_compile.flush_delayed_updates()
    for m in _fp8_modules(model):
        m = getattr(m, "_orig_mod", m)
        for d in ("scaling_fwd", "scaling_bwd"):
            records += [m.fp8_meta[d].scale.clone(), m.fp8_meta[d].amax_history.clone()]
    return records


def _unpickled(extra: torch.Tensor) -> list:
    state = pickle.loads(extra.numpy().tobytes())
    return [state[k] for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")]


def _assert_equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(a, list):
            _assert_equal(a, b)
            continue
        assert torch.equal(a, b), f"tensor {i}: {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("graph_path", [True, False], ids=["graph", "te_kernels"])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("compile_how", ["whole", "per_module"])
def test_deferred_backward_update_matches_eager(compile_how, mode, graph_path, patched):
    skip_unless_supported("delayed")
    want = _run(None, mode, graph_path)
    counters.clear()
    got = _run(compile_how, mode, graph_path)
    _assert_equal(got, want)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    # FP8 really ran: every backward history holds amaxes, every backward scale moved off 1
    bwd_states = want[-12:]
    for scale, history in zip(bwd_states[2::4], bwd_states[3::4], strict=True):
        assert history.abs().sum() > 0 and torch.all(scale[::2] != 1.0)  # grad_output slots


def test_state_between_steps_is_pending_until_a_flush(patched):
    """What the deferral makes visible: right after a compiled backward, a module's backward
    history holds the step's amaxes in row 0 and its scale is last step's; the flush applies
    TE's update, and the autocast's next exit then leaves that state as it is."""
    skip_unless_supported("delayed")
    torch.manual_seed(0)
    linear = te.Linear(64, 64, params_dtype=BF16).cuda()
    run = torch.compile(linear, fullgraph=True)
    x = torch.randn(32, 64, device="cuda", dtype=BF16, requires_grad=True)
    with te.autocast(recipe=RECIPE):
        y = run(x)
    y.float().square().mean().backward()
    bwd = linear.fp8_meta["scaling_bwd"]
    assert bwd.amax_history[0, 0] > 0 and torch.all(bwd.scale == 1.0)
    te_compile.flush_delayed_updates()
    assert bwd.amax_history[0, 0] == 0 and bwd.scale[0] != 1.0
    flushed = [bwd.amax_history.clone(), bwd.scale.clone()]
    with torch.no_grad(), te.autocast(recipe=RECIPE):
        run(x)
    with te.autocast(recipe=RECIPE):
        run(x)  # an exit with grad: nothing pending, nothing changes
    assert torch.equal(bwd.amax_history, flushed[0]) and torch.equal(bwd.scale, flushed[1])


@pytest.mark.parametrize("flush_between", [True, False], ids=["flushed", "not_flushed"])
def test_two_backward_passes_without_an_exit_between(flush_between, patched):
    """GPipe's order, F1 F2 B1 B2, each forward under its own eager autocast: eager TE updates
    the backward state at the end of B1, so B2 quantizes with the updated scale. Deferred, B2
    would use B1's scale and merge both passes' amaxes (docs/training.md); a flush after B1
    restores eager TE's values bit for bit."""
    skip_unless_supported("delayed")

    def run(compiled: bool):
        q.FP8GlobalStateManager.reset()
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net().cuda()
        call = torch.compile(model, fullgraph=True) if compiled else model
        records = []
        for step in range(3):
            outs = []
            for mb in range(2):
                g = torch.Generator().manual_seed(10 * step + mb)
                x = torch.randn(32, 64, generator=g).to("cuda", BF16)
                with te.autocast(recipe=RECIPE):
                    outs.append(call(x))
            for y in outs:
                y.float().square().mean().backward()
                if flush_between:
                    te_compile.flush_delayed_updates()
            records += [y.detach().clone() for y in outs]
            records += [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        te_compile.flush_delayed_updates()
        for m in _fp8_modules(model):
            records += [m.fp8_meta["scaling_bwd"].scale.clone()]
            records += [m.fp8_meta["scaling_bwd"].amax_history.clone()]
        return records

    want, got = run(False), run(True)
    if flush_between:
        _assert_equal(got, want)
    else:  # the documented difference: some backward state or gradient is not eager TE's
        assert not all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


_TINY, _HUGE = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
# every kind of float32 a scale can hold: zeros of both signs, denormals, extremes, infinities
_SCALE_VALUES = [0.0, -0.0, 1.0, 448.0, 2.0**-140, -(2.0**-149), _TINY, _TINY / 3, _HUGE, -_HUGE]
_SCALE_VALUES += [float("inf"), float("-inf"), 0.1, 57344.0, 1 / 448.0]


@pytest.mark.parametrize("op", ["scale_snapshot", "scale_in_backward"])
def test_scale_copies_are_exact_copies_in_new_memory(op, patched):
    """DelayedScaling's scale copies (ops/delayed_scaling.py): every float32 a scale can hold
    comes back with its bits (zeros of both signs, denormals, the extremes, infinities; NaN as a
    NaN), in memory of its own, and a later write to the scale leaves the copy as it was. (Any
    other way of copying, such as session 34's trial of an elementwise kernel, must pass this.)"""
    scale = torch.tensor(_SCALE_VALUES, device="cuda")
    args = (scale,) if op == "scale_snapshot" else (scale, torch.ones(4, device="cuda"))
    copy = getattr(torch.ops.te_compile, op)(*args)
    assert copy.data_ptr() != scale.data_ptr()
    assert torch.equal(copy.view(torch.int32), scale.view(torch.int32))
    nan = getattr(torch.ops.te_compile, op)(torch.full_like(scale, float("nan")), *args[1:])
    assert nan.isnan().all()
    kept = copy.clone()
    scale.fill_(3.0)
    assert torch.equal(copy.view(torch.int32), kept.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_read_keeps_every_bit_in_triton(dtype, patched):
    """The graph path's backward scale read without a copy (graph_fp8.delayed.read_with),
    compiled by inductor to Triton: the scale's bits (as the copies above), whatever the
    gradient's first element holds."""
    from te_compile.graph_fp8.delayed import read_with

    scale = torch.tensor(_SCALE_VALUES, device="cuda")
    payload_nan = torch.tensor([0x7FC00001], dtype=torch.int32, device="cuda").view(torch.float32)
    scale = torch.cat([scale, payload_nan])
    read = torch.compile(read_with, fullgraph=True)
    for first in (0.0, float("nan"), float("inf"), -2.5):
        grad = torch.full((8, 16), 1.0, device="cuda", dtype=dtype)
        grad[0, 0] = first
        got = read(scale, grad)
        assert torch.equal(got.view(torch.int32), scale.view(torch.int32)), first
