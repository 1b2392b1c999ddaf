"""GPU suite for te.Linear under torch.compile(mode="reduce-overhead", fullgraph=True): CUDA
graphs through inductor's cudagraph trees, bit-identical to eager TE over training steps.

Every test builds two identical modules (`twins`): one runs eagerly (TE's own code, which
te_compile leaves untouched), the other compiled. The eager sequence runs first and is recorded
(cloned); then TE's global FP8 state is reset and the compiled sequence runs, compared step by
step. DelayedScaling keeps global amax buffers keyed by recipe, so the two sequences never
share an autocast scope.

Run on a GPU machine with TE installed: `bash scripts/gpu_suite.sh` (or `pytest -m gpu`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
import transformer_engine.pytorch as te
from conftest import recipe_for, skip_unless_supported
from torch._dynamo.utils import counters
from transformer_engine.pytorch import quantization as q

import te_compile

pytestmark = pytest.mark.gpu

FGS = q.FP8GlobalStateManager
RECIPES = ["none", "current", "block", "delayed"]  # the Hopper ones
IN, OUT, TOKENS = 128, 256, 64
BF16 = torch.bfloat16
LR = 0.1


def fresh_linear() -> te.Linear:
    torch.manual_seed(0)
    linear = te.Linear(IN, OUT, bias=True, params_dtype=BF16)
    with torch.no_grad():  # TE zero-initialises biases: make dbias/bias bugs visible
        linear.bias.normal_()
    return linear


@pytest.fixture
def twins():
    """Two identical te.Linear(128, 256, bias=True) in bf16: (eager, compiled)."""
    eager, compiled = fresh_linear(), fresh_linear()
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a, b)
    return eager, compiled


def make_step(linear, recipe):
    """The function that gets compiled: te.autocast (if any) inside it, as in user code."""

    def step(x):
        with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            return linear(x)

    return step


def compile_step(linear, recipe, mode="reduce-overhead"):
    return torch.compile(make_step(linear, recipe), mode=mode, fullgraph=True)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (input, output grad) pairs; the same for the eager and the compiled sequence."""
    torch.manual_seed(1)
    return [
        (
            torch.randn(TOKENS, IN, device="cuda", dtype=BF16),
            torch.randn(TOKENS, OUT, device="cuda", dtype=BF16),
        )
        for _ in range(n)
    ]


def fp8_state(linear, name) -> dict:
    """DelayedScaling's forward and backward amax history and scale (empty for other recipes)."""
    if name != "delayed":
        return {}
    te_compile.flush_delayed_updates()  # what compiled modules left to the exit
    fwd, bwd = linear.fp8_meta["scaling_fwd"], linear.fp8_meta["scaling_bwd"]
    return {
        "fwd amax_history": fwd.amax_history,
        "fwd scale": fwd.scale,
        "bwd amax_history": bwd.amax_history,
        "bwd scale": bwd.scale,
    }


def sgd(linear):
    with torch.no_grad():
        for p in linear.parameters():
            p -= LR * p.grad
            p.grad = None


def train_step(linear, fn, x, dy, name, cudagraphs=False):
    """Forward, backward and an SGD step. Returns (record, out, bf16): `record` holds cloned
    output, gradients, updated parameters and FP8 state; `out` is the output itself (detached,
    not cloned); `bf16` is torch's bf16 linear of the same input and parameters."""
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    x = x.clone().requires_grad_()
    out = fn(x)
    out.backward(dy)
    w, b = linear.weight, linear.bias
    record = {"out": out, "dgrad": x.grad, "wgrad": w.grad, "dbias": b.grad}
    bf16 = F.linear(x.detach(), w.detach(), b.detach())
    sgd(linear)
    record |= {"weight": w, "bias": b} | fp8_state(linear, name)
    return {k: v.detach().clone() for k, v in record.items()}, out.detach(), bf16


def eval_step(linear, fn, x, name, cudagraphs=False):
    """A forward under torch.no_grad(); returns the cloned output and FP8 state."""
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    with torch.no_grad():
        record = {"out": fn(x)} | fp8_state(linear, name)
    return {k: v.detach().clone() for k, v in record.items()}


def assert_same(got: dict, want: dict, where: str):
    assert got.keys() == want.keys(), where
    for key, w in want.items():
        g = got[key]
        assert g.dtype == w.dtype and torch.equal(g, w), f"{where}: {key} differs from eager TE"


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def cudagraph_skips() -> int:
    return counters["inductor"]["cudagraph_skips"]


@pytest.mark.parametrize("name", RECIPES)
def test_reduce_overhead_matches_eager_over_steps(name, twins, patched):
    """10 SGD steps (lr 0.1), a new input each step: after every step the output, dgrad, wgrad,
    dbias, updated weight and bias (and DelayedScaling's amax histories and scales) are
    bit-identical to eager TE; FP8 recipes really ran in FP8 (output differs from torch's bf16
    linear); one graph, no cudagraph skips."""
    skip_unless_supported(name)
    eager, compiled = twins
    recipe, data = recipe_for(name), batches(10)
    FGS.reset()
    want = [train_step(eager, make_step(eager, recipe), x, dy, name)[0] for x, dy in data]
    FGS.reset()
    counters.clear()
    fn = compile_step(compiled, recipe)
    for step, (x, dy) in enumerate(data):
        got, _, bf16 = train_step(compiled, fn, x, dy, name, cudagraphs=True)
        assert_same(got, want[step], f"step {step}")
        if name != "none":
            assert not torch.equal(got["out"], bf16), f"step {step}: output equals bf16, no FP8"
    assert cudagraph_skips() == 0, "inductor skipped CUDA graphs (see the cudagraphs log)"
    assert graphs_compiled() == 1, "recompiled during the 10 steps"
    if name == "delayed":
        scale = want[-1]["fwd scale"]
        assert not torch.equal(scale, torch.ones_like(scale)), "scales never updated"


@pytest.mark.parametrize("name", RECIPES)
def test_outputs_kept_across_steps_no_overwrite_error(name, twins, patched):
    """Outputs kept across reduce-overhead steps: the documented rule, and our outputs follow it.

    The rule (torch.compiler.cudagraph_mark_step_begin and the "CUDAGraph Trees" docs): outputs
    of a function compiled with mode="reduce-overhead" live in the CUDA graphs' memory pool, and
    starting a new step (cudagraph_mark_step_begin, then the next call) frees the tensors of the
    prior step: reading one afterwards raises "accessing tensor output of CUDAGraphs that has
    been overwritten by a subsequent run". An output to be kept across steps must be cloned
    (outside the compiled function) before the next step.

    Over 3 training steps this checks: each step's clone reads back after all 3 steps, equal
    to eager TE's output for that step; the newest output reads uncloned and equals its clone;
    the two older uncloned outputs raise torch's error (they really were CUDA graph outputs).
    """
    skip_unless_supported(name)
    eager, compiled = twins
    recipe, data = recipe_for(name), batches(3)
    FGS.reset()
    want = [train_step(eager, make_step(eager, recipe), x, dy, name)[0]["out"] for x, dy in data]
    FGS.reset()
    fn = compile_step(compiled, recipe)
    clones, kept = [], []
    for x, dy in data:
        record, out, _ = train_step(compiled, fn, x, dy, name, cudagraphs=True)
        clones.append(record["out"])
        kept.append(out)
    for step, (clone, w) in enumerate(zip(clones, want, strict=True)):
        assert torch.equal(clone, w), f"step {step}: kept clone differs from eager TE"
    assert torch.equal(kept[-1], clones[-1]), "newest output differs from its clone"
    for old in kept[:-1]:  # freed when the next step began
        with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
            old.sum().item()


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_memory_flat_over_1000_steps(name, twins, patched):
    """1000 reduce-overhead training steps (fwd, bwd, SGD): memory_allocated after step 1000
    equals that after step 20 (0 bytes of growth), and the peak over steps 101..1000 is the
    peak of step 101 alone (peak stats reset after step 100)."""
    skip_unless_supported(name)
    _, linear = twins
    fn = compile_step(linear, recipe_for(name))
    torch.manual_seed(1)

    def step():
        x = torch.randn(TOKENS, IN, device="cuda", dtype=BF16, requires_grad=True)
        dy = torch.randn(TOKENS, OUT, device="cuda", dtype=BF16)
        torch.compiler.cudagraph_mark_step_begin()
        fn(x).backward(dy)
        sgd(linear)

    for i in range(1, 1001):
        step()
        if i in (20, 100, 101, 1000):
            torch.cuda.synchronize()
        if i == 20:
            after_20 = torch.cuda.memory_allocated()
        elif i == 100:
            torch.cuda.reset_peak_memory_stats()
        elif i == 101:
            peak_101 = torch.cuda.max_memory_allocated()
    grown = torch.cuda.memory_allocated() - after_20
    assert grown == 0, f"memory_allocated grew by {grown} bytes from step 20 to step 1000"
    peak_grown = torch.cuda.max_memory_allocated() - peak_101
    assert peak_grown == 0, f"peak memory grew by {peak_grown} bytes over steps 101..1000"


def train_eval_sequence(linear, fn, name, cudagraphs, rounds=3):
    """Yields (label, record) for `rounds` rounds of a training step then a no_grad forward."""
    data = batches(2 * rounds)
    for r in range(rounds):
        x, dy = data[2 * r]
        yield f"round {r} train", train_step(linear, fn, x, dy, name, cudagraphs)[0]
        yield f"round {r} eval", eval_step(linear, fn, data[2 * r + 1][0], name, cudagraphs)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_train_eval_switch(mode, name, twins, patched):
    """Training steps and torch.no_grad() forwards alternate on one compiled function, 3 rounds:
    each training step's output, gradients and updated parameters and each eval output (and
    DelayedScaling's state after each: eager TE records forward amaxes under no_grad but
    updates scales only when grad is enabled) are bit-identical to eager TE doing the same
    sequence; at most 2 graphs (one per grad mode); no cudagraph skips under reduce-overhead."""
    skip_unless_supported(name)
    eager, compiled = twins
    recipe, cudagraphs = recipe_for(name), mode == "reduce-overhead"
    FGS.reset()
    want = list(train_eval_sequence(eager, make_step(eager, recipe), name, cudagraphs=False))
    FGS.reset()
    counters.clear()
    fn = compile_step(compiled, recipe, mode=mode)
    got = train_eval_sequence(compiled, fn, name, cudagraphs)
    for (label, g), (_, w) in zip(got, want, strict=True):  # lazily: compared step by step
        assert_same(g, w, label)
    assert graphs_compiled() <= 2, f"{graphs_compiled()} graphs: recompiled beyond grad mode"
    if cudagraphs:
        assert cudagraph_skips() == 0, "inductor skipped CUDA graphs (see the cudagraphs log)"
