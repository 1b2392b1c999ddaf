"""Two small language models built from te.TransformerLayer, for the demo, tests and benchmarks.

- `GPT`: token embedding, learned or rotary positions, N te.TransformerLayer (LayerNorm, GELU,
  bias, causal self-attention), a final TE norm and an LM head, tied to the embedding or a
  te.Linear of its own. sbhd layout inside (TE's default).
- `Llama`: the layer TE's HF-Llama tutorial builds (te.TransformerLayer with RMSNorm, swiglu,
  no bias, GQA, bshd, rotary embeddings from TE's RotaryPositionEmbedding passed as
  `rotary_pos_emb`, `fuse_qkv_params=False`); embedding, N layers, final te.RMSNorm, LM head.

Both take token ids [batch, seq] and return logits [batch, seq, vocab]. They are ordinary GPU
code: under `te_compile.simulate_gpu("hopper")` they build on meta tensors, so
`te_compile.check` can trace them without a GPU:

    python -m te_compile check examples/models.py:build_gpt
    python -m te_compile check examples/models.py:build_llama

`train_step` is the function a training loop compiles (forward, loss, te.autocast inside);
`synthetic_batches` makes a learnable token stream (a noisy fixed bigram chain).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.nn.functional as F
import transformer_engine.pytorch as te


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # small: the synthetic bigram chain is learnt within 50 steps
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int = 1024
    max_seq_len: int = 128
    positions: str = "learned"  # "learned" (an embedding table) or "rotary" (TE's RoPE)
    tie_embeddings: bool = True  # LM head = the token embedding's weight (a bf16 matmul)
    normalization: str = "LayerNorm"  # TE's: "LayerNorm" or "RMSNorm"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    checkpoint: str = "none"  # activation checkpointing per layer: "none", "te", "torch"
    dtype: torch.dtype = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4  # head_dim 64
    num_kv_heads: int = 2  # GQA groups
    intermediate_size: int = 768  # swiglu width: a multiple of 128 (FP8 block scaling's tile)
    max_seq_len: int = 128
    rms_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    hidden_dropout: float = 0.0  # the tutorial's layers use 0
    attention_dropout: float = 0.0
    checkpoint: str = "none"  # activation checkpointing per layer: "none", "te", "torch"
    dtype: torch.dtype = torch.bfloat16


def _init_embedding(vocab: int, hidden: int, dtype: torch.dtype) -> torch.nn.Embedding:
    emb = torch.nn.Embedding(vocab, hidden, device="cuda", dtype=dtype)
    torch.nn.init.normal_(emb.weight, std=0.02)
    return emb


def _rope_table(head_dim: int, max_seq_len: int, base: float) -> torch.Tensor:
    """TE's RoPE frequencies, float32 [max_seq_len, 1, 1, head_dim], computed once (as the
    tutorial does); the forward passes the first `seq` rows as `rotary_pos_emb`."""
    rope = te.RotaryPositionEmbedding(head_dim, rotary_base=base)
    return rope(max_seq_len=max_seq_len)


class Checkpointed(torch.nn.Module):
    """A layer whose activations are recomputed in backward: `how` = "te" (TE's
    te.distributed.checkpoint: FP8-aware, every recipe) or "torch" (torch.utils.checkpoint,
    non-reentrant). Wrap first, then compile the wrapper (torchtitan's order)."""

    def __init__(self, layer: torch.nn.Module, how: str):
        super().__init__()
        if how not in ("te", "torch"):
            raise ValueError(f"checkpoint: 'none', 'te' or 'torch', got {how!r}")
        self.layer, self.how = layer, how

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.how == "te":
            return te.distributed.checkpoint(self.layer, x, **kwargs)
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False, **kwargs)


def _layers(layers: torch.nn.ModuleList, how: str) -> torch.nn.ModuleList:
    if how == "none":
        return layers
    return torch.nn.ModuleList(Checkpointed(layer, how) for layer in layers)


def gpt_layer(c: GPTConfig, i: int, **kwargs) -> te.TransformerLayer:
    """The GPT's layer `i` (`kwargs`: more TransformerLayer arguments)."""
    return te.TransformerLayer(
        c.hidden_size,
        c.ffn_hidden_size,
        c.num_heads,
        hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout,
        self_attn_mask_type="causal",
        normalization=c.normalization,
        activation="gelu",
        layer_number=i + 1,
        params_dtype=c.dtype,
        **kwargs,
    )


class GPT(torch.nn.Module):
    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        c = self.config = config or GPTConfig()
        if c.positions not in ("learned", "rotary"):
            raise ValueError(f"positions: 'learned' or 'rotary', got {c.positions!r}")
        self.embed = _init_embedding(c.vocab_size, c.hidden_size, c.dtype)
        if c.positions == "learned":
            self.pos_embed = _init_embedding(c.max_seq_len, c.hidden_size, c.dtype)
        else:
            table = _rope_table(c.hidden_size // c.num_heads, c.max_seq_len, 10000.0)
            self.register_buffer("rope", table, persistent=False)
        self.layers = torch.nn.ModuleList(gpt_layer(c, i) for i in range(c.num_layers))
        self.layers = _layers(self.layers, c.checkpoint)
        norm = te.LayerNorm if c.normalization == "LayerNorm" else te.RMSNorm
        self.final_norm = norm(c.hidden_size, params_dtype=c.dtype)
        if not c.tie_embeddings:
            self.lm_head = te.Linear(c.hidden_size, c.vocab_size, bias=False, params_dtype=c.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.embed(tokens)  # [b, s, h]
        rope = None
        if self.config.positions == "learned":
            x = x + self.pos_embed.weight[:seq]
        else:
            rope = self.rope[:seq]
        x = x.transpose(0, 1).contiguous()  # sbhd, TE's default layout
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=rope)
        x = self.final_norm(x).transpose(0, 1)
        if self.config.tie_embeddings:
            return F.linear(x, self.embed.weight)
        return self.lm_head(x)


class Llama(torch.nn.Module):
    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        c = self.config = config or LlamaConfig()
        head_dim = c.hidden_size // c.num_heads
        self.embed = _init_embedding(c.vocab_size, c.hidden_size, c.dtype)
        self.register_buffer(
            "rope", _rope_table(head_dim, c.max_seq_len, c.rope_base), persistent=False
        )
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(
                hidden_size=c.hidden_size,
                ffn_hidden_size=c.intermediate_size,
                num_attention_heads=c.num_heads,
                num_gqa_groups=c.num_kv_heads,
                bias=False,
                layernorm_epsilon=c.rms_norm_eps,
                hidden_dropout=c.hidden_dropout,
                attention_dropout=c.attention_dropout,
                fuse_qkv_params=False,
                normalization="RMSNorm",
                activation="swiglu",
                attn_input_format="bshd",
                self_attn_mask_type="causal",
                layer_number=i + 1,
                params_dtype=c.dtype,
            )
            for i in range(c.num_layers)
        )
        self.layers = _layers(self.layers, c.checkpoint)
        self.final_norm = te.RMSNorm(c.hidden_size, eps=c.rms_norm_eps, params_dtype=c.dtype)
        self.lm_head = te.Linear(c.hidden_size, c.vocab_size, bias=False, params_dtype=c.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # [b, s, h]: bshd throughout
        rope = self.rope[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=rope)
        return self.lm_head(self.final_norm(x))


# ---- training --------------------------------------------------------------------------------


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train_step(model: torch.nn.Module, recipe):
    """The function a training loop compiles: forward and loss under te.autocast (FP8 with
    `recipe`; no autocast at all for None). Backward and the optimizer run outside it."""

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        fp8 = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with fp8:
            logits = model(tokens)
        return lm_loss(logits, targets)

    return step


def timed_steps(step, opt, data) -> tuple[list[torch.Tensor], list[float]]:
    """One training step per (tokens, targets) of `data`: `step` (forward + loss), backward,
    `opt`. Returns the detached losses and each step's seconds (the GPU synchronized around
    it; the first includes compiling)."""
    losses, times = [], []
    for tokens, targets in data:
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    return losses, times


def synthetic_batches(
    vocab: int, batch: int, seq: int, steps: int, seed: int = 0, device="cuda", noise=0.1
):
    """`steps` (tokens, targets) pairs of [batch, seq] int64: a fixed random bigram chain (each
    token's successor is a fixed permutation of it, a uniformly random token with probability
    `noise`), so the loss falls from ln(vocab) towards the chain's entropy. Generated on the
    CPU with a seeded generator: the same batches on every device and run."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        ids = torch.empty(batch, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(seq):
            jump = torch.rand(batch, generator=g) < noise
            rand = torch.randint(vocab, (batch,), generator=g)
            ids[:, t + 1] = torch.where(jump, rand, successor[ids[:, t]])
        ids = ids.to(device)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


# ---- factories for `python -m te_compile check FILE:FACTORY` ---------------------------------

BATCH = 2


def _tokens(config) -> torch.Tensor:
    return torch.randint(config.vocab_size, (BATCH, config.max_seq_len), device="cuda")


def build_gpt():
    config = GPTConfig()
    return GPT(config), (_tokens(config),)


def build_gpt_rotary_untied():
    config = GPTConfig(positions="rotary", tie_embeddings=False, normalization="RMSNorm")
    return GPT(config), (_tokens(config),)


def build_llama():
    config = LlamaConfig()
    return Llama(config), (_tokens(config),)


def plot_loss_curves(curves: dict, path: str, title: str, compiled_label: str) -> str | None:
    """Loss curves as a PNG at `path`: per name, (compiled losses, eager losses), one color
    each, eager dashed. None (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (the table has the numbers)")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, (compiled, eager)) in enumerate(curves.items()):
        ax.plot(eager, color=f"C{i}", linestyle="--", label=f"{name}, eager TE")
        ax.plot(compiled, color=f"C{i}", alpha=0.8, label=f"{name}, {compiled_label}")
    ax.set(xlabel="step", ylabel="training loss (cross-entropy)", title=title)
    ax.legend()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
