"""What crosses between te.LayerNormMLP's ops: the tensors backward reads (saved by forward)
and the gradients backward computes.

Both ops take the same per-call flags as one key (`MLPFlags.key`): four save flags, decided
from requires_grad at forward as eager TE decides them, and `accumulate` (fuse_wgrad_accumulation
adds to main_grad). `save_norm` (the input or norm parameters need grads: FC1
dgrad and the norm backward), `save_fc1_input` (FC1 wgrad), `save_fc1_out` (anything before FC2
needs grads: FC2 dgrad and the activation backward), `save_fc2_input` (FC2 wgrad). The groups,
in order (`segments`): mu (LayerNorm), rsigma, FC1 input, FC1 weight, FC1 output, FC2 input,
FC2 weight. FP8 operands are their column-wise parts (fp8_operands.py); without FP8 the FC1/FC2
inputs are high-precision tensors and the weights are the op's own inputs (setup_context saves
them; no group here).

The forward op returns every group but the `not_returned` ones, which setup_context adds
(`for_backward`): a cached weight's parts (read from the cache) and, without FP8, a returned
norm output saved as FC1's input (outputs of one op may not alias each other). The backward op
gets the whole list and `split`s it by the same segments.

The backward op returns seven gradients (`GRADIENTS`), an empty [0] tensor for each one it does
not compute (`computed_grads`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels import gemm_layer, tensor_parallel
from ..kernels.activation import output_features
from ..kernels.fp8_operands import columnwise_count, fake_columnwise_parts
from ..recipes import QuantConfig
from ..spec import Spec, labelled, spec

Segments = tuple[tuple[str, int], ...]  # (group name, tensor count)


@spec
class MLPFlags(Spec):
    """What one call saves for backward and how its wgrads land in main_grad."""

    save_norm: bool = labelled("norm", False)
    save_fc1_input: bool = labelled("fc1_in", False)
    save_fc1_out: bool = labelled("fc1_out", False)
    save_fc2_input: bool = labelled("fc2_in", False)
    accumulate: bool = labelled("acc", True)


def segments(cfg: QuantConfig, normalization: str, flags: MLPFlags) -> Segments:
    n = columnwise_count(cfg)
    operand = n if cfg.fp8 else 1  # an FP8 operand's column-wise parts, or one tensor
    return (
        ("mu", int(flags.save_norm and normalization == "LayerNorm")),
        ("rsigma", int(flags.save_norm)),
        ("fc1_input", operand if flags.save_fc1_input else 0),
        ("fc1_weight", n if cfg.fp8 and flags.save_norm else 0),
        ("fc1_out", int(flags.save_fc1_out)),
        ("fc2_input", operand if flags.save_fc2_input else 0),
        ("fc2_weight", n if cfg.fp8 and flags.save_fc1_out else 0),
    )


def not_returned(cfg: QuantConfig, return_ln: bool, fc1_cache: list, fc2_cache: list) -> set:
    names = set()
    if not cfg.fp8 and return_ln:
        names.add("fc1_input")
    if fc1_cache:
        names.add("fc1_weight")
    if fc2_cache:
        names.add("fc2_weight")
    return names


def of_forward(cfg: QuantConfig, normalization: str, return_ln: bool, a) -> tuple[Segments, set]:
    """(segments, not returned groups) of the forward op's call `a`."""
    skip = not_returned(cfg, return_ln, a.fc1_cache, a.fc2_cache)
    return segments(cfg, normalization, MLPFlags.from_key(a.flags)), skip


def returned(segs: Segments, skip: set, group: Callable[[str], list]) -> list:
    """The forward op's saved outputs: `group(name)`'s tensors per returned, non-empty group."""
    return [t for name, count in segs if count and name not in skip for t in group(name)[:count]]


def fake_returned(segs: Segments, skip: set, cfg: QuantConfig, a) -> list:
    """`returned`'s fake twin, for the forward op's arguments `a`."""
    rows, hidden = a.inp.numel() // a.inp.shape[-1], a.inp.shape[-1]
    tp = tensor_parallel.decode(a.parallel)
    total = rows if tp is None else tp.leading(rows, forward=True)  # FC1's output rows

    def empty(shape, dtype=a.out_dtype):
        return a.inp.new_empty(shape, dtype=dtype)

    def operand(shape, local=False):  # local: an FP8 shard backward re-gathers
        if local:
            return tensor_parallel.fake_local_parts(shape, cfg, a.inp)
        return fake_columnwise_parts(shape, cfg, "input", a.inp) if cfg.fp8 else [empty(shape)]

    groups = {
        "mu": lambda: [empty([rows], torch.float32)],
        "rsigma": lambda: [empty([rows], torch.float32)],
        "fc1_input": lambda: operand([rows, hidden], cfg.fp8 and tp and tp.gathers_input),
        "fc1_weight": lambda: fake_columnwise_parts(a.fc1_weight.shape, cfg, "weight", a.inp),
        "fc1_out": lambda: [empty([total, a.fc1_weight.shape[0]])],
        "fc2_input": lambda: operand([total, a.fc2_weight.shape[1]]),
        "fc2_weight": lambda: fake_columnwise_parts(a.fc2_weight.shape, cfg, "weight", a.inp),
    }
    return returned(segs, skip, lambda name: groups[name]())


def for_backward(segs: Segments, skip: set, saved_outputs: list, added: dict) -> list:
    """Every group backward reads: the forward's saved outputs, with the `skip`ped groups
    put back in place from `added` (name: a function returning the group's tensors)."""
    out, i = [], 0
    for name, count in segs:
        if not count:
            continue
        if name in skip:
            out += added[name]()
        else:
            out += saved_outputs[i : i + count]
            i += count
    return out


def split(saved: list, segs: Segments) -> dict[str, list]:
    out, i = {}, 0
    for name, count in segs:
        out[name] = list(saved[i : i + count])
        i += count
    if i != len(saved):
        raise RuntimeError(f"te_compile: layernorm_mlp got {len(saved)} saved tensors, not {i}")
    return out


# ---- the backward op's results -------------------------------------------------------------------

# The backward op's results: the gradients of these forward arguments, in this order.
GRADIENTS = ("inp", "ln_weight", "ln_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


def computed_grads(cfg: QuantConfig, normalization: str, bias_gelu: bool, a) -> tuple[bool, ...]:
    """Which results the backward op's call `a` computes."""
    needs_act = a.needs_norm_grads or a.needs_fc1_wgrad or a.needs_fc1_dbias
    fc1_dbias = cfg.fp8 or bias_gelu or a.needs_fc1_wgrad or a.needs_fc1_dbias
    return (
        a.needs_norm_grads,
        a.needs_norm_grads,
        a.needs_norm_grads and normalization == "LayerNorm",
        a.needs_fc1_wgrad and a.fc1_main_grad is None,
        needs_act and a.fc1_bias is not None and fc1_dbias,
        a.needs_fc2_wgrad and a.fc2_main_grad is None,
        gemm_layer.returns_dbias(cfg, a.fc2_bias is not None, a.needs_fc2_wgrad),
    )


def grad_shapes(a, activation: str) -> tuple[list[int], ...]:
    hidden, fc1 = a.grad_out.shape[-1], a.fc1_features
    ffn = output_features(activation, fc1)
    return (
        list(a.grad_out.shape),
        [hidden],
        [hidden],
        [fc1, hidden],
        [fc1],
        [hidden, ffn],
        [hidden],
    )
