"""graph_fp8/te_dbias.py: the bias gradient in the order of TE's fused DelayedScaling cast
kernel (the `graph_dbias` option). Against a loop-by-loop transcription of that kernel's
additions here (float32 numpy, one add at a time), eager and under inductor; the kernel
configuration TE picks; and which op the graph path calls with the option. Against TE's kernel
itself: tests/gpu/test_graph_dbias_gpu.py (a GPU run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformer_engine.pytorch as te
from test_graph_fp8_layers import _trace
from transformer_engine.common import recipe as R

import te_compile
from te_compile.graph_fp8 import te_dbias
from te_compile_testing import JointRecorder, graph_fp8


def _kernel_order(grad: torch.Tensor, r: int) -> torch.Tensor:
    """TE's two kernels' additions, one at a time: per tile of 32 * r rows, each of 8 warps sums
    4 steps of r consecutive rows (a step from 0, then the steps from 0), the warps are added
    in order, then the tiles from 0; rows past the end are zeros."""
    x = grad.float().numpy()
    rows, cols = x.shape
    tiles = -(-rows // (32 * r))
    x = np.concatenate([x, np.zeros((tiles * 32 * r - rows, cols), np.float32)])
    total = np.zeros(cols, np.float32)
    for t in range(tiles):
        warp_sums = []
        for w in range(8):
            acc = np.zeros(cols, np.float32)
            for k in range(4):
                step = np.zeros(cols, np.float32)
                for i in range(r):
                    step = step + x[t * 32 * r + (4 * w + k) * r + i]
                acc = acc + step
            warp_sums.append(acc)
        tile_sum = warp_sums[0]
        for w in range(1, 8):
            tile_sum = tile_sum + warp_sums[w]
        total = total + tile_sum
    return torch.from_numpy(total).to(grad.dtype)


def _gradient(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """bf16 values of mixed magnitudes (sums whose order matters), with -0, +0, tiny and large
    values and a column of -0 only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(
        -6, 6, (rows, cols), generator=g
    )
    x[0, :4] = torch.tensor([-0.0, 0.0, 1e-38, 3e38])
    x[:, 5] = -0.0
    return x.to(torch.bfloat16)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(
    "rows,cols", [(512, 1024), (512, 2048), (1024, 2048), (2048, 8192), (96, 64), (40, 48)]
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_sum_is_the_kernels_order(rows, cols, compiled):
    """Bit for bit the transcription's sum (aligned shapes: R = 1, 2, 4 and 8 of TE's NVRTC
    kernel on 132 SMs; 40 x 48: the static kernel's 8 rows per step, zero-padded), and -0
    summed to +0."""
    grad = _gradient(rows, cols)
    fn = te_dbias.bias_grad
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    got = fn(grad, 132)
    r = te_dbias.rows_per_step(rows, cols, 2, 132)
    want = _kernel_order(grad, r)
    assert got.dtype == torch.bfloat16 and got.shape == (cols,)
    assert _bits_equal(got, want)
    assert got[5].item() == 0.0 and not torch.signbit(got[5])


def test_the_order_matters_here():
    """The test above can fail: where ones sit between +2^k and -2^k, how many of them the big
    value absorbs depends on the order, so torch's sum and the kernel's order with another
    rows-per-step give other bits than this one."""
    rows, cols = 1024, 64
    grad = torch.ones(rows, cols)
    big = 2.0 ** torch.arange(20, 20 + cols).clamp(max=60).float()
    grad[0], grad[rows - 1] = big, -big
    grad = grad.to(torch.bfloat16)
    ours = te_dbias.bias_grad(grad, 132)
    assert _bits_equal(ours, _kernel_order(grad, te_dbias.rows_per_step(rows, cols, 2, 132)))
    assert not _bits_equal(ours, grad.float().sum(0).to(torch.bfloat16))
    assert not _bits_equal(ours, _kernel_order(grad, 8))


def test_rows_per_step_is_tes_configuration(monkeypatch):
    """R of TE's NVRTC kernel by shape on 132 SMs (H100 SXM, H200), another SM count, and the
    static kernel's 8 for unaligned shapes or with NVRTC off."""
    want = {512: [1, 2, 4, 4], 1024: [2, 4, 4, 4], 2048: [4, 4, 4, 8], 4096: [4, 4, 8, 8]}
    for rows, rs in want.items():
        assert [te_dbias.rows_per_step(rows, c, 2, 132) for c in (1024, 2048, 4096, 8192)] == rs
    assert te_dbias.rows_per_step(1024, 8192, 2, 114) == 8
    assert te_dbias.rows_per_step(40, 64, 2, 132) == 8
    monkeypatch.setenv("NVTE_DISABLE_NVRTC", "1")
    assert te_dbias.rows_per_step(512, 1024, 2, 132) == 8


@pytest.fixture
def graph_dbias():
    te_compile.configure(graph_dbias=True)
    yield
    te_compile.configure(graph_dbias=False)


@pytest.mark.parametrize("module", ["linear", "mlp", "layer"])
def test_option_moves_the_biased_cast_into_the_graph(module, patched, graph_breaks, graph_dbias):
    """With graph_dbias a biased module's grad_output cast is graph operations (te.Linear:
    no TE call left in its backward); LayerNormMLP keeps TE's kernel for FC1's GELU gradient,
    whose values no graph operation reproduces; a TransformerLayer's QKV moves."""
    make = {
        "linear": lambda: te.Linear(64, 128, params_dtype=torch.bfloat16).cuda(),
        "mlp": lambda: te.LayerNormMLP(64, 256, params_dtype=torch.bfloat16).cuda(),
        "layer": lambda: te.TransformerLayer(
            64, 256, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16
        ).cuda(),
    }[module]
    _, bw = _trace(make, R.DelayedScaling(amax_history_len=4))
    assert graph_breaks() == 0
    assert bw["delayed_grad_quantize"] == {"linear": 0, "mlp": 1, "layer": 1}[module]


def test_option_is_guarded(patched, graph_breaks):
    """Turning the option on between steps recompiles (dynamo guards on it, read in the
    backward): the next backward has no TE call; turning it off again reuses the first graph."""
    rec = JointRecorder()
    with te_compile.simulate_gpu("hopper"), graph_fp8():
        torch.manual_seed(0)
        module = te.Linear(64, 128, params_dtype=torch.bfloat16).cuda()
        recipe = R.DelayedScaling(amax_history_len=4)

        def fn(x):
            with te.autocast(recipe=recipe):
                return module(x)

        compiled = torch.compile(fn, backend=rec.backend, fullgraph=True)
        for flag in (False, True, False):
            te_compile.configure(graph_dbias=flag)
            x = torch.randn(32, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            compiled(x).float().sum().backward()
        te_compile.configure(graph_dbias=False)
    assert graph_breaks() == 0
    assert (len(rec.fw), len(rec.bw)) == (2, 2)
    calls = [rec.targets([g]) for g in rec.bw]
    assert [any("delayed_grad_quantize" in t for t in c) for c in calls] == [True, False]
