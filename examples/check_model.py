"""An example for `python -m te_compile check examples/check_model.py:build`: ordinary GPU code
that builds a small TE model and its inputs. Run without a GPU, check simulates one."""

import torch
import transformer_engine.pytorch as te


class Block(torch.nn.Module):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.fc1 = te.Linear(hidden, 4 * hidden, params_dtype=torch.bfloat16)
        self.fc2 = te.Linear(4 * hidden, hidden, params_dtype=torch.bfloat16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def build():
    model = torch.nn.Sequential(Block(), Block()).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return model, (x,)


def build_unsupported():
    """The same model with one option te-compile refuses under compile (delay_wgrad_compute):
    check exits non-zero, naming the option and the way out."""
    model, inputs = build()
    model[1].fc2 = te.Linear(1024, 256, params_dtype=torch.bfloat16, delay_wgrad_compute=True)
    return model.cuda(), inputs


class NormBlock(torch.nn.Module):
    """A transformer block's MLP half and a projection, from TE's norm family."""

    def __init__(self, hidden: int = 256):
        super().__init__()
        self.qkv = te.LayerNormLinear(hidden, 3 * hidden, params_dtype=torch.bfloat16)
        self.proj = te.Linear(3 * hidden, hidden, params_dtype=torch.bfloat16)
        self.mlp = te.LayerNormMLP(hidden, 4 * hidden, params_dtype=torch.bfloat16)
        self.norm = te.RMSNorm(hidden, params_dtype=torch.bfloat16)

    def forward(self, x):
        x = x + self.proj(self.qkv(x))
        return self.norm(x + self.mlp(x))


def build_norm_family():
    model = NormBlock().cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return model, (x,)


class EagerOnlyCode(torch.nn.Module):
    """Code that differs between eager and compiled execution, as HF transformers' mask code
    does: eagerly it reads its activations with `.item()` (meta tensors cannot answer that),
    under torch.compile it skips the read. check passes it: the per-module cases take their
    inputs from the whole-model trace, so the model's eager code never runs on meta tensors."""

    def __init__(self, hidden: int = 256):
        super().__init__()
        self.fc1 = te.Linear(hidden, hidden, params_dtype=torch.bfloat16)
        self.fc2 = te.Linear(hidden, hidden, params_dtype=torch.bfloat16)

    def forward(self, x):
        h = self.fc1(x)
        if not torch.compiler.is_compiling() and h.isnan().any().item():
            raise ValueError("NaN activations")
        return self.fc2(h)


def build_eager_only_code():
    model = EagerOnlyCode().cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return model, (x,)
