"""TE's torch.compile'd fusions called from an op body compile one entry whatever dispatch-key
context the op body runs in (on an H100, CUDA-graph capture compiled a second entry and broke)."""

import torch

from te_compile.kernels.activation import _stable_keys


def _counted_fusion():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    return torch.compile(lambda x, b: torch.tanh(x + b) * 0.5, backend=counter), counter


def _below_inplace_or_view():  # the context an op body may run in
    return torch._C._AutoDispatchBelowADInplaceOrView()


def test_one_compiled_entry_whatever_the_dispatch_context():
    fused, counter = _counted_fusion()
    x, b = torch.randn(8, 16), torch.nn.Parameter(torch.randn(16))
    want = torch.tanh(x + b.detach()) * 0.5
    with torch.no_grad():
        plain = _stable_keys(fused, x, b)
        with _below_inplace_or_view():
            below = _stable_keys(fused, x, b)
    assert counter.frame_count == 1
    assert torch.equal(plain, want) and torch.equal(below, want)
    assert plain.is_inference()  # callers clone what leaves the op


def test_the_plain_call_would_compile_twice():
    """The failure the aliases avoid: the same call without them compiles two entries."""
    fused, counter = _counted_fusion()
    x, b = torch.randn(8, 16), torch.randn(16)
    with torch.no_grad():
        fused(x, b)
        with _below_inplace_or_view():
            fused(x, b)
    assert counter.frame_count == 2
