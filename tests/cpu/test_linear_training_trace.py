"""Training-stack options of te.Linear under torch.compile(fullgraph=True), traced on CPU:
FP8 weight caching (is_first_microbatch), fuse_wgrad_accumulation, and regional compilation
(each block compiled on its own, as torchtitan does) for every Hopper recipe.

Joint (forward + backward) graphs on meta tensors, TE's recipe state allocated on meta too.
"""

from __future__ import annotations

import pytest
import torch
import transformer_engine.pytorch as te
from conftest import recipe_for

from te_compile.modules import persistent_state
from te_compile_testing import JointRecorder, build_without_gpu, recipe_state_on

IN, OUT = 64, 64
FWD, BWD = "te_compile.linear_fwd.default", "te_compile.linear_bwd.default"
QUANTIZE_WEIGHT = "te_compile.quantize_weight.default"
HOPPER = ["none", "current", "block", "delayed"]
CACHEABLE = ["current", "block", "delayed"]


@pytest.fixture
def meta_hopper(patched, fake_gpu, graph_breaks):
    fake_gpu("hopper")
    with recipe_state_on("meta"):
        yield graph_breaks


def make_linear(**kwargs):
    return build_without_gpu(
        lambda: te.Linear(IN, OUT, params_dtype=torch.bfloat16, device="meta", **kwargs), "meta"
    )


def x_meta():
    return torch.empty(32, IN, device="meta", dtype=torch.bfloat16, requires_grad=True)


def targets(graphs) -> list[str]:
    """Op targets, auto_functionalized (mutating) ops by the op they wrap."""
    names = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            wrapped = "auto_functionalized" in str(node.target)
            names.append(str(node.args[0] if wrapped else node.target))
    return names


def autocast_step(module, recipe):
    def step(x, **kwargs):
        if recipe is None:
            return module(x, **kwargs)
        with te.autocast(recipe=recipe):
            return module(x, **kwargs)

    return step


# ---- FP8 weight caching ------------------------------------------------------------------------


@pytest.mark.parametrize("name", CACHEABLE)
def test_weight_cache_two_graphs_over_microbatches(name, meta_hopper):
    """is_first_microbatch True and False trace one graph each, reused over minibatches."""
    graph_breaks = meta_hopper
    linear = make_linear()
    rec = JointRecorder()
    step = torch.compile(autocast_step(linear, recipe_for(name)), backend=rec.backend)
    for _ in range(2):  # two minibatches of three microbatches
        for first in (True, False, False):
            step(x_meta(), is_first_microbatch=first).sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 2 and len(rec.bw) == 2
    for fw in rec.fw:  # the cache is refreshed (True) or filled only if empty (False)
        assert targets([fw]).count(QUANTIZE_WEIGHT) == 1 and targets([fw]).count(FWD) == 1
    caches = getattr(linear, persistent_state.WEIGHT_CACHES_ATTR)
    ((valid, parts),) = caches.values()
    assert valid.shape == (1,) and all(p.dtype in (torch.uint8, torch.float32) for p in parts)
    assert linear.weight.grad.shape == (OUT, IN)


def test_weight_cache_refused_for_mxfp8(patched, fake_gpu):
    fake_gpu("blackwell")
    linear = make_linear()
    step = torch.compile(autocast_step(linear, recipe_for("mxfp8")), fullgraph=True)
    with pytest.raises(Exception, match="is_first_microbatch"):
        step(x_meta(), is_first_microbatch=True)


# ---- fuse_wgrad_accumulation -------------------------------------------------------------------


@pytest.mark.parametrize("name", HOPPER)
def test_fuse_wgrad_accumulation_mutates_main_grad(name, meta_hopper):
    graph_breaks = meta_hopper
    linear = make_linear(fuse_wgrad_accumulation=True)
    linear.weight.main_grad = torch.zeros(OUT, IN, device="meta", dtype=torch.float32)
    rec = JointRecorder()
    step = torch.compile(autocast_step(linear, recipe_for(name)), backend=rec.backend)
    for _ in range(2):
        step(x_meta()).sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    bwd = next(
        n
        for gm in rec.bw
        for n in gm.graph.nodes
        if "auto_functionalized" in str(n.target) and "linear_bwd" in str(n.args[0])
    )
    assert any("main_grad" in k for k in bwd.kwargs)  # a declared mutation, not an output
    assert linear.weight.grad is None  # the gradient went into main_grad, as in eager TE


def test_fuse_wgrad_accumulation_needs_main_grad(meta_hopper):
    linear = make_linear(fuse_wgrad_accumulation=True)
    step = torch.compile(autocast_step(linear, recipe_for("current")), fullgraph=True)
    with pytest.raises(Exception, match="main_grad"):
        step(x_meta())


def test_fuse_wgrad_accumulation_refuses_megatron_hook_attributes(meta_hopper):
    linear = make_linear(fuse_wgrad_accumulation=True)
    linear.weight.main_grad = torch.zeros(OUT, IN, device="meta", dtype=torch.float32)
    linear.weight.grad_added_to_main_grad = False
    step = torch.compile(autocast_step(linear, recipe_for("current")), fullgraph=True)
    with pytest.raises(Exception, match="grad_added_to_main_grad"):
        step(x_meta())


# ---- regional compilation ----------------------------------------------------------------------


class Block(torch.nn.Module):
    """A transformer block's MLP half."""

    def __init__(self):
        super().__init__()
        self.fc1 = te.Linear(IN, OUT, params_dtype=torch.bfloat16, device="meta")
        self.fc2 = te.Linear(OUT, IN, params_dtype=torch.bfloat16, device="meta")

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


@pytest.mark.parametrize("name", HOPPER)
def test_regional_compilation_compiles_once_for_12_blocks(name, meta_hopper, monkeypatch):
    """12 identical blocks, each wrapped in its own torch.compile, te.autocast around the
    model in eager code (the torchtitan layout): one forward and one backward graph in all,
    over two steps, DelayedScaling included (nothing in the trace names a module)."""
    graph_breaks = meta_hopper
    # The eager autocast exit runs TE's DelayedScaling update; TE's Python version of it runs
    # on meta tensors, its fused kernel would not.
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", "1")
    recipe = recipe_for(name)
    blocks = [build_without_gpu(Block, "meta") for _ in range(12)]
    rec = JointRecorder()
    compiled = [torch.compile(b, backend=rec.backend, fullgraph=True) for b in blocks]
    for _ in range(2):
        x = x_meta()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            for block in compiled:
                x = block(x)
        x.sum().backward()
    print(f"regional compilation, 12 blocks, {name}: {len(rec.fw)} forward graph(s)")
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    if name == "delayed":  # every block has its own state, made at the one trace
        for block in blocks:
            for fc in (block.fc1, block.fc2):
                assert fc.fp8_meta["scaling_fwd"].amax_history.shape[1] == 3
