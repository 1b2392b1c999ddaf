"""DelayedScaling's parts of the graph path (graph_fp8/linear.py, mlp.py): the scales and their
reciprocals, the casts with a module's scale, grad_output's cast with a bias (TE's fused kernel,
or graph operations summing dbias in that kernel's order, te_dbias.py), and the backward's
amax record and update.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from .. import options
from ..kernels.fp8_operands import delayed_slot
from ..recipes import ROLES, QuantConfig
from . import delayed_update, quantize, te_dbias


class Scales(NamedTuple):
    """A direction's DelayedScaling scales and their reciprocals (TE's scale_inv, quantize.py's
    arithmetic), taken once per module: one small kernel for every slot, where a reciprocal
    per quantized tensor is a launch of its own (inductor does not fuse [1]-sized work into
    the casts). `inverse` is [slots, SCALE_INV_ROW]: cuBLASLt refuses a scale pointer 4 bytes
    into a buffer (CUBLAS_STATUS_NOT_SUPPORTED, seen on the H100), so each slot's reciprocal
    starts a row of 512 bytes, the caching allocator's alignment of a tensor of its own."""

    scale: torch.Tensor
    inverse: torch.Tensor

    @staticmethod
    def of(scale: torch.Tensor) -> Scales:
        # each row holds its reciprocal SCALE_INV_ROW times (only the first is read)
        rows = quantize.reciprocal(scale)[:, None]
        return Scales(scale, rows.expand(-1, SCALE_INV_ROW).contiguous())

    def inverse_of(self, slot: int) -> torch.Tensor:
        """[1] scale_inv of `slot`, aligned as a tensor of its own (for the GEMMs)."""
        return self.inverse[slot, :1]


SCALE_INV_ROW = 128  # float32 elements: 512 bytes


def quantize_delayed(
    t, scales: Scales, cfg: QuantConfig, role: int, stored=True, gemm=0, rows=False
):
    """DelayedScaling's (FP8 data, scale_inv, amax, or with `rows` its row maxima) of `t` for
    `role` (an index into ROLES) of GEMM `gemm`, with the scale of TE's slot in `scales`, as
    quantize.quantize_delayed computes them. `stored`: the bf16 value `t` holds; else a fused
    producer's float32 value, cast as TE casts it."""
    slot = delayed_slot(ROLES[role], gemm)
    t = quantize.stored_bf16(t) if stored else t
    return quantize.quantize_delayed(
        t, scales.scale[slot : slot + 1], cfg.dtypes[role], scales.inverse_of(slot), rows
    )


def in_slots(like: torch.Tensor, amaxes: dict) -> torch.Tensor:
    """float32 `like`-shaped [n]: `amaxes[slot]` ([1] tensors) at their slots, 0 elsewhere, as
    selects inductor fuses into their producers (a cat of [1] tensors is a kernel of its own)."""
    slot = torch.arange(like.shape[0], device=like.device)
    out = torch.full_like(like, 0.0, dtype=torch.float32)
    for i, amax in amaxes.items():
        out = torch.where(slot == i, amax, out)
    return out


def delayed_grad_with_dbias(
    grad2d, scale: torch.Tensor, cfg: QuantConfig, gemm=0, act_input=None, act=""
):
    """(dbias, FP8 data, its transpose, scale_inv, amax) of `grad2d` by TE's fused kernel
    (te_compile::delayed_grad_quantize): grad_output's of GEMM `gemm`, or with `act_input` the
    activation `act`'s gradient (LayerNormMLP's FC1), with the backward scales `scale`
    (scale_for_te_cast's). TE's kernel writes the scale_inv the GEMMs read: no Scales."""
    slot = delayed_slot("grad", gemm)
    return torch.ops.te_compile.delayed_grad_quantize(grad2d, act_input, scale, slot, cfg.key, act)


def delayed_grad_with_bias(grad2d, bwd_scale, cfg: QuantConfig, gemm=0, te_scale=None):
    """(dbias, FP8 data, its transpose or None, scale_inv, amax) of grad_output `grad2d` of GEMM
    `gemm`, whose module has a bias: TE's fused kernel (delayed_grad_with_dbias; `te_scale`, its
    scales if the caller has them), or with the `graph_dbias` option the cast as graph
    operations and the sum in that kernel's order (te_dbias.py)."""
    if options.current().graph_dbias:
        gq, g_si, amax = quantize_grad(grad2d, bwd_scale, cfg, gemm)
        return te_dbias.bias_grad(grad2d), gq, None, g_si, amax
    scale = scale_for_te_cast(cfg, bwd_scale, grad2d) if te_scale is None else te_scale
    return delayed_grad_with_dbias(grad2d, scale, cfg, gemm)


def _graph_updates(cfg: QuantConfig) -> bool:
    return delayed_update.applies(cfg.amax_algo, cfg.margin, cfg.fused_update)


def _te_op_updates_in_backward(cfg: QuantConfig) -> bool:
    """TE's update op writes the backward scales later in the same backward graph (no deferred
    update, and an update the graph operations do not cover): reads before it take a copy."""
    return not (cfg.defers_backward_update or _graph_updates(cfg))


# Without Triton (a CPU-only torch) the graph operations compute the same update. Read once at
# import: a call traced by dynamo (a backward's update) would step into importlib, which dynamo
# refuses to trace (torch 2.11, session 44), cached or not.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def backward_scales(scale: torch.Tensor, grad: torch.Tensor, cfg: QuantConfig) -> Scales:
    """The backward scales grad_output's cast reads and their reciprocals, read in the backward.
    Where nothing in this backward writes TE's tensor, or the graph's own update does
    (_te_op_updates_in_backward false), the read is tied to `grad` (read_with): the partitioner,
    which may compute in the forward graph and save what depends on forward inputs alone, must
    keep it in the backward (the autocast exit updates the scales in between); inductor fuses
    it into the cast and launches it before the update (tests/cpu/test_backward_scale_read.py).
    Under TE's update op in the same graph it is a copy (te_compile::scale_in_backward), ordered
    before that op: read in place there, a fused cast once ran after the op's write (torch 2.11
    on the H100)."""
    if _te_op_updates_in_backward(cfg):
        return Scales.of(torch.ops.te_compile.scale_in_backward(scale, grad))
    return Scales.of(read_with(scale, grad))


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def read_with(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`t` as a value of `grad`: a select of `t` by a condition that is always false but is
    computed from grad's first element (its bits compared with themselves, integers, so even a
    NaN gradient gives false). A select moves bits without arithmetic, so NaN, infinities and
    signed zeros come through as they are; and `t` enters no operation before it meets `grad`,
    so the partitioner cannot save a view of it either. Slices, views, `!=`, `where` and
    `full_like` only: operations the cast kernels it fuses into already name (the 150-character
    cut of quantize.py's docstring)."""
    first = grad[(slice(0, 1),) * grad.dim()].reshape(1)
    bits = first.view(_SAME_SIZE_INT[first.element_size()])
    return torch.where(bits != bits, torch.full_like(t, 0.0), t)


def quantize_grad(grad2d, bwd_scale, cfg: QuantConfig, gemm=0):
    """(FP8 data, scale_inv, amax) of grad_output `grad2d` of GEMM `gemm` cast in the graph,
    with the backward scales read in the backward (backward_scales)."""
    return quantize_delayed(grad2d, backward_scales(bwd_scale, grad2d, cfg), cfg, 2, gemm=gemm)


def scale_for_te_cast(cfg: QuantConfig, scale: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The backward scales delayed_grad_with_dbias reads. TE's op takes the gradient, so the
    partitioner cannot move its read into the forward graph, and it reads the tensor itself
    where nothing in this backward writes it (deferred update) or the write is a graph
    operation (functionalized, after every read); under TE's update kernel in the same graph
    it reads a copy (backward_scales' reason). One copy kernel less per module: a
    TransformerLayer's three biased modules need none."""
    if _te_op_updates_in_backward(cfg):
        return torch.ops.te_compile.scale_in_backward(scale, grad)
    return scale


def update_backward_state(cfg: QuantConfig, scale, history, grad_amaxes: list) -> None:
    """Record the module's grad_output amaxes (one per GEMM, in GEMM order) into row 0 of TE's
    backward history, max with what is there, as TE's cast records it (a module used twice in
    a step merges twice). Under an eager autocast that is all: its exit updates the state
    (QuantConfig.defers_backward_update). Otherwise the module's own update runs here: as graph
    operations (delayed_update.py) where they are TE's arithmetic, else TE's kernel."""
    # each GEMM's backward slots: grad_output (its amax), grad_input (none recorded)
    slots = {delayed_slot("grad", gemm): a for gemm, a in enumerate(grad_amaxes)}
    if cfg.defers_backward_update:
        amaxes = in_slots(history[0], slots)
        # Every read of the history in one operation with the amaxes (a max with 0 leaves rows
        # 1.. as they are): a read of it alone could be moved into the forward graph, and the
        # autocast exit rolls the history between forward and backward. The whole tensor: a
        # row's copy_ in a backward graph fails AOT autograd's partitioner (torch 2.11:
        # "select_scatter was invalid, but is output").
        rows = torch.nn.functional.pad(amaxes[None], (0, 0, 0, history.shape[0] - 1))
        history.copy_(torch.maximum(history, rows))
        return
    if _graph_updates(cfg) and options.current().triton_history_update and HAS_TRITON:
        from . import history_kernel  # noqa: F401  (registers the op; imported once it is used)

        torch.ops.te_compile.delayed_history_update(
            history,
            scale,
            list(slots.values()),
            list(slots),
            cfg.amax_algo == "most_recent",
            delayed_update.scaled_max(cfg.dtypes[2], cfg.margin),
        )
        return
    latest = torch.maximum(history[0], in_slots(history[0], slots))
    if _graph_updates(cfg):
        new_history, new_scale = delayed_update.updated(
            history, scale, latest, cfg.amax_algo, cfg.dtypes[2], cfg.margin
        )
        history.copy_(new_history)
        scale.copy_(new_scale)
        return
    torch.ops.te_compile.amax_and_scale_update(
        [history], [scale], cfg.amax_algo, cfg.dtypes[2], cfg.margin, cfg.fused_update, latest
    )
