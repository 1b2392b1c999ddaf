"""Ops returning `list[Tensor]` on torch < 2.14 (ops/registry.py): their kernels and fakes add
one trailing empty tensor, which calling through the `Op` and its autograd wrappers drop, since
inductor's C++ wrapper there dereferenced a null tensor for a one-element list result
(pytorch#190551: a segmentation fault; te_compile's fused_attn_bwd gives one for packed QKV).
Here the padding is forced on, whatever the torch, with CPU kernels for toy ops."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import Tensor

from te_compile.ops import registry

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU kernels of toy ops")


def _declare(impl, pad_lists: bool) -> registry.Op:
    declared = registry.Op(impl, (), pad_lists=pad_lists)
    registry._LIB.impl(declared.name, declared.kernel, "CPU")
    return declared


def _doubled(x: Tensor) -> list[Tensor]:
    return [x * 2]


def _doubled_padded(x: Tensor) -> list[Tensor]:
    return [x * 2]


DOUBLED = _declare(_doubled, pad_lists=False)
PADDED = _declare(_doubled_padded, pad_lists=True)
for declared in (DOUBLED, PADDED):
    declared.fake(lambda a: [torch.empty_like(a.x)])
    declared.autograd(lambda ctx, a, output: None, lambda ctx, grads: {"x": grads[0] * 2})


def test_the_op_gives_the_declared_list():
    x = torch.arange(4.0)
    padded = PADDED.packet(x)
    assert len(padded) == 2 and padded[1].numel() == 0
    for declared in (DOUBLED, PADDED):
        (y,) = declared(x)
        torch.testing.assert_close(y, x * 2)


def test_fake_and_autograd_see_the_declared_list():
    for declared in (DOUBLED, PADDED):
        x = torch.arange(4.0, requires_grad=True)

        def f(x, declared=declared):
            (y,) = declared(x)
            return (y * y).sum()

        torch.compile(f, backend="aot_eager", fullgraph=True)(x).backward()
        torch.testing.assert_close(x.grad, 8 * x.detach())  # d/dx (2x)^2


def test_a_one_element_list_runs_under_the_cpp_wrapper():
    """The crash itself, in a process of its own: compiled with inductor's C++ wrapper, a padded
    one-element list op runs and gives eager's result (unpadded, torch 2.11 segfaults here)."""
    script = textwrap.dedent(
        """
        import torch
        import torch._inductor.config as config
        from torch import Tensor
        from te_compile.ops import registry

        def _cpp_wrapper_probe(x: Tensor) -> list[Tensor]:
            return [x * 2]

        op = registry.Op(_cpp_wrapper_probe, (), pad_lists=True)
        registry._LIB.impl(op.name, op.kernel, "CPU")
        op.fake(lambda a: [torch.empty_like(a.x)])
        config.cpp_wrapper = True

        def f(x):
            (y,) = op(x.cos())
            return y.exp()

        x = torch.randn(8, 16)
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), f(x))
        print("ran")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ran" in done.stdout, (done.returncode, done.stderr[-3000:])
