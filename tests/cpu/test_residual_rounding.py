"""te.TransformerLayer's residual stream under inductor's default settings: no generated
reduction sums two gradients that eager TE would have stored (rounded to bf16) first.

Eager TE's bias-dropout-add (compiled on its own by TE's jit_fuser) reads in backward the sum of
the gradients that reach its output, which autograd stored in bf16. Compiled whole, inductor
fused that sum into the bias gradient's reduction and kept it in float32 (session 20's GPT
bisection on an H100: the first gradient apart from eager TE was the projection bias's).
modules/transformer_layer.py rounds the value and the gradient at each bias-dropout-add's output;
this reads inductor's generated Triton code for the simulated Hopper (nothing runs) and checks
that no reduction adds two loaded tensors without rounding, and, as a control, that without the
rounding such a reduction appears. Each compile runs in a fresh process: inductor realizes a
custom op's multi-user inputs only once the op's implicit fallback exists, so a second compile
in one process stores the sum (rounded) first and the test would pass vacuously
(docs/graph_fp8.md, "Why the first compile in a process differs"). Also: the rounding keeps
what the forward saves for backward as it was (activation memory), on both paths.

Session 50 rounds the dropout's gradient too, and the last test pins why that matches eager TE
only from a few hundred tokens on: eager TE's own compiled add stores that gradient before
summing it where inductor splits the sum (256 tokens and more at hidden 1024), and sums it
unrounded, fused with its store, where it does not (64 tokens). Session 54: without dropout that
gradient is the output's, rounded already, and rounding it again cost a float32 buffer the size
of the residual stream (test_no_float32_gradient_buffer_without_dropout)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")

_KERNEL = re.compile(r"\n(?=\w+ = async_compile\.triton\()")
_LOAD = re.compile(r"^\s*(tmp\d+) = tl\.load\(")
_ADD = re.compile(r"^\s*(tmp\d+) = (tmp\d+) \+ (tmp\d+)$")

_COMPILE = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
import te_compile
from te_compile.modules import transformer_layer
from te_compile.tools.check_inductor import InductorRecorder

recipe_name, rounding, dropout = sys.argv[1], sys.argv[2], float(sys.argv[3])
te_compile.patch()
class NotRounded:
    apply = staticmethod(lambda t: t)
if rounding == "plain":
    transformer_layer.StoredAsEager = NotRounded
if rounding not in ("rounded", "always"):
    transformer_layer.GradientStoredAsEager = NotRounded
if rounding == "always":  # the bias gradient rounded again where it is the output's already
    transformer_layer._output_gradient = lambda layer, residual, drop_path: False
recipe = {"none": None, "current": R.Float8CurrentScaling(), "delayed": R.DelayedScaling()}[recipe_name]
rec = InductorRecorder("hopper")
with te_compile.simulate_gpu("hopper"), rec.context():
    torch.manual_seed(0)
    layer = te.TransformerLayer(256, 1024, 4, hidden_dropout=dropout, attention_dropout=0.0,
                                params_dtype=torch.bfloat16, self_attn_mask_type="causal").cuda()
    x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return layer(x)

    # inductor's random lowering needs real tensors: dropout draws through ATen here
    with torch._inductor.config.patch(fallback_random=True):
        torch.compile(step, backend=rec.backend, fullgraph=True)(x).float().sum().backward()
print("SOURCES" + json.dumps(rec.sources))
"""


def _kernels(recipe_name: str, rounding: str, dropout: float = 0.0) -> list[str]:
    """The Triton kernels inductor generates for one bf16 TransformerLayer step, in a fresh
    process (its first compile, caches off). `rounding`: "rounded" (te_compile's), "plain"
    (none), "value-only" (the output and its gradient, not the dropout's gradient)."""
    return _kernels_of(*_layer_compile(recipe_name, rounding, dropout))


def _layer_compile(recipe_name: str, rounding: str, dropout: float = 0.0) -> tuple[str, ...]:
    """`_COMPILE` and its arguments, spelled one way so that `_sources_of`'s cache sees one
    compile where two tests ask for the same layer."""
    return _COMPILE, recipe_name, rounding, str(dropout)


def _kernels_of(script: str, *args: str) -> list[str]:
    """The Triton kernels of the compiles `script` records, run in a fresh process with
    inductor's caches off."""
    kernels = [k for source in _sources_of(script, *args) for k in _KERNEL.split(source)]
    return [k for k in kernels if "async_compile.triton(" in k]


@functools.cache  # two tests compile the same layer: the file's worker runs it once
def _sources_of(script: str, *args: str) -> tuple[str, ...]:
    """Inductor's generated code of the compiles `script` records (forward, then backward), run
    in a fresh process with inductor's caches off."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tuple(json.loads(done.stdout.split("SOURCES", 1)[1]))


def unrounded_gradient_sums(kernels: list[str]) -> list[str]:
    """Names of the reduction kernels that add two loaded tensors and round nothing."""
    found = []
    for kernel in kernels:
        if "tl.sum" not in kernel or "bitcast=True" in kernel:
            continue
        lines = kernel.splitlines()
        loads = {m.group(1) for line in lines if (m := _LOAD.match(line))}
        if any((m := _ADD.match(line)) and {m.group(2), m.group(3)} <= loads for line in lines):
            found.append(kernel.split(" = ", 1)[0])
    return found


def dropout_gradient_sums(kernels: list[str]) -> list[str]:
    """Names of the reduction kernels that load a dropout mask: they recompute the dropout's
    gradient in float32 inside the sum instead of summing it as stored."""
    return [
        k.split(" = ", 1)[0]
        for k in kernels
        if "tl.sum" in k and any(_LOAD.match(line) and "tl.int1" in line for line in k.splitlines())
    ]


@pytest.mark.parametrize("recipe_name", ["none", "current", "delayed"])
def test_no_reduction_sums_unrounded_gradients(recipe_name):
    assert unrounded_gradient_sums(_kernels(recipe_name, "rounded")) == []
    # the control: without the rounding, the bias gradient's reduction sums them unrounded
    assert unrounded_gradient_sums(_kernels(recipe_name, "plain")) != []


def test_first_compile_sums_the_dropout_gradient_as_stored():
    """Session 50: with hidden dropout, a process's first compile recomputed the dropout's
    gradient inside the MLP bias gradient's sum (float32) where later compiles and eager TE sum
    it stored in bf16 (1 ulp on the GPU at the first step, then apart through DelayedScaling)."""
    assert dropout_gradient_sums(_kernels("current", "rounded", dropout=0.1)) == []
    # the control: rounding only the add's output and its gradient leaves that sum in the first
    # compile
    assert dropout_gradient_sums(_kernels("current", "value-only", dropout=0.1)) != []


# A float32 buffer the size of the layer's residual stream ([128, 2, 256] in _COMPILE)
_FLOAT32_STREAM = re.compile(r"empty_strided_cuda\(\(128, 2, 256\), \([^)]*\), torch\.float32\)")


@pytest.mark.parametrize("recipe_name", ["none", "current"])
def test_no_float32_gradient_buffer_without_dropout(recipe_name):
    """Without hidden dropout the gradient that reaches a bias is its add's output's, rounded
    already. Rounding it a second time made inductor store it in float32 for the bias
    gradient's reduction, and its peak-memory reordering then moved that reduction past the
    attention's backward (TE's guide layer: +256 MiB at the step's peak on an H200, session
    54). No compile allocates such a buffer; the control, the second rounding forced, does."""
    assert not any(
        _FLOAT32_STREAM.search(s) for s in _sources_of(*_layer_compile(recipe_name, "rounded"))
    )
    forced = _sources_of(*_layer_compile(recipe_name, "always"))
    assert any(_FLOAT32_STREAM.search(s) for s in forced)


def _saved_for_backward(rounded: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of what the forward saves for backward, partitioned as inductor partitions
    (min-cut), for two causal TransformerLayers (attention_cases) with Float8CurrentScaling."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from transformer_engine.common import recipe as R

    import te_compile
    from te_compile.modules import transformer_layer

    class NotRounded:
        apply = staticmethod(lambda t: t)

    saved = []

    def forward_compiler(gm, example_inputs):
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        values = [getattr(o, "meta", {}).get("val") for o in outputs]
        saved.extend((tuple(v.shape), v.dtype) for v in values if isinstance(v, torch.Tensor))
        return gm

    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, example_inputs: gm,
        partition_fn=min_cut_rematerialization_partition,
    )
    torch._dynamo.reset()
    with te_compile.simulate_gpu("hopper"):
        original = transformer_layer.StoredAsEager, transformer_layer.GradientStoredAsEager
        if not rounded:
            transformer_layer.StoredAsEager = NotRounded
            transformer_layer.GradientStoredAsEager = NotRounded
        try:
            import transformer_engine.pytorch as te
            from attention_cases import LAYER_CASES, layer_input, make_layer

            torch.manual_seed(0)
            layers = torch.nn.Sequential(*[make_layer(LAYER_CASES["causal"]) for _ in range(2)])
            x = layer_input(LAYER_CASES["causal"])
            recipe = R.Float8CurrentScaling()

            def step(x):
                with te.autocast(recipe=recipe):
                    return layers(x)

            torch.compile(step, backend=backend, fullgraph=True)(x).float().sum().backward()
        finally:
            transformer_layer.StoredAsEager, transformer_layer.GradientStoredAsEager = original
    return saved


@pytest.mark.parametrize("graph_path", [False, True], ids=["te_kernels", "graph_path"])
def test_rounding_saves_nothing_more_for_backward(graph_path, patched):
    """The rounding is an identity in value: the forward keeps the same tensors for backward
    (activation memory unchanged), on TE's kernels and on the graph path; and the forward
    saved FP8 operands (the control that the trace quantized)."""
    from te_compile_testing import graph_fp8

    with graph_fp8(graph_path):
        rounded, plain = _saved_for_backward(True), _saved_for_backward(False)
    assert sorted(rounded, key=str) == sorted(plain, key=str)
    fp8 = (torch.uint8, torch.float8_e4m3fn)  # TE's FP8 storage, aten's FP8 dtype
    assert any(dtype in fp8 for _, dtype in rounded), sorted({str(d) for _, d in rounded})


_EAGER_ADD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
import te_compile
from te_compile.tools.check_inductor import InductorRecorder
from transformer_engine.pytorch.jit import bias_dropout_add

tokens = int(sys.argv[1])
rec = InductorRecorder("hopper")
with te_compile.simulate_gpu("hopper"), rec.context():
    with torch._inductor.config.patch(fallback_random=True):
        x, r = (torch.randn(tokens, 1, 1024, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        add = torch.compile(lambda x, b, r: bias_dropout_add(x, b, r, 0.1, True),
                            backend=rec.backend)
        add(x, b, r).float().sum().backward()
print("SOURCES" + json.dumps(rec.sources))
"""


@pytest.mark.parametrize("tokens,stored", [(64, False), (256, True), (4096, True)])
def test_eager_te_add_sums_the_dropout_gradient_as_stored_from_256_tokens(tokens, stored):
    """Eager TE's bias-dropout-add (TE's own torch.compile'd function, hidden 1024), a fresh
    process: its bias gradient's sum reads the stored dropout gradient (no dropout mask loaded
    in any reduction) at 256 and 4096 tokens, and recomputes it unrounded at 64. Session 50 on
    an H200 (bench/cudagraph_parity.py --against-eager --tokens N, docs/perf/history.md): the
    compiled layer equal to eager TE at 256 and 4096 tokens, the bias gradients 1 ulp apart at
    64. If this fails, torch has moved the boundary: update docs/training.md's entry and
    test_transformer_layer_gpu.py's 64-token xfail."""
    kernels = _kernels_of(_EAGER_ADD, str(tokens))
    assert any("tl.sum" in k for k in kernels)  # the bias gradient's sum was generated
    assert (dropout_gradient_sums(kernels) == []) == stored
