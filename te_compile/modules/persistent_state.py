"""State a compiled TE module keeps across steps: DelayedScaling's amax history and scale
(TE's own `fp8_meta`) and FP8 weight caches (is_first_microbatch).

Traced code may only read state that exists before the graph runs, so it is created at trace
time, eagerly, by `assume_constant_result` functions: dynamo runs them for real while tracing
instead of tracing them, and they are idempotent, so that is safe. The traced code then reads
the real tensors as graph inputs and the ops mutate them in place.

Regional compilation (one `torch.compile` per transformer block, as torchtitan does) reuses one
graph for N identical blocks only if nothing in the trace names a module instance. So these
functions take no module: the first trace creates the state of every live TE GEMM module
(te.Linear, te.LayerNormLinear, te.LayerNormMLP) that needs it (`ensure_*`), and the traced
code then only checks a plain attribute whose value is the same in every block. The live
modules are a registry (`_LIVE`, weak references in construction order): while patched, the
classes' `__init__` and `__setstate__` (copies) add each new instance (`swaps`; TE's and
torch's own methods run unchanged), and modules made before patch() are found by one scan of
the garbage collector's objects, at the first trace after each patch(). Order matters across
ranks: TE's fused update concatenates the amaxes of every registered module, and an amax
reduction over ranks needs the same order on each, which construction order gives. A module
whose DelayedScaling state was made for another recipe is the one case handled per instance
(`reinit_delayed_state`); changing a recipe costs a recompile anyway.

Creating state for modules that never run is harmless: an unrun module's history stays zero
and its scale 1.0 through TE's updates, as a fresh one's would.

State: prepared or discovered. `te_compile.prepare(model, recipe)` (prepare.py) creates the
state of a model's modules before compiling (`prepare_module`, the scan's per-module rules) and
registers them (`_PREPARED`, marked with PREPARED_ATTR, a plain True: the same in every block).
The traced code passes that mark to the `ensure_*` functions, which then cover the prepared
modules only, the traced one among them; for a module not prepared they read the registry
(the fallback). `scans()` counts the scans of the garbage collector (tests).
"""

from __future__ import annotations

import functools
import gc
import weakref

import torch

from ..kernels.fp8_operands import weight_cache_specs
from ..kernels.process_groups import real_group
from ..patching import Swap
from ..recipes import DelayedFields, QuantConfig

# Module attributes (plain values, so guards compare values, not identities).
DELAYED_ATTR = "_te_compile_delayed"  # the DelayedFields tuple the state was made for
WEIGHT_CACHES_ATTR = "_te_compile_weight_caches"  # {cache_key(): (valid, [cache tensors])}
PREPARED_ATTR = "_te_compile_prepared"  # True on the modules te_compile.prepare() registered

_PREPARED: weakref.WeakSet = weakref.WeakSet()  # the modules te_compile.prepare() registered
_SCANS = [0]  # scans of the garbage collector's objects so far
# Every live TE GEMM module te_compile knows of, in registration order (a dict keeps insertion
# order; dead modules drop out). Values unused.
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SCANNED = [False]  # whether the modules made before this patch() were added
_DEFERRED_TRACED = [False]  # whether a module was traced deferring its backward update
# Whether an autocast entered outside compiled code is open (the autocast twins keep it): then
# compiled modules inside it defer their backward DelayedScaling update to its exit.
AUTOCAST_EAGER = [False]


def _module_classes() -> tuple:
    """The TE modules with fp8_meta whose compile paths keep state here."""
    from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear
    from transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP
    from transformer_engine.pytorch.module.linear import Linear

    return Linear, LayerNormLinear, LayerNormMLP


def _track(module) -> None:
    _LIVE.setdefault(module, None)  # (modules hash by identity)


def _live_modules() -> list:
    """The live TE GEMM modules, in registration order."""
    if not _SCANNED[0]:  # those made before patch(): one scan
        _SCANS[0] += 1
        classes = _module_classes()
        # issubclass(type(obj)) rather than isinstance(obj): isinstance reads obj.__class__,
        # which raises on a dead weakref proxy and warns on torch.distributed's reduce_op.
        for obj in [obj for obj in gc.get_objects() if issubclass(type(obj), classes)]:
            _track(obj)
        _SCANNED[0] = True
    return list(_LIVE)


def _tracking(original):
    """`original` (a constructor or `__setstate__`), then the instance registered."""

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _track(self)

    return method


def swaps() -> list[Swap]:
    """The TE GEMM classes' `__init__` and `__setstate__` (what copy.deepcopy and unpickling
    build an instance with), registering each new instance. Modules made while unpatched are
    not registered: the next trace scans for them once."""
    _SCANNED[0] = False
    return [
        Swap(c, name, _tracking(getattr(c, name)))
        for c in _module_classes()
        for name in ("__init__", "__setstate__")
    ]


def scans() -> int:
    """How many times te_compile has scanned the garbage collector's objects (tests)."""
    return _SCANS[0]


def is_prepared(module) -> bool:
    """Whether te_compile.prepare() registered `module` (traced: a guard on a plain value; read
    from the instance dict, where prepare() sets it: getattr's miss on an nn.Module leaves a
    guard that runs nn.Module.__getattr__ on every call)."""
    return bool(module.__dict__.get(PREPARED_ATTR, False))


def _modules(prepared: bool) -> list:
    """The modules an ensure_* function covers: for a traced module that prepare() registered,
    the registered ones (the traced one among them: no scan), else every live one (a scan)."""
    return list(_PREPARED) if prepared else _live_modules()


def prepare_module(module, fields: tuple | None, group=None) -> None:
    """What te_compile.prepare() does to one TE GEMM module: the DelayedScaling state for the
    recipe `fields` (None: a recipe with no such state) and amax reduction `group` that a trace
    would leave (the scan's rule, then reinit_delayed_state's for a module set up for another
    recipe), and registered."""
    if fields is not None:
        group = real_group(group)
        _ensure_delayed(module, fields, DelayedFields(*fields).recipe(), group)
        if getattr(module, DELAYED_ATTR, None) != fields:
            _init_delayed(module, fields, group)
        registered = module.fp8_meta.get("fp8_group")
        if group_mismatch(registered, group):  # TE's buffers cannot move a registration
            raise RuntimeError(
                f"te_compile.prepare: {type(module).__name__}'s DelayedScaling state is already "
                f"registered under amax_reduction_group {_group_label(registered)}, not "
                f"{_group_label(group)} (by eager TE's first FP8 forward, an earlier prepare, or "
                "te_compile's first trace, which registers every live TE module): call prepare "
                "for every model before its first FP8 step and before compiling any model"
            )
    _PREPARED.add(module)
    setattr(module, PREPARED_ATTR, True)


def num_gemms(module) -> int:
    """GEMMs of a module, as TE's init_fp8_metadata counts them (LayerNormMLP: FC1 and FC2)."""
    from transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP

    return 2 if isinstance(module, LayerNormMLP) else 1


def cache_key(name: str, config: str) -> str:
    """Key of the FP8 cache of the GEMM weight `name` for recipe config `config`."""
    return f"{name}|{config}"


def gemm_weight_spec(module, name: str) -> tuple[tuple, str] | None:
    """(shape, str(dtype)) of the high-precision weight GEMM weight `name` quantizes: "weight"
    for te.Linear and te.LayerNormLinear (with parameters_split, the concatenation of the split
    weights along dim 0), "fc1_weight" / "fc2_weight" for te.LayerNormMLP. None if the module
    has no such weight."""
    if name == "weight" and getattr(module, "weight_names", None):
        weights = [getattr(module, n, None) for n in module.weight_names]
        if not all(isinstance(w, torch.Tensor) for w in weights):
            return None  # e.g. a module whose construction raised, still alive in a traceback
        rows = sum(w.shape[0] for w in weights)
        return (rows, *weights[0].shape[1:]), str(weights[0].dtype)
    weight = getattr(module, name, None) if name != "weight" else None
    if not isinstance(weight, torch.Tensor):
        return None
    return tuple(weight.shape), str(weight.dtype)


def _init_delayed(module, fields: tuple, group=None) -> None:
    """Create and register TE's DelayedScaling state for `module`, as eager TE's first FP8
    forward under an autocast with amax reduction group `group` would: TE's buffers are keyed
    by (recipe, group), and the autocast exit reduces each key's amaxes over its group."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    recipe = DelayedFields(*fields).recipe()
    # TE's own initialisation reads the autocast state; give it this recipe for the call.
    saved = manager.get_autocast_state()
    state = manager.quantization_state
    try:
        state.fp8_enabled, state.fp8_calibration = True, False
        state.fp8_recipe, state.fp8_distributed_group = recipe, group
        module.init_fp8_metadata(num_gemms=num_gemms(module))
    finally:
        manager.set_autocast_state(saved)
    manager.add_fp8_tensors_to_global_buffer(module.fp8_meta)
    # The forward update at autocast exit looks the recipe up by key: record it here, where
    # the tensors are registered (the compiled autocast does not write this dict).
    key = manager.get_unique_autocast_key(recipe, group)
    state.autocast_arguments.setdefault(key, (recipe, group))
    setattr(module, DELAYED_ATTR, fields)


@torch.compiler.assume_constant_result
def ensure_delayed_states(fields: tuple, prepared: bool = False, group=None) -> bool:
    """DelayedScaling state (for the recipe `fields`, registered under the autocast's amax
    reduction `group`) for every live TE GEMM module that has no FP8 state yet (`prepared`:
    every prepared module, no scan). Modules eager TE set up are left
    to eager TE unless they are registered in TE's global buffers for this recipe (then only
    marked): registering a module of another model would make compiled code mutate tensors it
    cannot reach through its own modules, which inductor's CUDA graphs refuse (a non-static
    mutated input)."""
    # (no list held across the gc.collect below: it would keep unreachable modules alive)
    if all(getattr(m, DELAYED_ATTR, None) is not None for m in _modules(prepared)):
        return True  # every trace after the first: nothing to create
    recipe = DelayedFields(*fields).recipe()
    if not prepared:
        # Unreachable modules still in gc's lists would be registered too, and the compiled
        # autocast exit's update would then mutate tensors no graph input reaches: CUDA graph
        # trees skip a graph with such a mutated input. Collect them first.
        gc.collect()
    group = real_group(group)
    for module in _modules(prepared):
        _ensure_delayed(module, fields, recipe, group)
    return True


@torch.compiler.assume_constant_result
def group_mismatch(registered, group) -> str:
    """ "" where a module's DelayedScaling state is registered under the autocast's amax
    reduction `group`, else "<registered>, traced under <group>" (their names)."""
    registered, group = real_group(registered), real_group(group)
    if registered is group:
        return ""
    return f"{_group_label(registered)}, traced under {_group_label(group)}"


def _group_label(group) -> str:
    return "None (the default group)" if group is None else repr(group.group_name)


def delayed_modules() -> list:
    """The live TE GEMM modules with DelayedScaling state made by te_compile, in registration
    order (the prepared ones included)."""
    modules = _live_modules()
    modules += [m for m in _PREPARED if m not in _LIVE]
    return [m for m in modules if getattr(m, DELAYED_ATTR, None) is not None]


def autocast_is_eager() -> bool:
    """Traced: whether the FP8 autocast around this code was entered outside compiled code (a
    guard on a plain bool). Its exit is then eager, and can run the backward update compiled
    modules defer to it; an autocast traced in the same graph cannot (AOT autograd refuses a
    tensor mutated both in the forward graph, by the exit, and in the backward graph)."""
    return AUTOCAST_EAGER[0]


@torch.compiler.assume_constant_result
def note_deferred_update() -> bool:
    """Record, at trace time, that a compiled module defers its backward update to an eager
    autocast's exit (from then on eager exits run the deferred updates)."""
    _DEFERRED_TRACED[0] = True
    return True


def deferred_update_traced() -> bool:
    """Whether a compiled module deferring its backward update was traced in this process."""
    return _DEFERRED_TRACED[0]


def _ensure_delayed(module, fields: tuple, recipe, group) -> None:
    """The scan's rule for one module: create state if it has none, adopt eager TE's state if
    TE registered it for `recipe` (under any group: as in eager TE, the first registration
    stays), else leave it (the trace re-initialises it by identity)."""
    if getattr(module, DELAYED_ATTR, None) is not None:
        return
    if not module.fp8_initialized:
        _init_delayed(module, fields, group)
    elif module.fp8_meta.get("recipe") == recipe and _registered(module, recipe):
        setattr(module, DELAYED_ATTR, fields)


def _registered(module, recipe) -> bool:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    key = manager.get_key_in_buffer(True, recipe, module.fp8_meta.get("fp8_group"))
    history = module.fp8_meta["scaling_fwd"].amax_history
    buffer = manager.quantization_state.global_amax_history_buffer.get(key, [])
    return any(h is history for h in buffer)


@torch.compiler.assume_constant_result
def compiled_buffer_positions(key: str) -> tuple:
    """Positions in TE's global amax-history buffer `key` of the TE GEMM modules' state (the
    modules te_compile compiles). Eager TE also registers modules whose FP8 state compiled code
    never uses, e.g. DotProductAttention's after an eager DelayedScaling step (FP8 attention is
    refused under compile): an update of theirs in the graph would mutate tensors no compiled
    module reads, which CUDA graph trees refuse ("mutated inputs"). Their updates are no-ops:
    nothing records amaxes into them."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as manager

    histories = manager.quantization_state.global_amax_history_buffer.get(key, [])
    ours = _history_ids(_PREPARED)
    if not all(id(h) in ours for h in histories):  # not all prepared modules': scan
        ours = _history_ids(_live_modules())
    return tuple(i for i, h in enumerate(histories) if id(h) in ours)


def _history_ids(modules) -> set:
    return {
        id(getattr(m.fp8_meta[name], "amax_history", None))
        for m in modules
        for name in ("scaling_fwd", "scaling_bwd")
        if name in getattr(m, "fp8_meta", {})
    }


@torch.compiler.assume_constant_result
def reinit_delayed_state(module_id: int, fields: tuple, group=None) -> bool:
    """DelayedScaling state for the recipe `fields` and amax reduction `group` for one module
    that has state for another recipe."""
    prepared = [m for m in _PREPARED if id(m) == module_id]
    for module in prepared or _live_modules():
        if id(module) == module_id:
            _init_delayed(module, fields, real_group(group))
            return True
    raise RuntimeError(f"te_compile: no live TE GEMM module with id {module_id}")


@torch.compiler.assume_constant_result
def ensure_weight_caches(
    config: str, name: str, shape: tuple, dtype: str, prepared: bool = False
) -> bool:
    """An FP8 cache for config `config` of GEMM weight `name` (see gemm_weight_spec) in every
    live TE GEMM module (`prepared`: every prepared one, no scan) whose such weight has `shape`
    and `dtype` (its str()): empty, and marked invalid until quantize_weight fills it."""
    cfg = QuantConfig.from_key(config)
    specs = weight_cache_specs(cfg, shape)
    key = cache_key(name, config)
    for module in _modules(prepared):
        if gemm_weight_spec(module, name) != (shape, dtype):
            continue
        caches = module.__dict__.get(WEIGHT_CACHES_ATTR)
        if caches is None:
            caches = {}
            setattr(module, WEIGHT_CACHES_ATTR, caches)
        if key not in caches:
            like = next(module.parameters())
            with torch.no_grad():
                valid = like.new_zeros([1], dtype=torch.float32)
                parts = [like.new_empty(s, dtype=d) for s, d in specs]
            caches[key] = (valid, parts)
    return True
