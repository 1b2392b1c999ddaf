"""`te_compile.prepare(model, recipe)`: create a model's compile-time FP8 state once, before
`torch.compile`, as torchao's `convert_to_float8_training` converts a model before compiling.

Why: traced code may only read state that exists before the graph runs, so without this call
the first trace creates it (modules/persistent_state.py), and to do that without naming a
module instance (regional compilation shares one graph between identical blocks) it finds
the TE GEMM modules by scanning every object the garbage collector tracks: slow in a large
process, and it reaches every live TE module, other models' included. `prepare` walks
`model.modules()` instead, creates the same state with the same functions (DelayedScaling's
`fp8_meta` amax history and scale, registered in TE's global buffers, the module marked as
the trace would mark it) and registers the modules, so that traces of them scan nothing.
Calling it is optional: a module not prepared is found by the scan as before.

Eager TE is unaffected: the state is TE's own (`init_fp8_metadata`, what eager TE's first
FP8 forward creates), and eager forwards keep running TE's own code.
"""

from __future__ import annotations

import torch

from .modules import persistent_state


def prepare(model: torch.nn.Module, recipe=None, amax_reduction_group=None) -> torch.nn.Module:
    """Create the compile-time state of every TE GEMM module (te.Linear, te.LayerNormLinear,
    te.LayerNormMLP, also inside te.TransformerLayer or any container) of `model` for `recipe`
    and register it; returns `model`. Call it once after building the model and before
    `torch.compile`; calling it again is a no-op (or, for another recipe, prepares for that one).

    `recipe`: the recipe the compiled `te.autocast` will use; None is TE's default recipe, as
    `te.autocast(recipe=None)` picks it on this GPU (DelayedScaling on Hopper). DelayedScaling
    gets TE's `fp8_meta` (amax history and scale) per module; the other recipes keep no state
    across steps (FP8 weight caches for `is_first_microbatch` are made at trace time, for the
    prepared modules only, as they cost a weight's memory), so for them only the modules are
    registered. A recipe the compiled path refuses raises here, as it would while tracing.

    `amax_reduction_group`: the one the compiled `te.autocast` will be given (DelayedScaling
    with `reduce_amax`): the state is registered in TE's buffers under it, as eager TE's first
    FP8 forward registers it under its autocast's group, and each autocast exit reduces the
    amaxes of a registration over its group.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("te_compile.prepare: call it before torch.compile, not inside")
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch import quantization

    from .modules.gemm_common import quant_config
    from .recipes import DelayedFields

    if recipe is None:
        recipe = quantization.get_default_fp8_recipe()
    quant_config("te_compile.prepare", recipe)  # refuses what tracing would refuse
    fields = DelayedFields.values_of(recipe) if isinstance(recipe, DelayedScaling) else None
    classes = persistent_state._module_classes()
    for module in model.modules():
        if issubclass(type(module), classes):
            persistent_state.prepare_module(module, fields, amax_reduction_group)
    return model
