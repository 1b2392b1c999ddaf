"""What `torch.library.opcheck` would check of a te_compile op, done where no GPU is.

opcheck itself checks nothing on fake or meta inputs: each of its tests returns at once when an
input is abstract (`is_abstract` in torch/testing/_internal/optests/generate_tests.py), so it
passes a call with an argument missing or one too many. `opcheck_on_meta` copies the arguments
to the meta device (autograd runs there without a driver; on fake CUDA tensors it does not) and:

1. calls the op, which runs its fake kernel: the call is well-formed, and what comes back has
   the schema's return types, on the inputs' device, none of it an input or a view of one;
2. where an input requires grad: the op has an autograd kernel, and its backward formula, given
   the gradient of the first output, returns one gradient per argument, each of its input's
   shape and dtype or None (read from the formula itself: autograd casts a gradient to its
   input's dtype and sums broadcast dimensions away before anyone else sees it);
3. traces forward and backward with symbolic shapes (`make_fx(tracing_mode="symbolic")`), as
   AOTAutograd does with dynamic shapes: the fake kernels take SymInts.

It cannot compare fake kernels with real ones or see a real kernel mutate an argument its schema
does not declare: tests/gpu opchecks the real kernels for that.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree


def opcheck_on_meta(op: torch._ops.OpOverload, args: tuple, kwargs: dict | None = None) -> None:
    with unset_fake_temporarily():
        args, kwargs = pytree.tree_map_only(torch.Tensor, _to_meta, (args, kwargs or {}))
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = op(*args, **kwargs)
        _check_returns(op, out, inputs)
        wanted = [t for t in inputs if t.requires_grad]
        if wanted:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd"), (
                f"{op.name()}: inputs require grad but the op has no autograd kernel"
            )
            _check_formula_grads(op, args, kwargs, out)
        _trace_symbolic(op, args, kwargs)


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return m.requires_grad_(t.requires_grad)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _check_returns(op, out, inputs: list[torch.Tensor]) -> None:
    returns = op._schema.returns
    values = () if not returns else (out,) if len(returns) == 1 else tuple(out)
    assert len(values) == len(returns), f"{op.name()}: {len(values)} results, schema {returns}"
    for ret, value in zip(returns, values, strict=True):
        is_list = isinstance(ret.type, torch.ListType)
        assert not is_list or isinstance(value, (list, tuple)), (ret, type(value))
        kind = ret.type.getElementType() if is_list else ret.type
        for item in value if is_list else [value]:
            if item is None:
                assert isinstance(kind, torch.OptionalType), f"{op.name()}: None for {ret}"
                continue
            assert isinstance(item, torch.Tensor), f"{op.name()}: {type(item)} for {ret}"
            assert item.device.type == "meta", f"{op.name()}: result on {item.device}"
            for t in inputs:
                assert item is not t and item._base is not t, (
                    f"{op.name()}: a result is an input or a view of one; its schema says neither"
                )


def _backward(out: torch.Tensor, wanted: list[torch.Tensor]):
    return torch.autograd.grad(out, wanted, torch.ones_like(out), allow_unused=True)


def _check_formula_grads(op, args, kwargs, out) -> None:
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    assert outs[0].grad_fn is not None, f"{op.name()}: its first result has no grad_fn"
    grads = [torch.ones_like(outs[0]), *[None] * (len(outs) - 1)]
    # The registered backward, unvalidated: one gradient per tensor of the op's arguments, list
    # arguments flattened (torch.library's autograd wrapper), then Nones for the wrapper's own
    # metadata arguments, which the zip below never reaches.
    got = outs[0].grad_fn.apply(*grads)
    some = False
    for (name, t), g in zip(_flat_arguments(op, args, kwargs), got, strict=False):
        if g is None:
            continue
        assert isinstance(t, torch.Tensor) and t.requires_grad, (
            f"{op.name()}: a gradient for {name}, which needs none"
        )
        assert (g.shape, g.dtype) == (t.shape, t.dtype), (
            f"{op.name()}: gradient of {name} is {tuple(g.shape)} {g.dtype}, "
            f"the input {tuple(t.shape)} {t.dtype}"
        )
        some = True
    assert some, f"{op.name()}: no input got a gradient"


def _flat_arguments(op, args, kwargs):
    """(name, value) per schema argument in order, a list of tensors one entry per tensor (as
    autograd sees them); arguments left at their defaults at the end may be missing there."""
    schema = op._schema.arguments
    values = [*args, *(kwargs.get(a.name, a.default_value) for a in schema[len(args) :])]
    for arg, value in zip(schema, values, strict=True):
        if isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value):
            yield from ((f"{arg.name}[{i}]", t) for i, t in enumerate(value))
        else:
            yield arg.name, value


def _trace_symbolic(op, args, kwargs) -> None:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

    def forward_and_backward(*tensors):
        filled = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            filled[i] = t
        a, kw = pytree.tree_unflatten(filled, spec)
        out = op(*a, **kw)
        wanted = [t for t in tensors if t.requires_grad]
        if not wanted or not _first(out).requires_grad:
            return out
        return out, _backward(_first(out), wanted)

    make_fx(forward_and_backward, tracing_mode="symbolic")(*[leaves[i] for i in where])
