"""FP8 primary weights (te.quantized_model_init) under torch.compile(fullgraph=True), traced
without a GPU (te_compile.simulate_gpu): te.Linear, te.LayerNormLinear, te.LayerNormMLP and
te.TransformerLayer per Hopper recipe TE's quantized_model_init supports (DelayedScaling,
Float8CurrentScaling, Float8BlockScaling), forward + backward.

TE's own quantize kernels cannot run on meta tensors, so modules are built under
quantized_model_init on device="meta" (TE then defers the quantization: the module has its
FP8 metadata and `primary_weights_in_fp8`, the weights stay plain) and their GEMM weights are
replaced by Float8Tensor / Float8BlockwiseQTensor parameters over meta tensors, made with the
module's own weight quantizer as TE's reset_parameters makes them.

Checked: 0 graph breaks, one graph over two steps, the GEMM op reads the parameter's FP8 parts
(graph inputs; no weight quantization) and gets the gradient carrier (stride 0) as its weight,
and the gradient reaches param.grad (the carrier's own stays None); the carrier's hand-over
with real values on CPU tensors."""

from __future__ import annotations

import copy

import pytest
import torch
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.common import recipe as R
from transformer_engine.pytorch.constants import DType
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer, Float8Tensor

import te_compile
from te_compile.modules import fp8_params
from te_compile_testing import JointRecorder, op_args

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

RECIPES = {
    "delayed": R.DelayedScaling,
    "current": R.Float8CurrentScaling,
    "block": R.Float8BlockScaling,
}
H, FFN, TOKENS = 128, 256, 64
BF16 = torch.bfloat16
GEMM_FWD = {
    # (weight arguments, weight cache arguments)
    "te_compile.linear_fwd.default": (["weight"], ["weight_cache"]),
    "te_compile.layernorm_linear_fwd.default": (["weight"], ["weight_cache"]),
    "te_compile.layernorm_mlp_fwd.default": (
        ["fc1_weight", "fc2_weight"],
        ["fc1_cache", "fc2_cache"],
    ),
}


def fp8_parameter(module, name: str, *, transpose=True, columnwise=True):
    """Replace `module.<name>` by an FP8 parameter over meta tensors (see the docstring)."""
    old = getattr(module, name)
    q = module.quantizers["scaling_fwd"][module.param_init_meta[name].fp8_meta_index]
    q.set_usage(rowwise=True, columnwise=True)
    q.internal = False
    shape = tuple(old.shape)

    def empty(s, dtype=torch.uint8):
        return torch.empty(s, dtype=dtype, device="meta")

    if isinstance(q, Float8Quantizer) or type(q).__name__ == "Float8CurrentScalingQuantizer":
        t = Float8Tensor(
            shape=shape,
            dtype=old.dtype,
            data=empty(shape),
            fp8_scale_inv=empty([1], torch.float32),
            fp8_dtype=q.dtype,
            data_transpose=empty(shape[::-1]) if transpose else None,
            quantizer=q,
            requires_grad=old.requires_grad,
        )
    else:
        t = Float8BlockwiseQTensor(
            shape=shape,
            dtype=old.dtype,
            rowwise_data=empty(shape),
            rowwise_scale_inv=empty(q.get_scale_shape(shape, columnwise=False), torch.float32),
            columnwise_data=empty(shape[::-1]) if columnwise else None,
            columnwise_scale_inv=(
                empty(q.get_scale_shape(shape, columnwise=True), torch.float32)
                if columnwise
                else None
            ),
            fp8_dtype=q.dtype,
            quantizer=q,
            is_2D_scaled=q.block_scaling_dim == 2,
            requires_grad=old.requires_grad,
        )
    setattr(module, name, torch.nn.Parameter(t, requires_grad=old.requires_grad))


def fp8_model(make, recipe, **kw):
    """`make()` built under quantized_model_init(recipe) with FP8 GEMM weights (see above)."""
    with te.quantized_model_init(enabled=True, recipe=recipe):
        model = make()
    for m in model.modules():
        if isinstance(m, (te.Linear, te.LayerNormLinear, te.LayerNormMLP)):
            assert m.primary_weights_in_fp8
            for name in fp8_params.fp8_weight_names(m):
                fp8_parameter(m, name, **kw)
    return model


def linear():
    return te.Linear(H, H, params_dtype=BF16, device="meta")


def mlp():
    return te.LayerNormMLP(H, FFN, params_dtype=BF16, device="meta")


def ln_linear():
    return te.LayerNormLinear(H, H, params_dtype=BF16, device="meta")


def fp8_weights(model) -> list:
    return [p for p in model.parameters() if isinstance(p, (Float8Tensor, Float8BlockwiseQTensor))]


def train(model, recipe, steps=2, rec=None, **call):
    rec = rec or JointRecorder()
    step = torch.compile(model, backend=rec.backend, fullgraph=True)
    for _ in range(steps):
        x = torch.randn(TOKENS, H, device="cuda", dtype=BF16, requires_grad=True)
        with te.autocast(recipe=recipe):
            out = step(x, **call)
        out.float().sum().backward()
        assert x.grad.shape == x.shape
    return rec


def gemm_nodes(graphs):
    return [n for gm in graphs for n in gm.graph.nodes if str(n.target) in GEMM_FWD]


def check_reads_fp8_parts(rec, in_graph_transpose=False):
    """Every GEMM op gets carriers (stride 0) as weights and FP8 parts as its weight caches."""
    nodes = gemm_nodes(rec.fw)
    assert nodes and "te_compile.quantize_weight.default" not in JointRecorder.targets(rec.fw)
    for node in nodes:
        weights, caches = GEMM_FWD[str(node.target)]
        args = op_args(node)
        for name in weights:
            carrier = args[name]
            assert carrier.op == "placeholder" and set(carrier.meta["val"].stride()) == {0}
        for name in caches:
            parts = args[name]
            assert parts and {p.meta["val"].dtype for p in parts} <= {torch.uint8, torch.float32}
            computed = [p for p in parts if p.op != "placeholder"]
            assert len(computed) == int(in_graph_transpose), computed


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("make", [linear, ln_linear, mlp], ids=["linear", "ln_linear", "mlp"])
def test_fp8_params_train_fullgraph(make, name, patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        recipe = RECIPES[name]()
        model = fp8_model(make, recipe)
        params = fp8_weights(model)
        rec = train(model, recipe, steps=1)
        grads = [p.grad for p in params]
        assert all(
            g is not None and g.shape == p.shape and g.dtype == BF16
            for g, p in zip(grads, params, strict=True)
        )
        assert all(type(g) is torch.Tensor for g in grads)
        train(model, recipe, steps=1, rec=rec)  # a second step: accumulates, no recompile
    assert graph_breaks() == 0 and (len(rec.fw), len(rec.bw)) == (1, 1)
    check_reads_fp8_parts(rec)
    for p, g in zip(params, grads, strict=True):
        assert p.grad is g, "the second backward accumulates into the same gradient"
        assert getattr(p, fp8_params.CARRIER_ATTR).tensor.grad is None


@pytest.mark.parametrize("name", list(RECIPES))
def test_transformer_layer_fp8_params(name, patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        recipe = RECIPES[name]()
        layer = fp8_model(
            lambda: te.TransformerLayer(
                H,
                FFN,
                4,
                params_dtype=BF16,
                device="meta",
                fuse_qkv_params=True,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            ),
            recipe,
        )
        rec = JointRecorder()
        step = torch.compile(layer, backend=rec.backend, fullgraph=True)
        for _ in range(2):
            x = torch.randn(32, 2, H, device="cuda", dtype=BF16, requires_grad=True)
            with te.autocast(recipe=recipe):
                step(x).float().sum().backward()
    assert graph_breaks() == 0 and (len(rec.fw), len(rec.bw)) == (1, 1)
    assert len(fp8_weights(layer)) == 4  # QKV, projection, FC1, FC2
    assert all(p.grad is not None and p.grad.shape == p.shape for p in fp8_weights(layer))
    check_reads_fp8_parts(rec)


@pytest.mark.parametrize("invalid", [False, True])
def test_missing_transpose_is_made_in_the_graph(invalid, patched, graph_breaks):
    """No valid transpose on the parameter: a byte transpose of its data, in the graph."""
    with te_compile.simulate_gpu("hopper"):
        recipe = R.Float8CurrentScaling()
        model = fp8_model(linear, recipe, transpose=invalid)
        if invalid:
            model.weight._transpose_invalid = True
        rec = train(model, recipe)
    assert graph_breaks() == 0 and len(rec.fw) == 1
    check_reads_fp8_parts(rec, in_graph_transpose=True)
    assert "aten.clone.default" in JointRecorder.targets(rec.fw)


def test_regional_compilation_shares_one_graph_delayed(patched, graph_breaks):
    """Identical blocks compiled one by one share one graph: the guard on a DelayedScaling
    Float8Tensor compares its quantizer's configuration, not its identity."""
    with te_compile.simulate_gpu("hopper"):
        recipe = R.DelayedScaling()
        blocks = [fp8_model(linear, recipe) for _ in range(3)]
        rec = JointRecorder()
        compiled = [torch.compile(b, backend=rec.backend, fullgraph=True) for b in blocks]
        x = torch.randn(TOKENS, H, device="cuda", dtype=BF16, requires_grad=True)
        with te.autocast(recipe=recipe):
            for block in compiled:
                x = block(x)
        x.float().sum().backward()
    assert graph_breaks() == 0 and (len(rec.fw), len(rec.bw)) == (1, 1)
    assert all(b.weight.grad is not None for b in blocks)


def test_frozen_fp8_weight_gets_no_gradient(patched):
    with te_compile.simulate_gpu("hopper"):
        recipe = R.Float8CurrentScaling()
        model = fp8_model(linear, recipe)
        model.weight.requires_grad_(False)
        train(model, recipe)
    assert model.weight.grad is None and model.bias.grad is not None


def test_weight_caching_call_reads_the_fp8_parameter(patched, graph_breaks):
    """is_first_microbatch: eager TE keeps no workspace for an FP8 parameter; neither do we."""
    with te_compile.simulate_gpu("hopper"):
        recipe = R.DelayedScaling()
        model = fp8_model(linear, recipe)
        rec = train(model, recipe, is_first_microbatch=True)
    assert graph_breaks() == 0
    check_reads_fp8_parts(rec)


def test_fuse_wgrad_accumulation_with_fp8_parameter(patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        recipe = R.Float8CurrentScaling()
        model = fp8_model(
            lambda: te.Linear(H, H, params_dtype=BF16, device="meta", fuse_wgrad_accumulation=True),
            recipe,
        )
        model.weight.main_grad = torch.zeros(H, H, device="cuda", dtype=torch.float32)
        rec = train(model, recipe)
    assert graph_breaks() == 0
    assert model.weight.grad is None  # the gradient went into main_grad, as in eager TE
    bwd = [n for gm in rec.bw for n in gm.graph.nodes if "auto_functionalized" in str(n.target)]
    assert any("main_grad" in k for n in bwd for k in n.kwargs)


# ---- refusals ----------------------------------------------------------------------------------


def _call(model, recipe, x_shape=(TOKENS, H)):
    step = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(*x_shape, device="cuda", dtype=BF16, requires_grad=True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        return step(x)


def test_refuses_fp8_params_without_fp8_autocast(patched):
    with te_compile.simulate_gpu("hopper"):
        model = fp8_model(linear, R.Float8CurrentScaling())
        with pytest.raises(Exception, match="outside an FP8 te.autocast"):
            _call(model, None)


def test_recipe_mismatch_raises_as_eager_te(patched):
    with te_compile.simulate_gpu("hopper"):
        model = fp8_model(linear, R.Float8CurrentScaling())
        with pytest.raises(Exception, match="recipe mismatch"):
            _call(model, R.DelayedScaling())


# A parameter's `_fp8_dtype` as TE 2.20 stores it (its Python DType, an IntEnum: Float8Tensor's
# constructor casts to it) and as older TE did (transformer_engine_torch.DType, pybind11).
# torch 2.11's dynamo compared the former with the pybind11 enum te_compile names the recipe's
# dtype by as unequal, refusing every TE-made parameter; the check compares integer values.
DTYPE_ENUMS = {"te_dtype": DType, "tex_dtype": tex.DType}


@pytest.mark.parametrize("enum", list(DTYPE_ENUMS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_accepts_the_recipes_fp8_dtype_in_either_enum(name, enum, patched, graph_breaks):
    with te_compile.simulate_gpu("hopper"):
        recipe = RECIPES[name]()
        model = fp8_model(linear, recipe)
        assert type(model.weight._fp8_dtype) is DType  # as TE makes it
        model.weight._fp8_dtype = DTYPE_ENUMS[enum].kFloat8E4M3
        _call(model, recipe)
    assert graph_breaks() == 0


@pytest.mark.parametrize("enum", list(DTYPE_ENUMS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_refuses_fp8_dtype_other_than_the_recipes(name, enum, patched):
    with te_compile.simulate_gpu("hopper"):
        recipe = RECIPES[name]()
        model = fp8_model(linear, recipe)
        model.weight._fp8_dtype = DTYPE_ENUMS[enum].kFloat8E5M2
        with pytest.raises(Exception, match="FP8 dtype is not the autocast recipe's"):
            _call(model, recipe)


def test_fp8_dtype_values_compare_under_dynamo():
    """The check's comparison traced on its own: TE's DType and tex.DType by integer value."""

    def same(a, b, x):
        return x + 1 if fp8_params._dtype_value(a) == fp8_params._dtype_value(b) else x - 1

    step = torch.compile(same, backend="eager", fullgraph=True)
    e4m3, e5m2 = DType.kFloat8E4M3, tex.DType.kFloat8E5M2
    assert step(e4m3, tex.DType.kFloat8E4M3, torch.zeros(1)).item() == 1
    assert step(tex.DType(int(e4m3)), e4m3, torch.zeros(1)).item() == 1
    assert step(e4m3, e5m2, torch.zeros(1)).item() == -1
    assert step(DType.kFloat8E5M2, e4m3, torch.zeros(1)).item() == -1


def test_refuses_block_parameter_without_columnwise_data(patched):
    with te_compile.simulate_gpu("hopper"):
        recipe = R.Float8BlockScaling()
        model = fp8_model(linear, recipe, columnwise=False)
        with pytest.raises(Exception, match="without both row-wise and column-wise data"):
            _call(model, recipe)


def test_primary_weights_flag_with_plain_weights_is_an_ordinary_module(patched, graph_breaks):
    """As eager TE: a module made under quantized_model_init whose weights are plain tensors
    (deferred init) quantizes them like any other."""
    with te_compile.simulate_gpu("hopper"):
        recipe = R.Float8CurrentScaling()
        with te.quantized_model_init(enabled=True, recipe=recipe):
            model = linear()
        rec = train(model, recipe, steps=1)
    assert graph_breaks() == 0 and model.primary_weights_in_fp8
    assert model.weight.grad is not None
    assert op_args(gemm_nodes(rec.fw)[0])["weight_cache"] == []  # no FP8 parts


def test_refuses_primary_weights_flag_with_mxfp8(patched):
    """MXFP8 with primary_weights_in_fp8 (eager TE then quantizes without pre-swizzled
    scales): refused by name on Blackwell."""
    with te_compile.simulate_gpu("blackwell"):
        with te.quantized_model_init(enabled=True, recipe=R.MXFP8BlockScaling()):
            model = linear()
        model.weight = torch.nn.Parameter(torch.empty(H, H, device="cuda", dtype=BF16))
        with pytest.raises(Exception, match="primary_weights_in_fp8=True with mxfp8"):
            _call(model, R.MXFP8BlockScaling())


# ---- the gradient carrier, with real values ----------------------------------------------------


def test_carrier_hands_gradients_to_the_parameter_as_autograd_does():
    param = torch.nn.Parameter(torch.randn(4, 3))
    setattr(param, fp8_params.CARRIER_ATTR, fp8_params.GradCarrier(param))
    carrier = getattr(param, fp8_params.CARRIER_ATTR).tensor
    assert carrier.stride() == (0, 0) and carrier.untyped_storage().nbytes() == 4
    seen = []
    param.register_hook(lambda g: seen.append("grad"))
    param.register_post_accumulate_grad_hook(lambda p: seen.append("accumulated"))
    x = torch.randn(5, 4)
    expected = x.sum(0)[:, None].expand(4, 3)
    (x @ carrier).sum().backward()
    assert torch.equal(param.grad, expected) and carrier.grad is None
    first = param.grad
    (x @ carrier).sum().backward()
    assert param.grad is first and torch.equal(param.grad, 2 * expected)
    assert seen == ["grad", "accumulated"] * 2  # the parameter's own hooks run


def test_copied_module_gets_its_own_carriers(patched):
    """A carrier copied with its parameter still points at the original: the next trace
    replaces it, and a stale one raises instead of feeding the wrong parameter."""
    with te_compile.simulate_gpu("hopper"):
        model = fp8_model(linear, R.Float8CurrentScaling())
        fp8_params.ensure_grad_carriers()
        clone = copy.deepcopy(model)
        stale = getattr(clone.weight, fp8_params.CARRIER_ATTR)
        assert stale.owner() is model.weight
        fp8_params.ensure_grad_carriers()
        assert getattr(clone.weight, fp8_params.CARRIER_ATTR).owner() is clone.weight
    stale.owner = lambda: clone.weight
    carrier = torch.zeros(1, requires_grad=True)
    carrier.grad = torch.ones(1)
    with pytest.raises(RuntimeError, match="copied after compiling"):
        stale._hand_over(carrier)


def test_flatten_context_compares_delayed_quantizers_by_configuration(patched):
    def quantizer():
        meta = torch.ones(1, device="meta")
        return Float8Quantizer(meta, meta, tex.DType.kFloat8E4M3)

    def tensor(q):
        return Float8Tensor(
            shape=(16, 16),
            dtype=BF16,
            data=torch.empty(16, 16, dtype=torch.uint8, device="meta"),
            fp8_scale_inv=torch.empty(1, device="meta"),
            fp8_dtype=q.dtype,
            quantizer=q,
        )

    with te_compile.simulate_gpu("hopper"):
        a, b = tensor(quantizer()), tensor(quantizer())
    ctx = a.__tensor_flatten__()[1]
    assert isinstance(ctx, fp8_params.FlattenContext)
    assert copy.deepcopy(ctx) == ctx and ctx == b.__tensor_flatten__()[1]
    b._quantizer.set_usage(columnwise=False)
    assert ctx != b.__tensor_flatten__()[1]
