"""Model stacks the benchmarks and the profiler time, by name.

A stack is `layers` blocks of (linear H->4H, GELU, linear 4H->H), the MLP half of a transformer
block, built from one family of modules:

- "te":      te.Linear (eager TE, or te_compile under torch.compile)
- "torch":   torch.nn.Linear, bf16
- "torchao": torch.nn.Linear converted by torchao.float8 (tensorwise or rowwise scaling)

Norm families, each block a residual-free pair of TE modules (eager TE or te_compile):

- "te-lnlinear": te.LayerNormLinear H->4H, GELU, te.LayerNormLinear 4H->H
- "te-lnmlp":    te.LayerNormMLP(H, 4H, gelu): LayerNorm, FC1, GELU, FC2 in one module

New module families (attention) add a builder to `BUILDERS`; the benchmark takes the
builder's name as its `--stacks` argument.
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


BUILDERS = {
    "te": _te_linear_stack,
    "te-lnlinear": _te_layernorm_linear_stack,
    "te-lnmlp": _te_layernorm_mlp_stack,
    "torch": _torch_linear_stack,
    "torchao-tensorwise": _torchao_stack("tensorwise"),
    "torchao-rowwise": _torchao_stack("rowwise"),
}


def build(name: str, hidden: int, layers: int) -> torch.nn.Module:
    return BUILDERS[name](hidden, layers)
