"""te.DotProductAttention, te.MultiheadAttention and te.TransformerLayer under torch.compile.

Not compiling: TE's own code, unchanged. While dynamo traces:

- `DotProductAttention.forward` is swapped for `compiled_dpa_forward`
  (dot_product_attention.py): TE's argument handling (mask type, window, diagonal alignment,
  sequence lengths, packed `qkv_layer`/`kv_layer`), then the backend eager TE would pick,
  chosen at trace time by TE's own `get_attention_backend` run on the same parameters
  (attention_backends.py), then
  - FusedAttention (cuDNN, TE's default on Hopper): one `te_compile::fused_attn_fwd` op,
  - UnfusedDotProductAttention (when forced, e.g. NVTE_FUSED_ATTN=0 without flash-attn):
    TE's own module, which TE 2.20 wrote traceable (its softmax kernels are TE custom ops),
  - FlashAttention (when forced, e.g. NVTE_FUSED_ATTN=0 with flash-attn installed): TE's own
    module, traced: flash-attn >= 2.7 registers its kernels as torch custom ops; older
    flash-attn, FlashAttention 3 and 4 are refused by name.
- `MultiheadAttention.forward`: TE's forward, traced, after refusing what the compiled path
  does not cover (FP8 attention, KV caching). Its pieces that dynamo cannot trace are swapped:
  `SplitAlongDim.apply` (a data-pointer test in backward) becomes `torch.split`, and
  `apply_rotary_pos_emb(fused=True)` becomes `te_compile::fused_rope_fwd` (TE's kernel).
- `TransformerLayer.forward` is TE's, traced (its LayerNormMLP, norms and linears are the
  te_compile compiled paths).

What is refused by name (UnsupportedUnderCompileError): attention_refusals.py.
"""

from __future__ import annotations

import torch

from .. import ops  # noqa: F401  (registers the te_compile ops)
from ..patching import Swap
from . import attention_refusals as refusals
from .dot_product_attention import compiled_dpa_forward


def _binder(original, method: bool = True):
    """A function mapping (args, kwargs) of a call of `original` (a method: `self` excluded) to
    a dict of every parameter (defaults filled in). Generated with the names and defaults
    written in as constants: dynamo traces it, and reading them from a table there put a guard
    on every entry into each compiled frame (about 70 of a TransformerLayer's guard lines)."""
    import ast
    import inspect

    def literal(value) -> bool:
        try:
            return type(ast.literal_eval(repr(value))) is type(value)
        except (ValueError, SyntaxError):
            return False

    params = list(inspect.signature(original).parameters.values())[1 if method else 0 :]
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    # Defaults that are not literals (none in TE 2.20) are read from a table: one guard each.
    entries = [
        f"{n!r}: {v!r}" if literal(v) else f"{n!r}: table[{n!r}]" for n, v in defaults.items()
    ]
    source = (
        "def bind(args, kwargs):\n"
        f"    call = {{{', '.join(entries)}}}\n"
        f"    call.update(zip({names!r}, args))\n"
        "    call.update(kwargs)\n"
        "    return call\n"
    )
    namespace = {"table": defaults}
    exec(compile(source, f"<bind {original.__qualname__}>", "exec"), namespace)  # noqa: S102
    return namespace["bind"]


def make_dpa_forward(original):
    bind = _binder(original)

    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return original(self, *args, **kwargs)
        return compiled_dpa_forward(self, bind(args, kwargs))

    forward.__doc__ = original.__doc__
    return forward


# ---- MultiheadAttention ------------------------------------------------------------------------


def make_mha_forward(original):
    bind = _binder(original)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            refusals.check_mha_options(bind(args, kwargs)["inference_params"])
        return original(self, *args, **kwargs)

    forward.__doc__ = original.__doc__
    return forward


def make_update_roles(original):
    """MultiheadAttention._update_output_quantizer_roles: with no FP8 boundary (what the
    compiled path allows, FP8 attention refused) every role is None; setting them without
    reading the submodules' names keeps the traced code free of per-layer guards (each
    layer's names differ: one recompile per block under regional compilation)."""
    bind = _binder(original)

    def _update_output_quantizer_roles(self, *args, **kwargs):
        flags = bind(args, kwargs)
        if not torch.compiler.is_compiling() or any(flags.values()):
            return original(self, *args, **kwargs)
        if self.attention_type == "self":
            qkv_linears = [self.layernorm_qkv if self.input_layernorm else self.qkv]
        else:
            query = self.layernorm_query if self.input_layernorm else self.query_layer
            qkv_linears = [query, self.key_value]
        roles = [(linear, "output_quantizer_role") for linear in qkv_linears] + [
            (self.proj, "grad_input_quantizer_role"),
            (self.core_attention, "output_quantizer_role"),
            (self.core_attention, "grad_input_quantizer_role"),
        ]
        for module, attr in roles:
            # Written only when not None already: a module attribute write inside
            # torch.utils.checkpoint is a side effect dynamo refuses (torch 2.11).
            if getattr(module, attr, None) is not None:
                setattr(module, attr, None)

    _update_output_quantizer_roles.__doc__ = original.__doc__
    return _update_output_quantizer_roles


# ---- pieces of MultiheadAttention's forward ----------------------------------------------------


def make_split_along_dim(original):
    """TE's SplitAlongDim (an autograd.Function) when not compiling; torch.split while tracing:
    the same views, and a backward that concatenates, as TE's does unless the gradients
    already share one buffer (a data-pointer test dynamo cannot trace). A plain class: dynamo
    traces `Function.apply` of a Function subclass itself, bypassing an overridden apply."""

    class SplitAlongDim:
        __doc__ = original.__doc__

        @staticmethod
        def apply(*args):
            if not torch.compiler.is_compiling():
                # TE's backward returns one gradient per argument its callers pass (3 without
                # `squeeze`): pass exactly the caller's arguments.
                return original.apply(*args)
            tensor, split_dim, split_size_or_sections, *rest = args
            squeeze = bool(rest[0]) if rest else False
            refusals.check_split_input(tensor)
            parts = torch.split(tensor, split_size_or_sections, dim=split_dim)
            return tuple(p.squeeze(split_dim) for p in parts) if squeeze else parts

    return SplitAlongDim


def make_apply_rotary_pos_emb(original):
    bind = _binder(original, method=False)

    def apply_rotary_pos_emb(*args, **kwargs):
        call = bind(args, kwargs)
        if not (torch.compiler.is_compiling() and call["fused"]):
            # Not compiling (exactly the caller's arguments), or TE's unfused RoPE (plain
            # PyTorch, traceable).
            return original(*args, **kwargs)
        tensor_format, cu_seqlens, freqs = call["tensor_format"], call["cu_seqlens"], call["freqs"]
        if tensor_format == "thd" and cu_seqlens is None:
            raise ValueError("cu_seqlens must not be None when tensor_format is 'thd'.")
        if tensor_format not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"Unsupported tensor_format: {tensor_format}.")
        if freqs.dtype != torch.float32:  # as TE's FusedRoPEFunc
            freqs = freqs.float()
        return torch.ops.te_compile.fused_rope_fwd(
            call["t"],
            freqs,
            call["start_positions"],
            cu_seqlens,
            tensor_format,
            bool(call["interleaved"]),
            int(call["cp_size"]),
            int(call["cp_rank"]),
        )

    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def swaps() -> list[Swap]:
    from transformer_engine.pytorch import utils
    from transformer_engine.pytorch.attention import multi_head_attention as mha_module
    from transformer_engine.pytorch.attention import rope
    from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
        DotProductAttention,
    )

    mha = mha_module.MultiheadAttention
    return [
        Swap(
            DotProductAttention, "forward", make_dpa_forward(vars(DotProductAttention)["forward"])
        ),
        Swap(mha, "forward", make_mha_forward(vars(mha)["forward"])),
        Swap(
            mha,
            "_update_output_quantizer_roles",
            make_update_roles(vars(mha)["_update_output_quantizer_roles"]),
        ),
        Swap(utils, "SplitAlongDim", make_split_along_dim(utils.SplitAlongDim)),
        Swap(rope, "apply_rotary_pos_emb", make_apply_rotary_pos_emb(rope.apply_rotary_pos_emb)),
    ]
