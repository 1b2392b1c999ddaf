"""te.TransformerLayer's bias-dropout-add under compile (modules/transformer_layer.py): the
swap adds the bias itself and hands TE's unfused path the sum (session 50). On the CPU with
`backend="aot_eager"` (every op rounded to its dtype, as eager) and dropout 0, its outputs and
gradients equal TE's own function's for each branch: a bf16 bias, no bias, a float32 layer, a
float32 bias beside bf16 activations (the gradient rounding must not apply), and a drop path.
The rounding itself is checked on inductor's code (test_residual_rounding.py) and on the GPU
(tests/gpu/test_first_compile_gpu.py)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

CASES = {
    "bf16_bias": (torch.bfloat16, torch.bfloat16, False),
    "no_bias": (torch.bfloat16, None, False),
    "fp32_layer": (torch.float32, torch.float32, False),
    "fp32_bias": (torch.bfloat16, torch.float32, False),
    "drop_path": (torch.bfloat16, torch.bfloat16, True),
}


def _layer():
    """The attributes TE's `_bias_dropout_add` reads (a stand-in for te.TransformerLayer), with
    TE's unfused add: eager, so the reference compiles nothing."""
    return types.SimpleNamespace(
        bias_dropout_fusion=False,
        training=True,
        hidden_dropout=0.0,
        bias_dropout_add_exec_handler=contextlib.nullcontext,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_swap_equals_te_on_every_branch(case):
    from transformer_engine.pytorch.transformer import TransformerLayer

    from te_compile.modules.transformer_layer import make_bias_dropout_add

    dtype, bias_dtype, with_drop_path = CASES[case]
    original = vars(TransformerLayer)["_bias_dropout_add"]
    swapped = make_bias_dropout_add(original)
    drop_path = (lambda t: t * 0.5) if with_drop_path else None
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(16, 2, 32, generator=g).to(dtype) for _ in range(2))
    bias = None if bias_dtype is None else torch.randn(32, generator=g).to(bias_dtype)
    grad = torch.randn(16, 2, 32, generator=g)

    def run(fn, layer):
        leaves = [t.clone().requires_grad_() for t in (x, residual)]
        b = None if bias is None else bias.clone().requires_grad_()
        out = fn(layer, leaves[0], b, leaves[1], drop_path)
        out.backward(grad.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves] + ([] if b is None else [b.grad])

    torch._dynamo.reset()
    compiled = torch.compile(swapped, backend="aot_eager", fullgraph=True)
    got = run(compiled, _layer())
    want = run(original, _layer())
    for g_, w in zip(got, want, strict=True):
        assert g_.dtype == w.dtype
        torch.testing.assert_close(g_, w, rtol=0, atol=0)
