"""The `triton_history_update` option on the GPU: graph_fp8/history_kernel.py's backward history
roll and scale update against TE's fused DelayedScaling update kernel
(tex.fused_amax_and_scale_update_after_reduction), bit for bit, eager and compiled, over
histories with zeros, denormals, huge values, infinities and NaN; then modules trained compiled
with the option against eager TE (histories and scales included).

    PYTHONPATH=$PWD python3 -m pytest tests/gpu/test_history_kernel_gpu.py -m gpu -q
"""

from __future__ import annotations

import option_training
import pytest
import torch
import transformer_engine_torch as tex

from te_compile.graph_fp8 import delayed, delayed_update

pytestmark = pytest.mark.gpu

TE_DTYPE = {"e4m3": tex.DType.kFloat8E4M3, "e5m2": tex.DType.kFloat8E5M2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, except a NaN's payload: Triton may return a canonical NaN where torch.maximum
    returns its NaN operand (session 43, under inductor); a NaN amax has no other effect."""
    both_nan = got.isnan() & want.isnan()
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(
        _bits(got)[~both_nan], _bits(want)[~both_nan]
    )


def _values(shape, generator) -> torch.Tensor:
    """float32 over its whole range: denormals to 3e38, with zeros, infinities and NaN."""
    exponents = torch.randint(-45, 39, shape, generator=generator).float()
    values = torch.rand(shape, generator=generator) * 10.0**exponents
    values[torch.rand(shape, generator=generator) < 0.15] = 0.0
    values[torch.rand(shape, generator=generator) < 0.03] = float("nan")
    values[torch.rand(shape, generator=generator) < 0.03] = float("inf")
    return values.cuda()


def _update(history, scale, amaxes, slots, algo, fp8, margin):
    torch.ops.te_compile.delayed_history_update(
        history, scale, amaxes, slots, algo == "most_recent", delayed_update.scaled_max(fp8, margin)
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 4, 1024])
def test_update_is_tes_kernel(length, algo, fp8, margin, compiled):
    from te_compile.graph_fp8 import history_kernel  # noqa: F401  (registers the op)

    generator = torch.Generator().manual_seed(length + margin)
    update = torch.compile(_update, fullgraph=True) if compiled else _update
    torch._dynamo.reset()
    for trial in range(20):
        slots = [0] if trial % 2 else [0, 2]  # te.Linear's one GEMM, LayerNormMLP's two
        n = 2 * len(slots)
        history, scale = _values((length, n), generator), _values((n,), generator).abs()
        amaxes = [_values((1,), generator) for _ in slots]
        latest = torch.maximum(
            history[0], delayed.in_slots(history[0], dict(zip(slots, amaxes, strict=True)))
        )
        want_h, want_s = history.clone(), scale.clone()
        tex.fused_amax_and_scale_update_after_reduction(
            latest, [want_h], [want_s], algo, TE_DTYPE[fp8], float(margin)
        )
        update(history, scale, amaxes, slots, algo, fp8, margin)
        assert _same(history, want_h), trial
        assert _same(scale, want_s), trial


# The option's training checks (option_training.py): LayerNormMLP, LayerNormLinear and a
# TransformerLayer trained with it against eager TE.
(
    option,
    test_layernorm_mlp_trains_as_eager_te,
    test_layernorm_linear_trains_as_eager_te,
    test_transformer_layer_matches_eager,
) = option_training.tests("triton_history_update")
