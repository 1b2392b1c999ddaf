"""The `graph_dbias` option on the GPU: graph_fp8/te_dbias.py's sum against the dbias of TE's
fused DelayedScaling cast kernel (tex.bgrad_quantize with a Float8Quantizer of both usages), bit
for bit over shapes that pick each of TE's kernel configurations; then modules with biases
trained compiled with the option against eager TE.

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_graph_dbias_gpu.py -m gpu -q
"""

from __future__ import annotations

import option_training
import pytest
import torch
import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

from te_compile.graph_fp8 import te_dbias

pytestmark = pytest.mark.gpu

# (rows, columns): NVRTC's configurations of 1, 2, 4 and 8 rows per step on 132 SMs, and
# shapes not multiples of 32 (TE's static kernel, 8 rows per step)
SHAPES = [(512, 1024), (512, 2048), (2048, 2048), (2048, 8192), (64, 128), (1000, 3072), (40, 48)]


def _gradient(shape) -> torch.Tensor:
    """Magnitudes over twelve decades (sums whose order matters), ±0 and a column of -0."""
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda") * 10.0 ** torch.randint(-6, 6, shape, device="cuda")
    x[:, 3] = -0.0
    x[0, :3] = torch.tensor([-0.0, 1e-38, 3e38])
    return x.to(torch.bfloat16)


def _tes_dbias(grad: torch.Tensor) -> torch.Tensor:
    scale, amax = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    quantizer = Float8Quantizer(scale, amax, tex.DType.kFloat8E5M2)
    quantizer.set_usage(rowwise=True, columnwise=True)
    dbias, _ = tex.bgrad_quantize(grad, quantizer)
    return dbias


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_sum_is_tes_fused_dbias(shape, patched):
    """te_dbias.bias_grad, eager and compiled, against TE's kernel: 0 bits apart."""
    grad = _gradient(shape)
    want = _tes_dbias(grad)
    assert torch.equal(te_dbias.bias_grad(grad).view(torch.int16), want.view(torch.int16))
    got = torch.compile(te_dbias.bias_grad)(grad)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# The option's training checks (option_training.py): LayerNormMLP, LayerNormLinear and a
# TransformerLayer trained with it against eager TE.
(
    option,
    test_layernorm_mlp_trains_as_eager_te,
    test_layernorm_linear_trains_as_eager_te,
    test_transformer_layer_matches_eager,
) = option_training.tests("graph_dbias")
