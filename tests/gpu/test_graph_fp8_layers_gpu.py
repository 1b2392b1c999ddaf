"""GPU tests of graph_fp8 beyond te.Linear (te_compile.configure(graph_fp8=True) with
Float8CurrentScaling and DelayedScaling): TE's GELU as inductor compiles it, over every
bfloat16 input; the bias gradient against TE's bgrad; LayerNormMLP, LayerNormLinear and
TransformerLayer trained compiled on the graph path against eager TE, bit for bit.

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_graph_fp8_layers_gpu.py -m gpu -q
"""

from __future__ import annotations

import pytest
import test_transformer_layer_gpu as layer_tests
import torch
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.common import recipe as R
from transformer_engine.pytorch import quantization as q
from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

import te_compile
from te_compile.graph_fp8 import mlp
from te_compile_testing import graph_fp8

pytestmark = pytest.mark.gpu
FGS = q.FP8GlobalStateManager


def _every_bfloat16() -> torch.Tensor:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).cuda().reshape(256, 256)


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    same = (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))
    return int((~same).sum())


def test_gelu_is_tes_on_every_bfloat16():
    """Inductor's float32 GELU against TE's kernel on float32 copies of all 65,536 bfloat16
    values (TE's kernels compute in float32 whatever they read): 0 differ. Eager PyTorch
    differed on 6 until session 29 left the polynomial's FMA to the compiler; it is now one
    rounding in float64 (quantize.fused_multiply_add), eagerly too (not re-measured). (The
    GELU's gradient is TE's kernel on the graph path: bench/dgelu_formula.py says why.)"""
    x = _every_bfloat16().float()
    assert _differing(torch.compile(mlp.gelu)(x), tex.gelu(x, None)) == 0


def test_gelu_quantized_as_te_fuses_it():
    """tex.gelu with a current-scaling quantizer (amax of the float32 GELU, cast of its bf16
    value) against the graph's: data and scale_inv bit for bit, at scales where the amax's
    bf16 rounding matters."""
    from te_compile.recipes import QuantConfig

    cfg = QuantConfig(kind="current")
    fn = torch.compile(lambda h: mlp._quantized_gelu(h, cfg))
    for scale in (0.01, 3.0, 300.0):
        torch.manual_seed(0)
        h = (torch.randn(1024, 4096, device="cuda") * scale).to(torch.bfloat16)
        quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, h.device)
        want = tex.gelu(h, quantizer)
        data, scale_inv = fn(h)
        assert torch.equal(data.view(torch.uint8), want._data)
        assert torch.equal(scale_inv, want._scale_inv.reshape(1))


def test_activation_grad_is_tes_dgelu(patched):
    """te_compile::activation_grad (the graph path's GELU gradient with Float8CurrentScaling)
    against `tex.dgelu` bit for bit, and opcheck on the real kernel."""
    torch.manual_seed(0)
    grad = (torch.randn(512, 1024, device="cuda") * 1e-3).to(torch.bfloat16)
    act_input = (torch.randn(512, 1024, device="cuda") * 3).to(torch.bfloat16)
    got = torch.ops.te_compile.activation_grad(grad, act_input, "gelu")
    assert torch.equal(got, tex.dgelu(grad, act_input, None))
    torch.library.opcheck(torch.ops.te_compile.activation_grad.default, (grad, act_input, "gelu"))


@pytest.mark.parametrize("shape", [(64, 128), (1000, 3072), (8192, 1024)])
def test_bias_grad_is_tes_bgrad(shape, patched):
    """te_compile::bias_grad against tex.bgrad_quantize's dbias (current scaling: at::sum_out),
    on values whose float32 sum depends on the order of additions."""
    torch.manual_seed(0)
    dy = torch.randn(shape, device="cuda") * 10.0 ** torch.randint(-3, 4, shape, device="cuda")
    dy = dy.to(torch.bfloat16)
    quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E5M2, dy.device)
    want, _ = tex.bgrad_quantize(dy, quantizer)
    got = torch.compile(lambda t: torch.ops.te_compile.bias_grad(t * 1))(dy)
    assert torch.equal(got, want)


@pytest.mark.parametrize("act", ["", "gelu"])
def test_delayed_grad_quantize_is_tes_kernel(act, patched):
    """te_compile::delayed_grad_quantize against TE's own call (tex.bgrad_quantize, or
    tex.dbias_dgelu, with a Float8Quantizer of both usages): dbias, data, transpose, scale_inv
    and the recorded amax bit for bit; and opcheck on the real kernel."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    from te_compile.recipes import for_linear

    torch.manual_seed(0)
    grad = (torch.randn(1024, 768, device="cuda") * 3).to(torch.bfloat16)
    act_input = torch.randn_like(grad) if act else None
    scales = torch.tensor([5.0, 7.0, 9.0], device="cuda")  # the op reads slot 1
    scale = scales[1:2]
    key = for_linear(R.DelayedScaling(), fp8_transpose=True).key
    got = torch.ops.te_compile.delayed_grad_quantize(grad, act_input, scales, 1, key, act)
    amax = torch.zeros(1, device="cuda")
    quantizer = Float8Quantizer(scale.clone(), amax, tex.DType.kFloat8E5M2)
    if act:
        dbias, q = tex.dbias_dgelu(grad, act_input, quantizer)
    else:
        dbias, q = tex.bgrad_quantize(grad, quantizer)
    want = (dbias, q._data, q._transpose, q._scale_inv.view(1), amax)
    for i, (u, v) in enumerate(zip(got, want, strict=True)):
        u = u.view(torch.uint8) if u.element_size() == 1 else u
        assert torch.equal(u, v), f"output {i}"
    args = (grad, act_input, scales, 1, key, act)
    torch.library.opcheck(torch.ops.te_compile.delayed_grad_quantize.default, args)


def _train(m, recipe, compiled: bool, make_input, steps: int, state=lambda m: []) -> list:
    """`steps` SGD steps of `m` under `recipe` (compiled or eager TE): per step the output, the
    input's and every parameter's gradient, then `state(m)`."""
    opt = torch.optim.SGD(m.parameters(), lr=0.05)

    def fn(x):
        with te.autocast(recipe=recipe):
            return m(x)

    fn = torch.compile(fn, fullgraph=True) if compiled else fn
    records = []
    torch.manual_seed(1)
    for step in range(steps):
        x = make_input(step).requires_grad_()
        y = fn(x)
        y.backward(torch.randn_like(y))
        records.append([y.detach().clone(), x.grad.clone()])
        records[-1] += [p.grad.clone() for p in m.parameters()] + state(m)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return records


def _assert_identical(got: list, want: list) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(u, v), f"step {step} tensor {i}: {(u - v).abs().max()}"


def _fresh(seed: int = 0) -> None:
    torch._dynamo.reset()
    FGS.reset()
    torch.manual_seed(seed)


def _delayed_state(m) -> list:
    """TE's amax histories and scales of both directions (DelayedScaling)."""
    te_compile.flush_delayed_updates()  # what compiled modules left to the exit
    metas = (m.fp8_meta[key] for key in ("scaling_fwd", "scaling_bwd"))
    return [t.clone() for meta in metas for t in (meta.amax_history, meta.scale)]


def _train_mlp(
    compiled: bool, normalization: str, bias: bool, recipe="current", steps: int = 3, hidden=256
):
    _fresh()
    m = te.LayerNormMLP(
        hidden, 4 * hidden, bias=bias, normalization=normalization, params_dtype=torch.bfloat16
    )
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))

    def make_input(step):  # growing scale: DelayedScaling's scales move
        rows = 128 if hidden == 256 else 2048
        x = torch.randn(rows // 4, 4, hidden, device="cuda", dtype=torch.bfloat16)
        return x * (1 + step)

    if recipe == "delayed":
        return _train(
            m, R.DelayedScaling(amax_history_len=4), compiled, make_input, steps, _delayed_state
        )
    return _train(m, R.Float8CurrentScaling(), compiled, make_input, steps)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layernorm_mlp_trains_as_eager_te(normalization, bias, patched):
    """te.LayerNormMLP (GELU), 3 SGD steps compiled on the graph path against eager TE: output,
    input gradient and every parameter gradient bit-identical at every step."""
    want = _train_mlp(False, normalization, bias)
    with graph_fp8():
        got = _train_mlp(True, normalization, bias)
    _assert_identical(got, want)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_large_layernorm_mlp_trains_as_eager_te(recipe, bias, patched):
    """H=2048, FFN 8192, 2048 rows (the benchmark's TransformerLayer MLP): the FC weights, FC2's
    input and FC1's grad_output are large enough for TE's transpose kernel, their copies made
    beside their GEMMs (te_compile::scaled_mm_transposing). 3 SGD steps against eager TE."""
    want = _train_mlp(False, "LayerNorm", bias, recipe, steps=3, hidden=2048)
    with graph_fp8():
        got = _train_mlp(True, "LayerNorm", bias, recipe, steps=3, hidden=2048)
    _assert_identical(got, want)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_delayed_layernorm_mlp_trains_as_eager_te(normalization, bias, patched):
    """DelayedScaling's LayerNormMLP on the graph path (the norm's, GELU's and, without biases,
    the GELU gradient's float32 values cast in the graph; with biases TE's fused dbias kernels),
    4 SGD steps with inputs of growing scale against eager TE: output, input and every
    parameter gradient, amax histories and scales bit-identical at every step."""
    want = _train_mlp(False, normalization, bias, "delayed", steps=4)
    got = _train_mlp(True, normalization, bias, "delayed", steps=4)  # the default path
    _assert_identical(got, want)
    assert not torch.equal(want[-1][-2], want[0][-2]), "the backward history never moved"


def _train_ln_linear(compiled: bool, normalization: str, zcg: bool, bias=False, steps: int = 4):
    """te.LayerNormLinear trained with DelayedScaling: per step the output, gradients and TE's
    amax histories and scales."""
    _fresh()
    m = te.LayerNormLinear(
        256,
        512,
        bias=bias,
        normalization=normalization,
        zero_centered_gamma=zcg,
        params_dtype=torch.bfloat16,
    )
    with torch.no_grad():
        m.layer_norm_weight.add_(0.1 * torch.randn_like(m.layer_norm_weight))

    def make_input(step):  # growing scale: the scales move
        return torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16) * (1 + step)

    recipe = R.DelayedScaling(amax_history_len=4)
    return _train(m, recipe, compiled, make_input, steps, _delayed_state)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize(
    "zcg,bias",
    [(False, False), (True, False), (False, True)],
    ids=["gamma", "zero_centered", "bias"],
)
def test_delayed_layernorm_linear_trains_as_eager_te(normalization, zcg, bias, patched):
    """DelayedScaling's fused norm + cast quantizes the norm's float32 value; the graph path
    recomputes it from TE's mu/rsigma (graph_fp8/norm.py); a bias's gradient comes from TE's
    fused dbias + cast kernel. 4 SGD steps with inputs of growing scale (the scales move)
    against eager TE: outputs, gradients, amax histories and scales bit-identical at every
    step."""
    want = _train_ln_linear(False, normalization, zcg, bias)
    with graph_fp8():
        got = _train_ln_linear(True, normalization, zcg, bias)
    _assert_identical(got, want)
    assert not torch.equal(want[-1][-2], want[0][-2]), "the backward history never moved"


# TransformerLayer option sets (tests/attention_cases.py) whose LayerNormLinear and LayerNormMLP
# take the graph path (RMSNorm + SwiGLU: the QKV projection only), compared with eager TE by
# test_transformer_layer_gpu.py's check (eager's bf16 rounding of the elementwise code between
# TE's kernels, as its bit-identical tests run).
LAYER_CASES = ["causal", "rope", "no_bias", "post_layernorm_residual", "rmsnorm_swiglu"]


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
@pytest.mark.parametrize("case_name", LAYER_CASES)
def test_transformer_layer_on_graph_path_matches_eager(
    case_name, recipe_name, patched, monkeypatch
):
    """Two SGD steps of a TransformerLayer, compiled on the graph path: bit-identical to eager
    TE (outputs, input and parameter gradients)."""
    with graph_fp8():
        layer_tests.check(case_name, recipe_name, monkeypatch, n=2, lr=0.01)


def test_transformer_layer_graph_path_is_fp8(patched):
    """The graph path quantizes: its output differs from the same layer without FP8."""
    with graph_fp8():
        fp8 = layer_tests.steps("causal", "current", True)
    bf16 = layer_tests.steps("causal", "none", True)
    assert not torch.equal(fp8[0]["out"], bf16[0]["out"])


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_stack_eager_then_compiled_then_cuda_graphs(recipe_name, patched):
    """Three TransformerLayers trained as users do: 2 eager steps, 2 compiled (graph path), 2
    under reduce-overhead, against 6 eager TE steps: losses and every gradient bit-identical
    (eager's rounding in inductor: see test_transformer_layer_gpu.py). DelayedScaling's state
    carries over from eager TE's steps to the compiled ones."""
    import torch._inductor.config as inductor_config

    def run(modes):
        torch._dynamo.reset()
        FGS.reset()
        torch.manual_seed(0)
        layers = torch.nn.Sequential(
            *[
                te.TransformerLayer(
                    128,
                    512,
                    4,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    self_attn_mask_type="causal",
                    params_dtype=torch.bfloat16,
                    seq_length=128,
                )
                for _ in range(3)
            ]
        )
        opt = torch.optim.SGD(layers.parameters(), lr=0.01)
        recipe = R.Float8CurrentScaling() if recipe_name == "current" else R.DelayedScaling()

        def step(x):
            with te.autocast(recipe=recipe):
                return layers(x)

        fns = {
            "eager": step,
            "default": torch.compile(step, fullgraph=True),
            "reduce-overhead": torch.compile(step, fullgraph=True, mode="reduce-overhead"),
        }
        out = []
        torch.manual_seed(1)
        for mode in modes:
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            x = torch.randn(128, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            # The loss outside the compiled step: inductor's mean would sum in its own order.
            loss = fns[mode](x).float().square().mean()
            loss.backward()
            out.append([loss.detach().clone(), x.grad.clone()])
            out[-1] += [p.grad.clone() for p in layers.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out

    with inductor_config.patch(layer_tests.EAGER_ROUNDING):
        want = run(["eager"] * 6)
        with graph_fp8():
            got = run(["eager"] * 2 + ["default"] * 2 + ["reduce-overhead"] * 2)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(u, v), f"step {step} tensor {i}: {(u - v).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_transpose_is_the_transpose(dtype, patched):
    """te_compile::fp8_transpose (TE's transpose kernel) gives the transposed bytes."""
    torch.manual_seed(0)
    data = torch.randint(0, 256, (4096, 4352), device="cuda", dtype=torch.uint8).view(dtype)
    got = torch.ops.te_compile.fp8_transpose(data)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), data.view(torch.uint8).t())


@pytest.mark.parametrize("transpose_b", [True, False], ids=["b", "a"])
def test_scaled_mm_transposing_is_the_gemm_and_the_transpose(transpose_b, patched):
    """te_compile::scaled_mm_transposing: aten's _scaled_mm as the graph calls it, bit for bit,
    and the transposed bytes of the operand asked for."""
    torch.manual_seed(0)
    a = torch.randn(512, 1024, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(768, 1024, device="cuda").to(torch.float8_e4m3fn)
    a_si, b_si = torch.full((1,), 0.5, device="cuda"), torch.full((1,), 0.25, device="cuda")
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    y, copy = torch.ops.te_compile.scaled_mm_transposing(
        a, a_si, b, b_si, bias, torch.bfloat16, True, transpose_b
    )
    want = torch.ops.aten._scaled_mm(
        a, b.t(), a_si, b_si, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True
    )
    assert torch.equal(y, want)
    src = b if transpose_b else a
    assert torch.equal(copy.view(torch.uint8), src.view(torch.uint8).t())
