"""The te_compile ops checked without a GPU (tests/meta_opcheck.py: the call, the fake kernel's
results against the schema, the autograd registration and gradients, a symbolic-shape trace of
forward and backward); and that check failing where it must. `torch.library.opcheck` checks
nothing on fake inputs. The real kernels are opchecked in tests/gpu.
"""

from __future__ import annotations

import linear_cases
import pytest
import torch
from meta_opcheck import opcheck_on_meta
from transformer_engine.common import recipe as R

import te_compile.ops  # noqa: F401  (registers the ops)
from te_compile.recipes import for_linear

RECIPES = {
    "none": (lambda: None, "hopper"),
    "current": (R.Float8CurrentScaling, "hopper"),
    "block": (R.Float8BlockScaling, "hopper"),
    "delayed": (R.DelayedScaling, "hopper"),
    "mxfp8": (R.MXFP8BlockScaling, "blackwell"),
    "nvfp4": (R.NVFP4BlockScaling, "blackwell"),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_ops_opcheck_on_fake(name, bias, fake_gpu, fake_cuda):
    fake_gpu(RECIPES[name][1])
    make, _ = RECIPES[name]
    args = linear_cases.fwd_args(
        for_linear(make(), fp8_transpose=True).key, bias, name == "delayed"
    )
    opcheck_on_meta(torch.ops.te_compile.linear_fwd.default, args)
    opcheck_on_meta(torch.ops.te_compile.linear_bwd.default, linear_cases.bwd_args(args))


def test_amax_and_scale_update_opcheck_on_fake(fake_cuda):
    histories = [torch.rand(4, 3, device="cuda"), torch.rand(4, 1, device="cuda")]
    scales = [torch.ones(3, device="cuda"), torch.ones(1, device="cuda")]
    opcheck_on_meta(
        torch.ops.te_compile.amax_and_scale_update.default,
        (histories, scales, "max", "e4m3", 0.0, True),
    )


@pytest.mark.parametrize("act", ["", "gelu"])
def test_graph_path_ops_opcheck_on_fake(act, fake_gpu, fake_cuda):
    """The ops graph_fp8 keeps out of inductor (ops/graph_path.py), DelayedScaling's fused
    dbias cast with and without the GELU gradient before it."""
    fake_gpu("hopper")
    grad = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    key = for_linear(R.DelayedScaling(), fp8_transpose=True).key
    act_input = torch.randn_like(grad) if act else None
    scale = torch.ones(1, device="cuda")
    opcheck_on_meta(
        torch.ops.te_compile.delayed_grad_quantize.default,
        (grad, act_input, torch.ones(3, device="cuda"), 1, key, act),
    )
    opcheck_on_meta(torch.ops.te_compile.bias_grad.default, (grad,))
    data = torch.empty(64, 32, device="cuda", dtype=torch.float8_e4m3fn)
    opcheck_on_meta(torch.ops.te_compile.fp8_transpose.default, (data,))
    other, si = torch.empty(48, 32, device="cuda", dtype=torch.float8_e4m3fn), scale
    for transpose_b in (True, False):
        args = (data, si, other, si, None, torch.bfloat16, True, transpose_b)
        opcheck_on_meta(torch.ops.te_compile.scaled_mm_transposing.default, args)
        y, copy = torch.ops.te_compile.scaled_mm_transposing(*args)
        assert (y.shape, y.dtype) == ((64, 48), torch.bfloat16)
        assert copy.shape == ((32, 48) if transpose_b else (32, 64))


# ---- the check can fail -------------------------------------------------------------------------

_TEST_LIB = torch.library.Library("te_compile_checker_test", "FRAGMENT")
_TEST_LIB.define("missing(Tensor x, int n) -> Tensor")
_TEST_LIB.define("returns_input(Tensor x) -> Tensor")
_TEST_LIB.define("wrong_grad(Tensor x) -> Tensor")
_TEST_LIB.define("no_autograd(Tensor x) -> Tensor")
_TEST_LIB.impl("returns_input", lambda x: x, "Meta")
for _name in ("missing", "wrong_grad", "no_autograd"):
    _TEST_LIB.impl(_name, lambda x, *rest: torch.empty_like(x), "Meta")
_TEST_LIB.define("float_grad(Tensor x) -> Tensor")
_TEST_LIB.define("broadcast_grad(Tensor x) -> Tensor")
for _name in ("float_grad", "broadcast_grad"):
    _TEST_LIB.impl(_name, lambda x: torch.empty_like(x), "Meta")
# backward formulas autograd would refuse (a shape it cannot sum to the input's) or silently
# repair (a float32 gradient for a bfloat16 input; a leading dimension it sums away)
for _name, _formula in [
    ("wrong_grad", lambda ctx, g: g[:1]),
    ("float_grad", lambda ctx, g: g.float()),
    ("broadcast_grad", lambda ctx, g: g.unsqueeze(0).expand(3, *g.shape)),
]:
    torch.library.register_autograd(f"te_compile_checker_test::{_name}", _formula, lib=_TEST_LIB)
_OPS = torch.ops.te_compile_checker_test


@pytest.mark.parametrize(
    "op,args,message",
    [
        (_OPS.missing.default, (), "missing value for argument 'n'"),
        (_OPS.missing.default, (3, 4), "expected at most 2"),
        (_OPS.returns_input.default, (), "is an input or a view"),
        (_OPS.wrong_grad.default, (), "gradient of x is .1, 4."),
        (_OPS.float_grad.default, (), "gradient of x is .8, 4. torch.float32"),
        (_OPS.broadcast_grad.default, (), "gradient of x is .3, 8, 4."),
        (_OPS.no_autograd.default, (), "no autograd kernel"),
    ],
)
def test_meta_opcheck_fails_where_it_must(op, args, message, fake_cuda):
    x = torch.randn(8, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises((AssertionError, RuntimeError), match=message):
        opcheck_on_meta(op, (x, *args))


@pytest.mark.parametrize("op", ["scale_snapshot", "scale_in_backward"])
def test_scale_copies_opcheck_on_fake(op, fake_cuda):
    """DelayedScaling's scale copies (ops/delayed_scaling.py); `scale_in_backward` also takes a
    gradient, read only as a dependency."""
    scale = torch.ones(3, device="cuda")
    args = (scale,) if op == "scale_snapshot" else (scale, torch.randn(8, 4, device="cuda"))
    opcheck_on_meta(getattr(torch.ops.te_compile, op).default, args)
