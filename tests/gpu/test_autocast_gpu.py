"""GPU suite for te.autocast under torch.compile with inductor: real tensors, results vs eager TE.

Run on a GPU machine with TE installed: `bash scripts/gpu_suite.sh` (or `pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from autocast_cases import RECIPE_CODES, in_autocast, state_code
from conftest import RECIPE_GENERATION, recipe_instances
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q

import te_compile
from te_compile_testing import InductorRecorder
from te_compile_testing import recipe_supported as supported

pytestmark = pytest.mark.gpu
FGS = q.FP8GlobalStateManager


def x_cuda():
    return torch.arange(16, dtype=torch.float32, device="cuda")


@pytest.mark.parametrize("name", list(RECIPE_GENERATION))
def test_autocast_inside_matches_eager(name, patched):
    ok, reason = supported(name)
    recipe = recipe_instances()[name]
    fn = in_autocast(recipe=recipe)
    compiled = torch.compile(fn, backend=InductorRecorder(), fullgraph=True)
    if not ok:
        with pytest.raises(RuntimeError, match="cannot run on this GPU"):
            compiled(x_cuda())
        return
    got = compiled(x_cuda())
    want = fn(x_cuda())
    assert got[0][0].item() == 10 + RECIPE_CODES[type(recipe)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_nested_and_default_recipe_match_eager(patched):
    delayed, current = R.DelayedScaling(), R.Float8CurrentScaling()

    def fn(x):
        with te.autocast(recipe=delayed):
            a = x + state_code()
            with te.autocast(recipe=current):
                b = x + state_code()
                with te.autocast(enabled=False, calibrating=True):
                    c = x + state_code()
            with te.autocast(recipe=None):
                d = x + state_code()
        return torch.stack([a, b, c, d])

    backend = InductorRecorder()
    got = torch.compile(fn, backend=backend, fullgraph=True)(x_cuda())
    assert torch.equal(got, fn(x_cuda()))
    assert backend.graphs == 1


def test_reset_does_not_recompile(patched):
    backend = InductorRecorder()
    compiled = torch.compile(
        in_autocast(recipe=R.DelayedScaling()), backend=backend, fullgraph=True
    )
    compiled(x_cuda())
    FGS.reset()
    compiled(x_cuda())
    assert backend.graphs == 1


@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_eager_te_module_between_compiled_regions(name, patched):
    """autocast outside; compiled code before and after an eager te.Linear; equal to all-eager."""
    if not supported(name)[0]:
        pytest.skip(supported(name)[1])
    recipe = recipe_instances()[name]
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)

    def fresh_linear():  # DelayedScaling state lives in the module: each run gets its own
        torch.manual_seed(0)
        return te.Linear(64, 64, params_dtype=torch.bfloat16)

    # Single elementwise ops round the same in eager and inductor, so equality is exact.
    def pre(t):
        return t * (1 + state_code())

    def post(t):
        return t.float() * state_code()

    def run(pre_fn, post_fn):
        FGS.reset()
        with te.autocast(recipe=recipe):
            return post_fn(linear(pre_fn(x)))

    linear = fresh_linear()

    eager = run(pre, post)
    linear = fresh_linear()
    compiled = run(
        torch.compile(pre, backend=InductorRecorder(), fullgraph=True),
        torch.compile(post, backend=InductorRecorder(), fullgraph=True),
    )
    assert torch.equal(compiled, eager)
    with torch.no_grad():  # FP8 really ran: the bf16 GEMM gives another answer
        bf16 = torch.nn.functional.linear(
            x * (11 + RECIPE_CODES[type(recipe)]), linear.weight, linear.bias
        )
        bf16 = bf16.float() * (10 + RECIPE_CODES[type(recipe)])
    assert not torch.equal(bf16, eager)


def _delayed_state(recipe):
    """A te.Linear that ran one eager DelayedScaling step, with fresh amaxes in history row 0,
    and its fp8_meta["scaling_fwd"]. Keep the module: the compiled update covers the state of
    live TE GEMM modules only (persistent_state.compiled_buffer_positions)."""
    torch.manual_seed(0)
    linear = te.Linear(64, 64, params_dtype=torch.bfloat16)
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    with te.autocast(recipe=recipe):
        linear(x).sum().backward()
    meta = linear.fp8_meta["scaling_fwd"]
    meta.amax_history[0].copy_(torch.rand_like(meta.amax_history[0]) * 100)
    return linear, meta


@pytest.mark.parametrize(
    "recipe_kwargs",
    [
        dict(amax_history_len=8),
        dict(amax_history_len=4, amax_compute_algo="most_recent", margin=1),
        dict(amax_history_len=1, fp8_format=R.Format.E4M3),
    ],
)
def test_delayed_forward_update_matches_eager(recipe_kwargs, patched):
    """The forward amax/scale update at a compiled autocast exit equals TE's eager update."""
    recipe = R.DelayedScaling(**recipe_kwargs)

    def step(x):
        with te.autocast(recipe=recipe):
            return x * 2

    FGS.reset()
    linear, meta = _delayed_state(recipe)
    before = meta.amax_history.clone()
    step(x_cuda())  # eager TE: reduce_and_update_fp8_tensors(forward=True)
    eager = (meta.amax_history.clone(), meta.scale.clone())

    FGS.reset()
    torch._dynamo.reset()
    del linear
    linear, meta = _delayed_state(recipe)
    meta.amax_history.copy_(before)
    torch.compile(step, backend=InductorRecorder(), fullgraph=True)(x_cuda())
    assert not torch.equal(meta.amax_history, before), "the update did not run"
    assert torch.equal(meta.amax_history, eager[0])
    assert torch.equal(meta.scale, eager[1])


def test_amax_and_scale_update_opcheck():
    from te_compile import ops  # noqa: F401

    histories = [torch.rand(4, 3, device="cuda") * 10, torch.rand(4, 1, device="cuda")]
    scales = [torch.ones(3, device="cuda"), torch.ones(1, device="cuda")]
    torch.library.opcheck(
        torch.ops.te_compile.amax_and_scale_update.default,
        (histories, scales, "max", "e4m3", 0.0, True),
    )


@pytest.mark.parametrize("head_first", [False, True], ids=["head_last", "head_first"])
def test_eager_gemm_module_beside_compiled_ones_under_delayed(head_first, patched):
    """One DelayedScaling autocast over a compiled block of two te.Linear and an eager te.Linear
    before or after it, 3 AdamW steps: outputs, gradients and every module's DelayedScaling
    state bit-identical to all-eager TE. The eager module claims TE's first-module flag and its
    backward runs TE's update over every registered backward state, compiled modules' too; TE's
    fused kernel leaves a history whose latest amax is 0 as it is, so whichever of that update
    and the autocast exit's (where compiled modules leave theirs) comes first, each history
    rolls once a step (TE's delayed_scaling.cu; this test is its check)."""
    bf16 = torch.bfloat16

    def run(compiled: bool):
        FGS.reset()
        torch._dynamo.reset()
        torch.manual_seed(0)
        block = torch.nn.Sequential(*(te.Linear(64, 64, params_dtype=bf16) for _ in range(2)))
        head = te.Linear(64, 64, params_dtype=bf16)
        params = [*block.parameters(), *head.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        body = torch.compile(block, fullgraph=True) if compiled else block
        records = []
        for i in range(3):
            g = torch.Generator().manual_seed(100 + i)
            x = torch.randn(32, 64, generator=g).to("cuda", bf16).requires_grad_()
            with te.autocast(recipe=R.DelayedScaling(amax_history_len=4)):
                y = body(head(x)) if head_first else head(body(x))
            y.float().square().mean().backward()
            records += [y.detach(), x.grad, *(p.grad.clone() for p in params)]
            opt.step()
            opt.zero_grad(set_to_none=True)
        te_compile.flush_delayed_updates()  # what compiled modules left to the exit
        for m in (*block, head):
            for d in ("scaling_fwd", "scaling_bwd"):
                records += [m.fp8_meta[d].scale.clone(), m.fp8_meta[d].amax_history.clone()]
        return records

    want = run(False)
    got = run(True)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"tensor {i}: {(a.float() - b.float()).abs().max()}"
    for history in want[-9], want[-5]:  # the block's backward histories hold amaxes
        assert history.abs().sum() > 0
