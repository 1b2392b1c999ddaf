"""HF transformers models with TE, the way accelerate and TE's HF Llama tutorial build them,
traced without a GPU: the training step (forward with HF's own loss, `labels=`) under
torch.compile(fullgraph=True), forward + AOTAutograd backward, on the meta tensors of
te_compile.simulate_gpu("hopper"), for DelayedScaling and Float8CurrentScaling.

- accelerate's path: a tiny LlamaForCausalLM and GPTNeoXForCausalLM from a config, their
  nn.Linear/nn.LayerNorm swapped for te.Linear/te.LayerNorm by
  `accelerate.utils.transformer_engine.convert_model`, the forward wrapped by
  `apply_fp8_autowrap` (DelayedScaling: the recipe accelerate builds) or by the
  `contextual_fp8_autocast` it uses (Float8CurrentScaling). Both call TE's deprecated
  `te.fp8_autocast` inside the forward (te_compile/aliases.py makes it traceable). Also
  `Accelerator(mixed_precision="fp8").prepare`, which adds torch.autocast(bf16) around it.
- TE's tutorial path: a LlamaForCausalLM whose LlamaDecoderLayer is replaced by a subclass of
  te.TransformerLayer (docs/examples/te_llama/te_llama.py in TE's repository).

Each case: 0 graph breaks, one forward and one backward graph over two steps (no recompile),
the te_compile GEMM ops in the forward graph carry the recipe's QuantConfig, every parameter
gets a gradient. Skipped without transformers/accelerate (`pip install -e '.[test]'`)."""

from __future__ import annotations

from types import MethodType

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R

import te_compile
from te_compile_testing import JointRecorder, te_op_nodes

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
accelerate_te = pytest.importorskip("accelerate.utils.transformer_engine")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing"),
    pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered:UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # te.fp8_autocast's, eager
]

VOCAB, BATCH, SEQ = 256, 2, 32
RECIPES = {"delayed": R.DelayedScaling, "current": R.Float8CurrentScaling}
GEMM_OPS = ("linear_fwd", "layernorm_linear_fwd", "layernorm_mlp_fwd")


def llama_config():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,  # training, as TE's tutorial sets it
    )
    config._attn_implementation = "sdpa"
    return config


def neox_config():
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rotary_pct=0.25,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return config


class TELlamaDecoderLayer(te.TransformerLayer):
    """TE's tutorial layer: a te.TransformerLayer configured as Llama's decoder layer, built
    and called as HF's LlamaModel builds and calls LlamaDecoderLayer. The tutorial's returns
    a 1-tuple (transformers 4.x); transformers 5 decoder layers return the hidden states."""

    def __init__(self, config, layer_idx=None):
        super().__init__(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            bias=False,
            layernorm_epsilon=config.rms_norm_eps,
            hidden_dropout=0,
            attention_dropout=0,
            fuse_qkv_params=False,
            normalization="RMSNorm",
            activation="swiglu",
            attn_input_format="bshd",
            num_gqa_groups=config.num_key_value_heads,
        )
        rope = te.RotaryPositionEmbedding(config.hidden_size // config.num_attention_heads)
        self.te_rope_emb = rope(max_seq_len=config.max_position_embeddings).cuda()

    def forward(self, hidden_states, *args, attention_mask=None, **kwargs):
        # HF's causal mask is passed as in the tutorial; TE's "causal" mask type ignores it.
        return super().forward(
            hidden_states, attention_mask=attention_mask, rotary_pos_emb=self.te_rope_emb
        )


def te_llama(config):
    """The tutorial's TELlamaForCausalLM: LlamaForCausalLM built while modeling_llama's
    LlamaDecoderLayer is TELlamaDecoderLayer."""
    original = modeling_llama.LlamaDecoderLayer
    modeling_llama.LlamaDecoderLayer = TELlamaDecoderLayer
    try:
        return transformers.LlamaForCausalLM(config)
    finally:
        modeling_llama.LlamaDecoderLayer = original


MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(llama_config()),
    "neox": lambda: transformers.GPTNeoXForCausalLM(neox_config()),
    "te_llama": lambda: te_llama(llama_config()),
}


@pytest.fixture
def accelerate_state():
    """accelerate's process-wide state (convert_model reads it), cleared afterwards."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def converted(model_name: str) -> torch.nn.Module:
    """The HF model in bf16 with accelerate's TE conversion, on the simulated GPU."""
    torch.manual_seed(0)
    model = MODELS[model_name]().to(torch.bfloat16)
    with torch.no_grad():  # as Accelerator.prepare calls it
        accelerate_te.convert_model(model)
    return model.cuda().train()


def autowrap(model, recipe_name: str):
    """accelerate's FP8 forward wrapper: apply_fp8_autowrap builds DelayedScaling from its
    recipe kwargs; for any other recipe the contextual_fp8_autocast it wraps with."""
    if recipe_name == "delayed":
        return accelerate_te.apply_fp8_autowrap(model, accelerate.utils.TERecipeKwargs())
    wrapped = accelerate_te.contextual_fp8_autocast(model.forward, RECIPES[recipe_name]())
    model.forward = MethodType(wrapped, model)
    return model


def trace_steps(model, steps: int = 2) -> JointRecorder:
    """`steps` training steps, forward + HF's loss compiled with fullgraph=True, backward."""
    recorder = JointRecorder()
    step = torch.compile(
        lambda ids: model(input_ids=ids, labels=ids).loss,
        backend=recorder.backend,
        fullgraph=True,
    )
    for _ in range(steps):
        ids = torch.randint(VOCAB, (BATCH, SEQ), device="cuda")
        loss = step(ids)
        assert loss.shape == () and loss.dtype == torch.float32
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape, f"{name} has no grad"
            p.grad = None
    return recorder


def check_graphs(rec: JointRecorder, recipe_name: str, breaks: int) -> set[str]:
    """One forward + one backward graph, 0 breaks, every GEMM op FP8 with the recipe; returns
    the te_compile op names of the forward graph."""
    assert breaks == 0, f"{breaks} graph breaks"
    assert (len(rec.fw), len(rec.bw)) == (1, 1), "expected 1 forward + 1 backward graph"
    fw = te_op_nodes(rec.fw)
    gemms = [node for name, node in fw if name in GEMM_OPS]
    assert gemms, f"no te_compile GEMM op: {sorted({n for n, _ in fw})}"
    for node in gemms:
        kinds = {
            a.split(";")[0]
            for a in [*node.args, *node.kwargs.values()]
            if isinstance(a, str) and a.startswith("kind=")
        }
        assert kinds == {f"kind={recipe_name}"}, f"{node}: {kinds}"
    assert any(name.endswith("_bwd") for name, _ in te_op_nodes(rec.bw)), (
        "no te_compile backward op"
    )
    return {name for name, _ in fw}


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("model_name", ["llama", "neox"])
def test_accelerate_converted_model_traces(
    model_name, recipe_name, patched, accelerate_state, graph_breaks
):
    accelerate.Accelerator()  # the state convert_model reads (no FP8 through it here)
    with te_compile.simulate_gpu("hopper"):
        model = autowrap(converted(model_name), recipe_name)
        linears = [m for m in model.modules() if isinstance(m, te.Linear)]
        rec = trace_steps(model)
    # every projection and the LM head (all dims multiples of 16) became te.Linear
    assert len(linears) == {"llama": 15, "neox": 9}[model_name], len(linears)
    if model_name == "neox":
        assert sum(isinstance(m, te.LayerNorm) for m in model.modules()) == 5
    names = check_graphs(rec, recipe_name, graph_breaks())
    assert "linear_fwd" in names and ("norm_fwd" in names) == (model_name == "neox"), names


@pytest.mark.filterwarnings("ignore:CUDA is not available.*Disabling autocast:UserWarning")
@pytest.mark.parametrize("model_name", ["llama", "te_llama"])
def test_accelerator_prepare_fp8_traces(model_name, patched, accelerate_state, graph_breaks):
    """The tutorial's training setup: Accelerator(mixed_precision="fp8") with TE's recipe
    kwargs; prepare() converts the model and wraps its forward in torch.autocast(bf16) (which
    accelerate turns off here: it asks the real torch.cuda.is_available()), an fp32 cast of the
    outputs and te.fp8_autocast(DelayedScaling), and wraps the AdamW optimizer."""
    with te_compile.simulate_gpu("hopper"):
        acc = accelerate.Accelerator(
            mixed_precision="fp8", kwargs_handlers=[accelerate.utils.TERecipeKwargs()]
        )
        torch.manual_seed(0)
        model = MODELS[model_name]().to(torch.bfloat16)  # as the tutorial loads its weights
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        assert isinstance(model.lm_head, te.Linear), type(model.lm_head)
        rec = trace_steps(model.train())
    check_graphs(rec, "delayed", graph_breaks())


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_te_transformer_layer_llama_traces(recipe_name, patched, accelerate_state, graph_breaks):
    """TE's tutorial model (decoder layers are te.TransformerLayer), converted and wrapped by
    accelerate as prepare() does (its LM head becomes a te.Linear)."""
    accelerate.Accelerator()
    with te_compile.simulate_gpu("hopper"):
        model = autowrap(converted("te_llama"), recipe_name)
        layers = model.model.layers
        assert all(isinstance(layer, TELlamaDecoderLayer) for layer in layers)
        rec = trace_steps(model)
    names = check_graphs(rec, recipe_name, graph_breaks())
    # LayerNormLinear (QKV), Linear (proj, LM head), LayerNormMLP, TE's RoPE and attention
    assert {"layernorm_linear_fwd", "linear_fwd", "layernorm_mlp_fwd"} <= names, names
    assert {"fused_rope_fwd", "fused_attn_fwd"} <= names, names
    bw = {name for name, _ in te_op_nodes(rec.bw)}
    assert {"layernorm_linear_bwd", "linear_bwd", "layernorm_mlp_bwd"} <= bw, bw


def test_autowrap_before_patch_keeps_te_original(accelerate_state, backend):
    """accelerate imports te.fp8_autocast when it wraps the forward: a forward wrapped before
    te_compile.patch() holds TE's own alias, whose warning dynamo cannot trace. Patch first."""
    accelerate.Accelerator()
    with te_compile.simulate_gpu("hopper"):
        model = autowrap(converted("llama"), "current")
        te_compile.patch()
        try:
            step = torch.compile(
                lambda ids: model(input_ids=ids).logits, backend=backend, fullgraph=True
            )
            ids = torch.randint(VOCAB, (BATCH, SEQ), device="cuda")
            with pytest.raises(Exception, match=r"warnings\.warn"):
                step(ids)
        finally:
            te_compile.unpatch()
