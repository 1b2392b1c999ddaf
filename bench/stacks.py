"""Model stacks the benchmarks and the profiler time, by name.

A stack is `layers` blocks of (linear H->4H, GELU, linear 4H->H), the MLP half of a transformer
block, built from one family of modules:

- "te":      te.Linear (eager TE, or te_compile under torch.compile)
- "torch":   torch.nn.Linear, bf16
- "torchao": torch.nn.Linear converted by torchao.float8 (tensorwise or rowwise scaling)

Norm families, each block a residual-free pair of TE modules (eager TE or te_compile):

- "te-lnlinear": te.LayerNormLinear H->4H, GELU, te.LayerNormLinear 4H->H
- "te-lnmlp":    te.LayerNormMLP(H, 4H, gelu): LayerNorm, FC1, GELU, FC2 in one module

Transformer blocks (pre-norm: LayerNorm, causal self-attention, residual, LayerNorm, MLP
H->4H->H with GELU, residual; no dropout; heads of HEAD_DIM channels, 128 unless the caller
sets it), input [seq, batch, hidden]
(a 2-D [tokens, hidden] input runs as one sequence of batch 1):

- "te-transformer":      te.TransformerLayer (fused QKV weight, TE's default attention backend)
- "torch-transformer":   nn.LayerNorm + nn.Linear + F.scaled_dot_product_attention, bf16
- "torchao-transformer": that torch block with its nn.Linear layers converted by
  torchao.float8 (tensorwise scaling; attention stays bf16 SDPA)

New module families add a builder to `BUILDERS`; the benchmark takes the builder's name as its
`--stacks` argument.
"""

from __future__ import annotations

import torch


class MLPBlock(torch.nn.Module):
    def __init__(self, fc1: torch.nn.Module, fc2: torch.nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x), approximate="tanh"))


def _te_linear_stack(hidden: int, layers: int) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    def lin(i, o):
        return te.Linear(i, o, params_dtype=torch.bfloat16)

    return torch.nn.Sequential(
        *[MLPBlock(lin(hidden, 4 * hidden), lin(4 * hidden, hidden)) for _ in range(layers)]
    )


def _te_layernorm_linear_stack(hidden: int, layers: int) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    def lnlin(i, o):
        return te.LayerNormLinear(i, o, params_dtype=torch.bfloat16)

    return torch.nn.Sequential(
        *[MLPBlock(lnlin(hidden, 4 * hidden), lnlin(4 * hidden, hidden)) for _ in range(layers)]
    )


def _te_layernorm_mlp_stack(hidden: int, layers: int) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    return torch.nn.Sequential(
        *[
            te.LayerNormMLP(hidden, 4 * hidden, activation="gelu", params_dtype=torch.bfloat16)
            for _ in range(layers)
        ]
    )


def _torch_linear_stack(hidden: int, layers: int) -> torch.nn.Module:
    def lin(i, o):
        return torch.nn.Linear(i, o, device="cuda", dtype=torch.bfloat16)

    return torch.nn.Sequential(
        *[MLPBlock(lin(hidden, 4 * hidden), lin(4 * hidden, hidden)) for _ in range(layers)]
    )


def _torchao_stack(scaling: str):
    def build(hidden: int, layers: int) -> torch.nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = _torch_linear_stack(hidden, layers)
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(scaling))
        return model

    return build


HEAD_DIM = 128  # channels per attention head (bench/suite.py --head-dim sets it)


def _heads(hidden: int) -> int:
    return max(1, hidden // HEAD_DIM)


class SequenceFirst(torch.nn.Module):
    """Runs `blocks` on [seq, batch, hidden]; a 2-D [tokens, hidden] input as batch 1."""

    def __init__(self, blocks) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.blocks(x.unsqueeze(1)).squeeze(1)
        return self.blocks(x)


def _te_transformer_stack(hidden: int, layers: int) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    def layer(i):
        return te.TransformerLayer(
            hidden,
            4 * hidden,
            _heads(hidden),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            self_attn_mask_type="causal",
            fuse_qkv_params=True,
            layer_number=i + 1,
            params_dtype=torch.bfloat16,
        )

    return SequenceFirst(layer(i) for i in range(layers))


class TorchTransformerBlock(torch.nn.Module):
    """The te-transformer block in plain PyTorch, on [seq, batch, hidden]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        self.heads = _heads(hidden)
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden, **kw), torch.nn.LayerNorm(hidden, **kw)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = torch.nn.Linear(hidden, hidden, **kw)
        self.mlp = MLPBlock(
            torch.nn.Linear(hidden, 4 * hidden, **kw), torch.nn.Linear(4 * hidden, hidden, **kw)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # each [b, heads, s, d]
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.mlp(self.ln2(x))


def _torch_transformer_stack(hidden: int, layers: int) -> torch.nn.Module:
    return SequenceFirst(TorchTransformerBlock(hidden) for _ in range(layers))


def _torchao_transformer_stack(hidden: int, layers: int) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = _torch_transformer_stack(hidden, layers)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return model


BUILDERS = {
    "te": _te_linear_stack,
    "te-lnlinear": _te_layernorm_linear_stack,
    "te-lnmlp": _te_layernorm_mlp_stack,
    "torch": _torch_linear_stack,
    "torchao-tensorwise": _torchao_stack("tensorwise"),
    "torchao-rowwise": _torchao_stack("rowwise"),
    "te-transformer": _te_transformer_stack,
    "torch-transformer": _torch_transformer_stack,
    "torchao-transformer": _torchao_transformer_stack,
}


def build(name: str, hidden: int, layers: int) -> torch.nn.Module:
    return BUILDERS[name](hidden, layers)
