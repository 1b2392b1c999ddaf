"""TE's DelayedScaling state (a module's `fp8_meta`) for modules traced by torch.compile.

Eager TE creates the state in the first FP8 forward (`init_fp8_metadata`) and registers it in
its global amax buffers. Under compile that must happen for real, once, before the traced code
reads the tensors; otherwise the tensors would be created inside the graph and the next step
would recompile. `ensure_delayed_state` does it at trace time: it is an
`assume_constant_result` function, which dynamo runs eagerly while tracing instead of tracing
it. It is idempotent (running it again changes nothing), so that is safe; the traced code then
reads TE's real `fp8_meta` tensors as graph inputs, and ops mutate them in place.

Dynamo passes only constants to such a function, so the module travels as `id(module)` and the
recipe as its plain fields (`DelayedFields`): an equal recipe object built fresh each step gives
the same fields and so no recompile.
"""

from __future__ import annotations

import gc
import weakref

import torch

from ..recipes import DelayedFields

_MODULES_BY_ID: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _module_by_id(module_id: int):
    module = _MODULES_BY_ID.get(module_id)
    if module is None:
        # First sighting: index every live TE module once (ids are only unique among live
        # objects, hence the weak values).
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

        for obj in gc.get_objects():
            # type() first: isinstance() on a dead weakref proxy raises ReferenceError.
            if type(obj) not in weakref.ProxyTypes and isinstance(obj, TransformerEngineBaseModule):
                _MODULES_BY_ID[id(obj)] = obj
        module = _MODULES_BY_ID.get(module_id)
    if module is None:
        raise RuntimeError(f"te_compile: no live TE module with id {module_id}")
    return module


@torch.compiler.assume_constant_result
def ensure_delayed_state(module_id: int, fields: tuple, num_gemms: int) -> bool:
    """Create and register TE's DelayedScaling state for the module, as eager TE would."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    module = _module_by_id(module_id)
    recipe = DelayedFields(*fields).recipe()
    # TE's own initialisation reads the autocast state; give it this recipe for the call.
    saved = manager.get_autocast_state()
    state = manager.quantization_state
    try:
        state.fp8_enabled, state.fp8_calibration = True, False
        state.fp8_recipe, state.fp8_distributed_group = recipe, None
        module.init_fp8_metadata(num_gemms=num_gemms)
    finally:
        manager.set_autocast_state(saved)
    manager.add_fp8_tensors_to_global_buffer(module.fp8_meta)
    # The forward update at autocast exit looks the recipe up by key: record it here, where
    # the tensors are registered (the compiled autocast does not write this dict).
    key = manager.get_unique_autocast_key(recipe, None)
    state.autocast_arguments.setdefault(key, (recipe, None))
    return True
