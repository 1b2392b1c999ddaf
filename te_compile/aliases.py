"""TE's deprecated aliases `fp8_autocast` and `fp8_model_init`, made compile-aware.

Both are still what older training code calls: accelerate's `apply_fp8_autowrap` wraps a
model's forward in `te.fp8_autocast(enabled=..., fp8_recipe=...)`, TE's own HF Llama tutorial
imports `fp8_model_init`. In TE 2.20 each one calls `warnings.warn(DeprecationWarning)` and
then forwards to `te.autocast` / `te.quantized_model_init`. Dynamo cannot trace
`warnings.warn` ("Attempted to call function marked as skipped ... _warnings.warn"), so under
`torch.compile(fullgraph=True)` either alias fails although the function it forwards to traces.

The twins, when not compiling, call TE's own function unchanged, warning included
(`fp8_autocast`'s warning is re-issued at its caller's line, where TE points it). While dynamo
traces they call what TE forwards to with the same arguments, without the warning, so the
graph is the one `te.autocast` gives.

Code that binds the alias before `te_compile.patch()` (accelerate's `apply_fp8_autowrap`
imports `fp8_autocast` into a closure when it wraps the forward) keeps TE's original: call
`te_compile.patch()` first.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .patching import Swap


def _q():
    from transformer_engine.pytorch import quantization

    return quantization


def _call_warning_at_caller(fn, *args):
    """`fn(*args)`, with the warnings it issues re-issued two frames up: at the line that called
    the twin, which is where TE's `stacklevel=2` points them when its alias is called directly."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    for w in caught:
        warnings.warn(w.message, w.category, stacklevel=3)
    return result


def make_fp8_autocast(original):
    @functools.wraps(original)
    def fp8_autocast(
        enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False
    ):
        if not torch.compiler.is_compiling():
            return _call_warning_at_caller(
                original, enabled, calibrating, fp8_recipe, fp8_group, _graph
            )
        return _q().autocast(
            enabled=enabled,
            calibrating=calibrating,
            recipe=fp8_recipe,
            amax_reduction_group=fp8_group,
            _graph=_graph,
        )

    return fp8_autocast


def make_fp8_model_init(original):
    @functools.wraps(original)
    def fp8_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
        # TE's is a @contextmanager: its warning is issued on entering the returned object,
        # so returning it unchanged keeps TE's behaviour exactly.
        if not torch.compiler.is_compiling():
            return original(enabled, recipe, preserve_high_precision_init_val)
        return _q().quantized_model_init(
            enabled=enabled,
            recipe=recipe,
            preserve_high_precision_init_val=preserve_high_precision_init_val,
        )

    return fp8_model_init


def swaps() -> list[Swap]:
    """`fp8_autocast` and `fp8_model_init` in `transformer_engine.pytorch.quantization`; the
    Patcher swaps TE's re-exports (`te.fp8_autocast`, `transformer_engine.pytorch.fp8.*`) too."""
    q = _q()
    return [
        Swap(q, "fp8_autocast", make_fp8_autocast(q.fp8_autocast)),
        Swap(q, "fp8_model_init", make_fp8_model_init(q.fp8_model_init)),
    ]
