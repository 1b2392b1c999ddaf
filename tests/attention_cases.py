"""Option sets for te.TransformerLayer / te.MultiheadAttention / te.DotProductAttention, shared
by the CPU traces (tests/cpu/test_*attention*, test_transformer_layer_trace.py) and the GPU
comparisons with eager TE (tests/gpu/test_attention_gpu.py, test_transformer_layer_gpu.py),
and the te_compile::fused_attn_* / fused_rope_* op arguments for opcheck.

Every tensor is made on device="cuda": under te_compile.simulate_gpu that is the meta device
(CPU traces), on a GPU machine a real GPU.
"""

from __future__ import annotations

import dataclasses

import torch

HIDDEN, FFN, HEADS = 128, 256, 8
HEAD_DIM = HIDDEN // HEADS
SEQ, BATCH = 32, 2


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One TransformerLayer option set: constructor kwargs on top of `BASE`, and what the
    call passes (rotary embeddings, a padding mask, an encoder output)."""

    layer: dict = dataclasses.field(default_factory=dict)
    rope: bool = False
    padding_mask: bool = False
    encoder: bool = False
    env: dict = dataclasses.field(default_factory=dict)  # NVTE_* switches for the case
    dtype: torch.dtype = torch.bfloat16
    seq: int = SEQ

    @property
    def fmt(self) -> str:
        return self.layer.get("attn_input_format", "sbhd")

    @property
    def fused_attention(self) -> bool:
        """Whether TE picks cuDNN fused attention (else UnfusedDotProductAttention): cuDNN
        attention is F16/BF16 only, and NVTE_FUSED_ATTN=0 switches it off."""
        return self.env.get("NVTE_FUSED_ATTN") != "0" and self.dtype != torch.float32


BASE = dict(hidden_dropout=0.0, attention_dropout=0.0)

UNFUSED = {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0"}

LAYER_CASES = {
    "default": LayerCase(),
    "causal": LayerCase(dict(self_attn_mask_type="causal")),
    "no_mask": LayerCase(dict(self_attn_mask_type="no_mask")),
    "padding": LayerCase(dict(self_attn_mask_type="padding"), padding_mask=True),
    "padding_causal": LayerCase(dict(self_attn_mask_type="padding_causal"), padding_mask=True),
    "causal_bottom_right": LayerCase(dict(self_attn_mask_type="causal_bottom_right")),
    "gqa": LayerCase(dict(num_gqa_groups=2, self_attn_mask_type="causal")),
    "bshd": LayerCase(dict(attn_input_format="bshd", self_attn_mask_type="causal")),
    "rope": LayerCase(dict(self_attn_mask_type="causal"), rope=True),
    "rope_bshd_gqa": LayerCase(
        dict(attn_input_format="bshd", num_gqa_groups=4, self_attn_mask_type="causal"), rope=True
    ),
    "fused_qkv": LayerCase(dict(fuse_qkv_params=True, self_attn_mask_type="causal")),
    # Sequences of 128: cuDNN <= 9.15 runs attention wrong inside CUDA graphs unless
    # max_seqlen_kv % 128 == 0 (TE refuses the rest there): the reduce-overhead cases.
    "rope_s128": LayerCase(dict(self_attn_mask_type="causal"), rope=True, seq=128),
    "fused_qkv_s128": LayerCase(dict(fuse_qkv_params=True, self_attn_mask_type="causal"), seq=128),
    "not_interleaved": LayerCase(
        dict(fuse_qkv_params=True, qkv_weight_interleaved=False, self_attn_mask_type="causal")
    ),
    "no_bias": LayerCase(dict(bias=False)),
    "rmsnorm_swiglu": LayerCase(dict(normalization="RMSNorm", activation="swiglu")),
    "dropout": LayerCase(dict(hidden_dropout=0.1, attention_dropout=0.1)),
    # 256 tokens: enough that inductor splits the bias gradient's sum (test_transformer_layer_gpu)
    "dropout_s128": LayerCase(dict(hidden_dropout=0.1, attention_dropout=0.1), seq=128),
    # The Llama-style layer of TE's HF-Llama tutorial.
    "llama": LayerCase(
        dict(
            normalization="RMSNorm",
            activation="swiglu",
            bias=False,
            num_gqa_groups=2,
            attn_input_format="bshd",
            fuse_qkv_params=False,
            self_attn_mask_type="causal",
        ),
        rope=True,
    ),
    # TE's default split QKV parameters: the cross attention's key/value projection is a
    # te.Linear with parameters_split ("key", "value").
    "decoder": LayerCase(dict(layer_type="decoder", self_attn_mask_type="causal"), encoder=True),
    "decoder_fused_qkv": LayerCase(
        dict(layer_type="decoder", fuse_qkv_params=True, self_attn_mask_type="causal"),
        encoder=True,
    ),
    # No input norm in the attention: its QKV projection is a te.Linear with parameters_split.
    "output_layernorm": LayerCase(dict(output_layernorm=True, self_attn_mask_type="causal")),
    "qk_norm_rope": LayerCase(dict(qk_norm_type="RMSNorm"), rope=True),
    "sliding_window": LayerCase(dict(self_attn_mask_type="causal", window_size=(8, 0))),
    "rope_interleaved": LayerCase(dict(rotary_pos_interleaved=True), rope=True),
    "zero_centered_gamma": LayerCase(dict(zero_centered_gamma=True)),
    "parallel_attention_mlp": LayerCase(dict(parallel_attention_mlp=True)),
    "post_layernorm_residual": LayerCase(dict(apply_residual_connection_post_layernorm=True)),
    "drop_path": LayerCase(dict(drop_path_rate=0.1)),
    "kv_channels": LayerCase(dict(kv_channels=32)),
    "bshd_padding": LayerCase(
        dict(attn_input_format="bshd", self_attn_mask_type="padding"), padding_mask=True
    ),
    "fp16": LayerCase(dtype=torch.float16),
    "fp32_unfused": LayerCase(dict(self_attn_mask_type="causal"), dtype=torch.float32),
    # TE's unfused backend: cuDNN attention off, and flash-attn too where it is installed.
    "unfused_backend": LayerCase(dict(self_attn_mask_type="causal"), env=UNFUSED),
    "unfused_padding_rope": LayerCase(
        dict(self_attn_mask_type="padding_causal"), rope=True, padding_mask=True, env=UNFUSED
    ),
}


def make_layer(case: LayerCase, **extra):
    import transformer_engine.pytorch as te

    kwargs = {**BASE, "params_dtype": case.dtype, **case.layer, **extra}
    return te.TransformerLayer(HIDDEN, FFN, HEADS, device="cuda", **kwargs)


def fresh_layer(case: LayerCase):
    """make_layer from seed 0, its biases and norm weights moved off TE's 0 and 1, so that a
    bug in their handling shows."""
    torch.manual_seed(0)
    layer = make_layer(case)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "bias" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return layer


def varying_length_records(fn, layer, seqs, dtype=torch.bfloat16, after_step=None) -> list:
    """Training steps of `fn` (`layer` under an autocast, compiled or not) over inputs of
    `seqs` tokens each ([seq, BATCH, HIDDEN], from seeds 10, 11, ...), each backward of a random
    gradient: per step {out, dgrad, every parameter's gradient}. `after_step(layer)` runs after
    each step, before the gradients are cleared."""
    records = []
    for i, seq in enumerate(seqs):
        g = torch.Generator(device="cpu").manual_seed(10 + i)
        x = torch.randn(seq, BATCH, HIDDEN, generator=g).to(device="cuda", dtype=dtype)
        x.requires_grad_()
        out = fn(x)
        out.backward(torch.randn_like(out))
        rec = {"out": out, "dgrad": x.grad} | {k: p.grad for k, p in layer.named_parameters()}
        records.append({k: v.detach().clone() for k, v in rec.items()})
        if after_step is not None:
            after_step(layer)
        layer.zero_grad(set_to_none=True)
    return records


def padding_mask(seq: int = SEQ, batch: int = BATCH, pad: int = 5) -> torch.Tensor:
    """[b, 1, 1, s] bool, True = masked: the last `pad` tokens of sequence 0 are padding."""
    mask = torch.zeros(batch, 1, 1, seq, dtype=torch.bool, device="cuda")
    mask[0, ..., seq - pad :] = True
    return mask


def layer_input(case: LayerCase, *, requires_grad=True, seed=0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (case.seq, BATCH, HIDDEN) if case.fmt == "sbhd" else (BATCH, case.seq, HIDDEN)
    x = torch.randn(*shape, generator=g).to(device="cuda", dtype=case.dtype)
    return x.requires_grad_(requires_grad)


def call_kwargs(case: LayerCase, *, seed=1) -> dict:
    """The layer call's keyword arguments for `case` (tensors on "cuda")."""
    import transformer_engine.pytorch as te

    kwargs = {}
    if case.rope:
        kwargs["rotary_pos_emb"] = te.attention.RotaryPositionEmbedding(HEAD_DIM)(
            max_seq_len=case.seq
        ).to("cuda")
    if case.padding_mask:
        kwargs["attention_mask"] = padding_mask(case.seq)
    if case.encoder:
        g = torch.Generator(device="cpu").manual_seed(seed)
        shape = (case.seq, BATCH, HIDDEN) if case.fmt == "sbhd" else (BATCH, case.seq, HIDDEN)
        enc = torch.randn(*shape, generator=g).to(device="cuda", dtype=case.dtype)
        kwargs["encoder_output"] = enc
    return kwargs


def reset_backend_choice() -> None:
    """Eager TE caches its attention backend choice until the attention parameters change
    (an NVTE_* switch flipped between tests would be ignored): make it choose again."""
    from transformer_engine.pytorch.attention.dot_product_attention import (
        dot_product_attention as dpa_module,
    )

    dpa_module._attention_backends["backend_selection_requires_update"] = True


# ---- op arguments (opcheck) ----------------------------------------------------------------------


# qkv_layout -> shapes of the `qkv` tensors for [s, b] = [SEQ, BATCH] (h heads of d, g kv heads)
def qkv_tensors(layout: str, *, heads=4, groups=4, d=16, s=SEQ, b=BATCH, grad=True):
    fmt = layout.split("_")[0].replace("3", "").replace("2", "")
    lead = (s, b) if fmt == "sbhd" else (b, s)

    def t(*shape):
        x = torch.randn(*lead, *shape, device="cuda", dtype=torch.bfloat16)
        return x.requires_grad_(grad)

    parts = layout.split("_")
    if len(parts) == 3:
        return [t(heads, d), t(groups, d), t(groups, d)]
    if len(parts) == 2:
        kv = t(2, groups, d) if "2h" in parts[1] else t(groups, 2, d)
        return [t(heads, d), kv]
    return [t(3, heads, d) if "3h" in layout else t(heads, 3, d)]


def fused_attn_spec(layout="sbhd_sbhd_sbhd", mask="causal", dropout=0.0):
    from te_compile.ops.attention import FusedAttnSpec

    return FusedAttnSpec(
        qkv_layout=layout,
        attn_mask_type=mask,
        window_size=(-1, 0) if "causal" in mask else (-1, -1),
        bottom_right_diagonal=False,
        attn_scale=0.25,
        dropout=dropout,
        fast_zero_fill=True,
        is_training=True,
        deterministic=False,
        backend=1,
    )


def fused_attn_fwd_args(layout="sbhd_sbhd_sbhd", mask="causal", dropout=0.0, padded=False):
    qkv = qkv_tensors(layout, groups=2 if layout.count("_") == 2 else 4)
    cu = torch.arange(0, (BATCH + 1) * SEQ, SEQ, dtype=torch.int32, device="cuda")
    padded_cu = cu if padded else None
    config = fused_attn_spec(layout, mask, dropout).key
    return (qkv, cu, cu, [padded_cu, padded_cu], [SEQ, SEQ], config)


def fused_attn_bwd_args(fwd_args):
    qkv = [t.detach() for t in fwd_args[0]]
    out, stats, rng = torch.ops.te_compile.fused_attn_fwd(qkv, *fwd_args[1:])
    d_out = torch.randn_like(out)
    return (qkv, out, d_out, stats, rng, *fwd_args[1:])


def rope_args(fmt="sbhd", interleaved=False, grad=True):
    lead = (SEQ, BATCH) if fmt == "sbhd" else (BATCH, SEQ)
    t = torch.randn(*lead, 4, 16, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    freqs = torch.randn(SEQ, 1, 1, 16, device="cuda", dtype=torch.float32)
    return (t, freqs, None, None, fmt, interleaved, 1, 0)
