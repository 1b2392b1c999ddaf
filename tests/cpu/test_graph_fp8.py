"""graph_fp8 on CPU: the quantization arithmetic against a NumPy statement of TE's formulas,
and te.Linear's joint graph on the graph path (three aten._scaled_mm, no te_compile op) with a
pretend Hopper GPU. Bit-for-bit agreement with TE's kernels is tests/gpu/test_graph_fp8_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile.graph_fp8 import quantize
from te_compile_testing import JointRecorder, graph_fp8, op_args

FLT_MAX = np.finfo(np.float32).max


def te_scale(amax: float, fp8_max: float, eps: float, pow2: bool) -> np.float32:
    """recipe_common.cuh's compute_scale_from_amax, in NumPy float32 (IEEE division)."""
    amax = np.float32(amax)
    if amax < eps:
        amax = np.float32(eps)
    if np.isinf(amax) or amax == 0 or np.isnan(amax):
        return np.float32(1.0)
    with np.errstate(over="ignore", divide="ignore"):
        scale = np.float32(fp8_max) / amax
    if np.isinf(scale):
        scale = FLT_MAX
    if pow2:
        scale = (np.array(scale).view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)[()]
    return np.float32(scale)


AMAXES = [
    0.0,
    1e-45,
    1e-40,
    1e-38,
    3e-37,
    1e-3,
    0.1,
    1.0,
    3.0,
    7.0,
    447.0,
    448.0,
    449.0,
    57344.0,
    1e30,
    3.4e38,
    float("inf"),
    float("nan"),  # (TE's amax kernel never gives one; compute_scale_from_amax maps it to 1)
]


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("eps,pow2", [(0.0, False), (1e-3, False), (0.0, True), (1e-3, True)])
def test_scale_and_reciprocal_are_tes(fp8, eps, pow2):
    got = quantize.scale_from_amax(torch.tensor(AMAXES), fp8, eps, pow2)
    want = np.array([te_scale(a, quantize.fp8_max(fp8), eps, pow2) for a in AMAXES])
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    with np.errstate(divide="ignore"):
        want_inv = np.float32(1.0) / want
    assert np.array_equal(
        quantize.reciprocal(got).numpy().view(np.uint32), want_inv.view(np.uint32)
    )


def test_scale_division_is_correctly_rounded():
    """Random amaxes: the float64 route gives float32 IEEE quotients (double rounding is
    innocuous for division)."""
    rng = np.random.default_rng(0)
    amaxes = (rng.random(20000) * 2.0 ** rng.integers(-126, 127, 20000)).astype(np.float32)
    got = quantize.scale_from_amax(torch.from_numpy(amaxes), "e4m3", 0.0, False).numpy()
    with np.errstate(over="ignore"):
        want = np.float32(448.0) / amaxes
    want = np.where(np.isinf(want), FLT_MAX, want).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_amax_skips_nan_and_cast_saturates():
    x = torch.tensor([1.0, float("nan"), -3.0, float("inf"), -float("inf"), 500.0, -0.0])
    assert quantize.amax(x).item() == float("inf")
    assert quantize.amax(torch.tensor([float("nan")])).item() == 0.0
    data = quantize.cast(x, torch.tensor([1.0]), "e4m3").float()
    assert data[[0, 2, 3, 4, 5]].tolist() == [1.0, -3.0, 448.0, -448.0, 448.0]
    assert torch.isnan(data[1]) and str(data[6].item()) == "-0.0"


def _amax_cases() -> list[list[torch.Tensor]]:
    """Groups as the graph path hands them to quantize.amaxes: an input and weights of other
    shapes, with NaNs, infinities, denormals, -0 and all-zero tensors, a tensor whose size is
    not a multiple of the row width, and a group too large for one final kernel."""
    torch.manual_seed(0)
    x = torch.randn(48, 64) * 10.0 ** torch.randint(-40, 38, (48, 64))
    w1 = torch.randn(128, 64)
    w2 = torch.randn(64, 128)
    specials = w1.clone()
    specials[3, 5], specials[100, 0] = float("nan"), -float("inf")
    tiny = torch.full((32, 64), 1e-40)
    tiny[7, 7] = -1.4e-45
    nan_only = torch.full((16, 64), float("nan"))
    zeros = -torch.zeros(64, 64)
    odd = torch.randn(3, 7) * 1e3  # 21 elements: read apart
    big = torch.randn(8192, 64)  # over the final kernel's row limit with the others
    return [
        [x, w1],
        [x, w1, w2],
        [x.bfloat16(), specials.bfloat16(), tiny.bfloat16()],
        [nan_only, zeros, w2],
        [x, odd, w1],
        [x, w1, big, w2],
        [x[:, :16], w1],
    ]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_amaxes_equal_each_amax(compiled):
    """quantize.amaxes reads several tensors in one pass: each result equals amax() of that
    tensor alone, bit for bit (inf, NaN skipped, 0 for all-NaN and all-zero tensors)."""
    fn = quantize.amaxes
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    for tensors in _amax_cases():
        got = fn(*tensors)
        assert len(got) == len(tensors)
        for t, a in zip(tensors, got, strict=True):
            want = quantize.amax(t)
            assert a.dtype == torch.float32 and a.shape == (1,)
            assert torch.equal(a.view(torch.int32), want.view(torch.int32)), (t.shape, a, want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_maxima_equal_each_vectors_max(compiled):
    """quantize.maxima finishes DelayedScaling's row maxima in groups (first fit within the
    row limit: here the 6000, 300 and 100 together, the 5000 and 2000 together): each result
    is its vector's own maximum, bit for bit."""
    torch.manual_seed(0)
    vectors = [
        torch.rand(6000) * 1e3,
        torch.rand(5000) * 1e-38,  # denormals
        torch.tensor([0.0, float("inf"), 3.0] * 100),
        torch.zeros(2000),
        torch.rand(100),
    ]
    fn = quantize.maxima
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    got = fn(*vectors)
    for v, m in zip(vectors, got, strict=True):
        assert m.shape == (1,) and torch.equal(m, v.max().reshape(1)), (v.shape, m)


def test_amaxes_group_within_one_kernel_range():
    """Which tensors are read together: static sizes that are multiples of a row width, up to
    the rows one final kernel reduces; the width that needs the fewest groups (an MLP's input
    and both weights: 8704 rows of 1024 need two, 4352 of 2048 one)."""
    groups = quantize._amax_groups
    x, w1, w2 = torch.empty(512, 1024), torch.empty(4096, 1024), torch.empty(1024, 4096)
    assert groups([x, w1]) == ([[0, 1]], 1024)
    assert groups([x, w1, w2]) == ([[0, 1, 2]], 2048)
    assert groups([x, torch.empty(3, 7)])[0] == [[0], [1]]
    assert groups([torch.empty(0, 0), w1])[0] == [[0], [1]]
    big = torch.empty(16 * 8192, 1024)  # over the limit at every width: alone
    assert groups([x, big, w1]) == ([[0, 2], [1]], 1024)


@pytest.mark.parametrize("fn", ["amaxes", "maxima"])
def test_dynamic_sizes_stay_dynamic(fn):
    """A tensor of dynamic size is reduced alone, with no guard on its size: one graph for
    every row count. Deciding whether it fits a group guards on the count, and a few such
    guards had pinned it to one value (session 44: under dynamo `isinstance(n, int)` is True
    for a SymInt; torch 2.11's dynamo then failed inside the graph path's autograd.Function,
    2.14's would have recompiled for every size)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    reduce = getattr(quantize, fn)
    compiled = torch.compile(reduce, backend=counter, fullgraph=True)
    static = torch.rand(4096, 64) if fn == "amaxes" else torch.rand(300)
    for rows in (4096, 2048, 48, 8192):
        dynamic = torch.rand(rows, 64) if fn == "amaxes" else torch.rand(rows)
        torch._dynamo.mark_dynamic(dynamic, 0)
        got, want = compiled(dynamic, static), reduce(dynamic, static)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), rows
    assert counter.frame_count == 1


def test_first_fit_packs_within_the_limit():
    """maxima()'s and amaxes()'s packing: first fit within _ONE_KERNEL_ROWS, sizes of no whole
    number of rows (None) alone."""
    fit, limit = quantize._first_fit, quantize._ONE_KERNEL_ROWS
    assert fit([limit // 2, limit, limit // 2, 1]) == [[0, 2], [1], [3]]
    assert fit([1, None, 1]) == [[0, 2], [1]]
    assert fit([limit + 1, 1]) == [[0], [1]]


def test_stored_rounds_float32_as_a_bfloat16_store():
    from te_compile.graph_fp8.quantize import stored_bf16 as _stored

    torch.manual_seed(0)
    specials = [0.0, -0.0, 1.0, 3.0e38, 3.3895314e38, 3.4e38, float("inf"), -float("inf"), 1e-40]
    x = torch.cat(
        [torch.randn(10000) * 10.0 ** torch.randint(-30, 30, (10000,)), torch.tensor(specials)]
    )
    want = x.to(torch.bfloat16).float()
    assert torch.equal(_stored(x).view(torch.int32), want.view(torch.int32))
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(_stored(nans)).all()
    assert torch.equal(_stored(want.to(torch.bfloat16)), want)  # bfloat16 in: unchanged


def _rounding_adversaries() -> torch.Tensor:
    """float32 values where a bfloat16 store rounds: ties both ways, carries into the
    exponent, values that round to infinity, denormals, NaN and infinities."""
    torch.manual_seed(0)
    wide = torch.randn(20000) * 10.0 ** torch.randint(-40, 39, (20000,))
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), dtype=torch.int32)
    ties = ((bits & -65536) | 0x8000).view(torch.float32)  # exactly halfway
    specials = [3.3895314e38, 3.39e38, 3.4e38, 1e-40, -1e-45, 0.0, -0.0, float("inf")]
    x = torch.cat([wide, ties, torch.tensor(specials)])
    return torch.where(torch.isnan(x), torch.zeros_like(x), x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("extra", ["none", "nan", "inf", "all_nan", "one_tie"])
def test_stored_amax_is_the_rounded_amax(extra, compiled):
    """quantize_current(x, stored=True) rounds the amax once instead of every element: the same
    scale and FP8 data as quantizing the rounded tensor (tested on the GPU against TE)."""
    x = _rounding_adversaries()
    if extra == "nan":
        x[7] = float("nan")
    elif extra == "inf":
        x[7] = -float("inf")
    elif extra == "all_nan":
        x = torch.full((64,), float("nan"))
    elif extra == "one_tie":  # the amax itself a tie that rounds up into the next binade
        x = torch.tensor([1.0, -(2.0 - 2.0**-8 - 2.0**-9), 0.5])

    def rounded_first(x, fp8, eps, pow2):
        return quantize.quantize_current(quantize.stored_bf16(x), fp8, eps, pow2)

    fn, want_fn = quantize.quantize_current, rounded_first
    if compiled:  # both compiled: a NaN's sign after the cast is the backend's own
        torch._dynamo.reset()
        fn, want_fn = torch.compile(fn, fullgraph=True), torch.compile(want_fn, fullgraph=True)
    for fp8 in ("e4m3", "e5m2"):
        for eps, pow2 in ((0.0, False), (1e-3, True)):
            data, scale_inv = fn(x, fp8, eps, pow2, True)
            want_data, want_si = want_fn(x, fp8, eps, pow2)
            assert torch.equal(scale_inv.view(torch.int32), want_si.view(torch.int32))
            assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))


# ---- te.Linear on the graph path, joint graph on meta with a pretend Hopper --------------------


def _linear(monkeypatch, bias: bool, in_f=64, out_f=32):
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        linear = te.Linear(in_f, out_f, bias=bias, params_dtype=torch.bfloat16, device="meta")
    linear.weight = torch.nn.Parameter(
        torch.empty(out_f, in_f, device="meta", dtype=torch.bfloat16)
    )
    if bias:
        linear.bias = torch.nn.Parameter(torch.empty(out_f, device="meta", dtype=torch.bfloat16))
    return linear


def _compile_step(linear, recipe, x):
    rec = JointRecorder()

    def fn(x):
        with te.autocast(recipe=recipe):
            return linear(x)

    torch.compile(fn, backend=rec.backend, fullgraph=True)(x).sum().backward()
    return rec


@pytest.mark.parametrize("bias", [True, False])
def test_linear_graph_path_joint_graph(bias, patched, fake_gpu, graph_breaks, monkeypatch):
    fake_gpu("hopper")
    linear = _linear(monkeypatch, bias)
    x = torch.empty(4, 8, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with graph_fp8():
        rec = _compile_step(linear, R.Float8CurrentScaling(), x)
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    fw, bw = rec.targets(rec.fw), rec.targets(rec.bw)
    # No TE-kernel op; the bias gradient is ATen's row sum (te_compile::bias_grad), as TE's.
    assert not any("te_compile" in t for t in fw)
    assert [t for t in bw if "te_compile" in t] == ["te_compile.bias_grad.default"] * bias
    assert sum("_scaled_mm" in t for t in fw) == 1 and sum("_scaled_mm" in t for t in bw) == 2
    assert x.grad.shape == x.shape and linear.weight.grad.shape == (32, 64)
    assert (linear.bias.grad is not None) == bias


def test_graph_path_leaves_other_recipes_to_te_ops(patched, fake_gpu, monkeypatch):
    """Recipes the graph path does not implement run on TE's kernels, as without the option."""
    fake_gpu("hopper")
    linear = _linear(monkeypatch, bias=True)
    x = torch.empty(32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with graph_fp8():
        rec = _compile_step(linear, R.Float8BlockScaling(), x)
    assert rec.targets(rec.fw).count("te_compile.linear_fwd.default") == 1


def test_unaligned_shapes_stay_on_te_ops(patched, fake_gpu, monkeypatch):
    fake_gpu("hopper")
    linear = _linear(monkeypatch, bias=False, out_f=40)  # 40: not a multiple of 16
    x = torch.empty(32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with graph_fp8():
        rec = _compile_step(linear, R.Float8CurrentScaling(), x)
    assert rec.targets(rec.fw).count("te_compile.linear_fwd.default") == 1


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_delayed_scaling_graph_path_joint_graph(
    fused, bias, patched, fake_gpu, graph_breaks, monkeypatch
):
    """DelayedScaling on the graph path: the forward quantizes in aten ops with a snapshot of
    TE's scales and merges amaxes into TE's history; the backward graph runs the module's
    backward amax/scale update as graph operations writing TE's history and scale (two copy_
    at its end), besides the two scaled GEMMs. With TE's Python update asked for
    (NVTE_UNFUSED_FP8_UPDATE=1), TE's update through te_compile's op, after a scale snapshot."""
    from te_compile_testing import build_without_gpu, op_targets, recipe_state_on

    fake_gpu("hopper")
    if not fused:
        monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", "1")
    with recipe_state_on("meta"), graph_fp8():
        linear = build_without_gpu(
            lambda: te.Linear(64, 32, bias=bias, params_dtype=torch.bfloat16, device="meta"),
            "meta",
        )
        x = torch.empty(32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        rec = _compile_step(linear, R.DelayedScaling(amax_history_len=4), x)
    assert graph_breaks() == 0 and len(rec.fw) == 1 and len(rec.bw) == 1
    fw, bw = op_targets(rec.fw), op_targets(rec.bw)
    assert "te_compile.linear_fwd.default" not in fw and "te_compile.linear_bwd.default" not in bw
    assert sum("_scaled_mm" in t for t in fw) == 1 and sum("_scaled_mm" in t for t in bw) == 2
    update = "te_compile.amax_and_scale_update.default"
    assert fw.count(update) == 1  # the autocast exit's forward update, as on the TE-kernel path
    in_graph = fused
    assert bw.count(update) == (0 if in_graph else 1)
    # The backward scales' read: TE's fused dbias cast (a biased Linear) reads TE's tensor, an
    # inductor-made cast (no bias) a select tied to the gradient (graph_fp8.delayed.read_with;
    # tests/cpu/test_deferred_update_trace.py), where the update is graph operations; a copy
    # where TE's update op follows in the graph
    assert bw.count("te_compile.scale_in_backward.default") == (0 if in_graph else 1)
    assert bw.count("te_compile.delayed_grad_quantize.default") == int(bias)
    assert rec.targets(rec.bw).count("aten.copy_.default") == 2  # (the op's, functionalized)


def test_configure_after_compiling_recompiles(patched):
    """Dynamo guards on the option: a compiled function traced without it traces again."""
    from torch._dynamo.testing import CompileCounterWithBackend

    with te_compile.simulate_gpu("hopper"):
        linear = te.Linear(64, 64, params_dtype=torch.bfloat16).cuda()
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        counter = CompileCounterWithBackend("aot_eager")

        def fn(x):
            with te.autocast(recipe=R.Float8CurrentScaling()):
                return linear(x)

        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        compiled(x)
        with graph_fp8():
            compiled(x)
            compiled(x)
        assert counter.frame_count == 2


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_graph_path_inside_te_checkpoint(recipe_name, patched, graph_breaks):
    """4 TransformerLayers under te.distributed.checkpoint, compiled whole with graph_fp8: their
    te.Linear projections, LayerNormLinear and LayerNormMLP take the graph path, 0 graph
    breaks, and DelayedScaling's forward scale snapshot is saved, not recomputed (the recompute
    quantizes with the original forward's scales)."""
    from test_checkpoint_trace import te_ops, trace

    with graph_fp8():
        rec = trace(recipe_name, "te")
    assert graph_breaks() == 0 and (len(rec.fw), len(rec.bw)) == (1, 1)
    fw, bw = te_ops(rec.fw), te_ops(rec.bw)
    assert "linear_fwd" not in fw + bw
    assert "layernorm_linear_fwd" not in fw
    assert "layernorm_mlp_fwd" not in fw
    assert any("_scaled_mm" in t for t in rec.targets(rec.fw))
    if recipe_name == "delayed":
        # no forward snapshot is recomputed (the backward updates in graph operations, which
        # need no snapshot of their own)
        assert "scale_snapshot" in fw and "scale_snapshot" not in bw, bw


def test_dynamic_row_count_stays_on_the_graph_path(patched, fake_gpu, graph_breaks, monkeypatch):
    """A dynamic batch dimension (multiples of 16) keeps the graph path (one graph)."""
    fake_gpu("hopper")
    linear = _linear(monkeypatch, bias=False)
    rec = JointRecorder()

    def fn(x):
        with te.autocast(recipe=R.Float8CurrentScaling()):
            return linear(x)

    compiled = torch.compile(fn, backend=rec.backend, fullgraph=True, dynamic=True)
    with graph_fp8():
        for rows in (32, 48):
            x = torch.empty(rows, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
            compiled(x).sum().backward()
    assert graph_breaks() == 0
    assert len(rec.fw) == 1, "one dynamic graph for both row counts"
    assert sum("_scaled_mm" in t for t in rec.targets(rec.fw)) == 1


MODULES = {
    "Linear": lambda: te.Linear(64, 64, params_dtype=torch.bfloat16),
    "LayerNormLinear": lambda: te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
@pytest.mark.parametrize("module", list(MODULES))
def test_varying_row_counts_in_default_mode(module, recipe_name, patched, graph_breaks):
    """Batches of 32, 48, 40 and 24 rows in torch.compile's default mode, as a loader of varying
    lengths gives them: the second shape makes the rows dynamic, still on the graph path (one
    recompile); 40 rows, no multiple of 16, fail that graph's divisibility guard and recompile
    onto TE's kernels (until session 27 that trace broke: the graph path's reason string held
    the symbolic row count); 24 reuses it."""
    recipe = {"current": R.Float8CurrentScaling, "delayed": R.DelayedScaling}[recipe_name]()
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"), graph_fp8():
        layer = MODULES[module]().cuda()
        seq = torch.nn.Sequential(layer, torch.nn.GELU(), MODULES[module]().cuda())

        def step(x):
            with te.autocast(recipe=recipe):
                return seq(x)

        compiled = torch.compile(step, backend=rec.backend, fullgraph=True)
        for rows in (32, 48, 40, 24):
            x = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            compiled(x).float().sum().backward()
            assert x.grad.shape == x.shape
    assert graph_breaks() == 0
    assert len(rec.fw) == 3, "a recompile per row count, or none for 40"
    on_graph_path = [any("_scaled_mm" in t for t in rec.targets([gm])) for gm in rec.fw]
    assert on_graph_path == [True, True, False]
    assert any(
        t.startswith("te_compile.") and t.endswith("_fwd.default") for t in rec.targets(rec.fw[2:])
    )


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "block"])
def test_dynamic_true_on_tes_kernels(recipe_name, patched, graph_breaks):
    """torch.compile(dynamic=True) makes a recipe's float fields symbolic (amax epsilon,
    margin); the op config encodes TE's default 0.0 as a constant (a guard), so 40 and 56 rows
    (no multiples of 16: TE's kernels) share one graph. Before session 27: 'tp_repr_impl not
    implemented' (torch 2.14), 'repr with argument types float' (2.11)."""
    recipe = {
        "current": R.Float8CurrentScaling,
        "delayed": R.DelayedScaling,
        "block": R.Float8BlockScaling,
    }[recipe_name]()
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"):
        seq = torch.nn.Sequential(MODULES["Linear"]().cuda(), MODULES["LayerNormMLP"]().cuda())

        def step(x):
            with te.autocast(recipe=recipe):
                return seq(x)

        compiled = torch.compile(step, backend=rec.backend, fullgraph=True, dynamic=True)
        for rows in (40, 56):
            x = torch.randn(rows, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            compiled(x).float().sum().backward()
    assert graph_breaks() == 0 and len(rec.fw) == 1
    configs = [
        op_args(n)["config"]
        for gm in rec.fw
        for n in gm.graph.nodes
        if str(n.target).endswith("_fwd.default") and str(n.target).startswith("te_compile.")
    ]
    assert len(configs) == 2 and all(f"kind={recipe_name}" in c for c in configs), configs


def test_split_parameters_and_return_bias_on_the_graph_path(patched, graph_breaks):
    """parameters_split: the split weights are concatenated in the graph and each gets its slice
    of the gradient; return_bias: the bias comes back unadded, as eager TE returns it."""
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"), graph_fp8():
        linear = te.Linear(
            64,
            32,
            params_dtype=torch.bfloat16,
            parameters_split={"a": 16, "b": 16},
            return_bias=True,
        ).cuda()

        def fn(x):
            with te.autocast(recipe=R.Float8CurrentScaling()):
                out, bias = linear(x)
            return out.float().sum() + bias.float().sum()

        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.compile(fn, backend=rec.backend, fullgraph=True)(x).backward()
    assert graph_breaks() == 0
    assert sum("_scaled_mm" in t for t in rec.targets(rec.fw)) == 1
    assert linear.a_weight.grad.shape == (16, 64) and linear.b_weight.grad.shape == (16, 64)
    assert linear.a_bias.grad.shape == (16,)
