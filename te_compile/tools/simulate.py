"""`te_compile.simulate_gpu(arch)`: run TE model code as if on a GPU of `arch`, on any machine.

Within the block, on a machine with or without a GPU:

- what the code puts on "cuda" lands on the meta device (tensors with shape, dtype and
  autograd, no data, no driver): tensor factories' `device=` argument, `Tensor.to`,
  `Tensor.cuda` and so `Module.cuda`/`Module.to`, in eager code and in code dynamo traces
  (the factories dynamo traces past a TorchFunctionMode, e.g. `torch.arange` on torch 2.11,
  are wrapped while simulating);
- `torch.cuda`'s device queries (`is_available`, `device_count`, `current_device`,
  `get_device_capability`, `get_device_properties`, `get_device_name`) answer as one GPU of
  `arch` would, so TE modules construct;
- TE's support checks (FP8, block scaling, MXFP8, NVFP4) and its compute-capability query
  answer as that GPU would; TE's caches of device answers are cleared on entry and exit;
- te-compile's compiled path accepts the meta tensors (it does everywhere: a meta tensor runs
  our ops' fake kernels), so `torch.compile(..., fullgraph=True)` traces TE modules forward
  and backward, `recipe=None` and `enabled=False` included, and nothing touches a driver.

Why meta and not FakeTensorMode's fake CUDA tensors: the autograd engine asks the CUDA driver
about the device of every CUDA tensor it differentiates, fake or not (torch's
`hasPrimaryContext` check), so a backward trace on fake CUDA tensors needs a GPU. Meta tensors
carry the same shapes, dtypes and strides; only `tensor.device` reads "meta".

Everything is restored on exit. The simulation itself uses public torch APIs
(`torch.overrides.TorchFunctionMode`); three shims for compiled code on meta tensors reach into
torch internals, lazily and only while simulating (simulate_compiler_shims.py): AOTAutograd's
RNG-replay wrappers (a checkpointed random op, recomputed in backward), inductor's check that
refuses to decompose a mutating custom op whose inputs are meta tensors, and inductor's
replacement of meta outputs by value-less nodes (torch 2.11's partitioner refuses those).
Nothing runs: eager TE kernels called on meta tensors fail, as they would without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

from . import simulate_compiler_shims as compiler_shims

_MXFP8_NO = "Device compute capability 10.0 or higher required for MXFP8 execution."
_NVFP4_NO = "Device compute capability 10.0 or higher required for NVFP4 execution."


@dataclasses.dataclass(frozen=True)
class SimulatedGPU:
    """What a simulated GPU answers: its name, compute capability, SM count, memory, and the
    (supported, reason) answers TE caches for its recipe support checks."""

    arch: str
    name: str
    capability: tuple[int, int]
    sm_count: int
    total_memory: int
    mxfp8: tuple[bool, str]
    nvfp4: tuple[bool, str]

    def device_properties(self, **extra) -> types.SimpleNamespace:
        """What torch.cuda.get_device_properties answers for this GPU (plus `extra` fields)."""
        return types.SimpleNamespace(
            name=self.name,
            major=self.capability[0],
            minor=self.capability[1],
            multi_processor_count=self.sm_count,
            total_memory=self.total_memory,
            **extra,
        )

    def te_support_answers(self) -> dict[str, tuple[bool, str]]:
        return {
            "_FP8_SUPPORT": (True, ""),
            "_FP8_BLOCK_SCALING_SUPPORT": (True, ""),
            "_MXFP8_SUPPORT": self.mxfp8,
            "_NVFP4_SUPPORT": self.nvfp4,
        }


_GIB = 1 << 30
ARCHS = {
    "hopper": SimulatedGPU(
        "hopper", "NVIDIA H100", (9, 0), 132, 80 * _GIB, (False, _MXFP8_NO), (False, _NVFP4_NO)
    ),
    "blackwell": SimulatedGPU(
        "blackwell", "NVIDIA B200", (10, 0), 148, 180 * _GIB, (True, ""), (True, "")
    ),
}
_ALIASES = {"sm90": "hopper", "sm100": "blackwell", "h100": "hopper", "b200": "blackwell"}


def simulated_gpu(arch: str) -> SimulatedGPU:
    """The SimulatedGPU for "hopper"/"sm90" or "blackwell"/"sm100" (case-insensitive)."""
    key = _ALIASES.get(arch.lower(), arch.lower())
    if key not in ARCHS:
        names = ", ".join([*ARCHS, *_ALIASES])
        raise ValueError(f"simulate_gpu: unknown arch {arch!r}; expected one of {names}")
    return ARCHS[key]


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means cuda


_META = torch.device("meta")


class _CudaToMeta(TorchFunctionMode):
    """Places on the meta device what the code asks to place on "cuda"."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _META
        if func is torch.Tensor.cuda:
            return args[0].to(_META, **{k: v for k, v in kwargs.items() if k != "device"})
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _META, *args[2:])
        return func(*args, **kwargs)


# torch factories that dynamo before torch 2.14 (2.11 measured) traces without calling an active
# TorchFunctionMode, so the mode never sees their `device="cuda"` (it does see torch.zeros,
# ones, empty and full, and every call with a tensor argument). Replaced by wrappers while
# simulating, which dynamo traces like any Python function.
_FACTORIES = (
    "arange",
    "range",
    "linspace",
    "logspace",
    "tensor",
    "as_tensor",
    "asarray",
    "scalar_tensor",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_strided",
    "tril_indices",
    "triu_indices",
)


def _cuda_on_meta(create):
    """`create` (a torch factory) with a "cuda" `device=` replaced by meta; other devices and
    no device (torch's default) stay as they are."""

    def create_cuda_on_meta(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _META
        return create(*args, **kwargs)

    create_cuda_on_meta.__name__ = create_cuda_on_meta.__qualname__ = create.__name__
    return create_cuda_on_meta


def _available_unless_torch_asks(real) -> bool:
    """torch.cuda.is_available() for the simulation: True for TE and user code; torch's own
    callers (dynamo saves the CUDA RNG state and checks stream capture when CUDA is
    available) get the real answer, so torch's bookkeeping never reaches for a driver."""
    caller = sys._getframe(1).f_globals.get("__name__", "")
    return real() if caller == "torch" or caller.startswith("torch.") else True


def _on_meta(create):
    @functools.wraps(create)
    def create_on_meta(*args, device=None, **kwargs):
        return create(
            *args, device=_META if device is None or _is_cuda(device) else device, **kwargs
        )

    return create_on_meta


def _traced_only(update: classmethod) -> classmethod:
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        if torch.compiler.is_compiling():
            return update.__func__(cls, forward)
        return None

    return classmethod(reduce_and_update_fp8_tensors)


def _te_device_caches():
    """TE's functools caches of device answers: cleared on entry and exit, so neither the real
    GPU's answers leak into the simulation nor the simulated ones out of it."""
    from transformer_engine.pytorch import utils

    names = ("_get_device_compute_capability", "is_non_tn_fp8_gemm_supported", "get_sm_count")
    return [getattr(utils, n) for n in names if hasattr(getattr(utils, n, None), "cache_clear")]


_MISSING = object()


@contextlib.contextmanager
def _attributes(assignments):
    """Set (owner, name, value) attributes; restore them all on exit. A class attribute is
    saved as stored (a staticmethod stays one; an inherited one is deleted again)."""

    def stored(owner, name):
        return vars(owner).get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name)

    saved = [(owner, name, stored(owner, name)) for owner, name, _ in assignments]
    try:
        for owner, name, value in assignments:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _simulated_fused_attn_backend(**config):
    """TE's cuDNN sub-backend query (tex.get_fused_attn_backend, a driver call) answered as
    cuDNN 9 answers it on sm90/sm100 for the common cases: F16/BF16 with head dims that are
    multiples of 8 up to 256 -> F16_arbitrary_seqlen (1); FP8 -> FP8 (2); else none (-1)."""
    import transformer_engine_torch as tex

    dtype = config["qkv_dtype"]
    dims = (config["head_dim_qk"], config["head_dim_v"])
    if dtype in (tex.DType.kFloat8E4M3, tex.DType.kFloat8E5M2):
        return 2, ""
    if dtype in (tex.DType.kFloat16, tex.DType.kBFloat16):
        if all(d % 8 == 0 and d <= 256 for d in dims):
            return 1, ""
        return -1, f"simulated cuDNN: head dims {dims} not multiples of 8 up to 256"
    return -1, f"simulated cuDNN: qkv dtype {dtype} not supported"


_ACTIVE: list[SimulatedGPU] = []


@contextlib.contextmanager
def simulate_gpu(arch: str = "hopper"):
    """Run TE model code as if on one GPU of `arch` ("hopper"/"sm90", "blackwell"/"sm100"),
    placing "cuda" tensors on the meta device; see this module's docstring. Yields the
    SimulatedGPU.

        with te_compile.simulate_gpu("hopper"):
            model = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device="cuda")
            x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with te.autocast(recipe=DelayedScaling()):
                out = torch.compile(model, fullgraph=True)(x)
            out.sum().backward()   # traced: the graphs exist, nothing ran on a GPU
    """
    gpu = simulated_gpu(arch)
    if _ACTIVE:  # nested: the outer simulation stays in force
        if _ACTIVE[-1] != gpu:
            raise ValueError(f"simulate_gpu({arch!r}) inside simulate_gpu({_ACTIVE[-1].arch!r})")
        yield gpu
        return
    from transformer_engine.pytorch import quantization, utils

    props = gpu.device_properties()
    # TE's own is an assume_constant_result function: keep that, compiled code differs.
    capability = torch.compiler.assume_constant_result(functools.partial(tuple, gpu.capability))
    cuda = torch.cuda
    assignments = [(quantization, n, v) for n, v in gpu.te_support_answers().items()]
    assignments += [(m, "get_device_compute_capability", capability) for m in (quantization, utils)]
    assignments += [
        (cuda, "is_available", functools.partial(_available_unless_torch_asks, cuda.is_available)),
        (cuda, "device_count", lambda: 1),
        (cuda, "current_device", lambda: 0),
        (cuda, "get_device_capability", lambda device=None: gpu.capability),
        (cuda, "get_device_properties", lambda device=None: props),
        (cuda, "get_device_name", lambda device=None: gpu.name),
    ]
    # TE allocates DelayedScaling state on torch.device("cuda") at te_compile's trace-time state
    # creation (an assume_constant_result call, run outside this block's TorchFunctionMode).
    recipe_state = quantization.RecipeState
    create = vars(recipe_state)["create"]
    assignments.append((recipe_state, "create", staticmethod(_on_meta(create.__func__))))
    # te.autocast's exit outside compiled code runs TE's DelayedScaling update kernel eagerly;
    # there is nothing to compute on meta tensors (inside compiled code it is traced as usual).
    manager = quantization.FP8GlobalStateManager
    update = vars(manager)["reduce_and_update_fp8_tensors"]
    assignments.append((manager, "reduce_and_update_fp8_tensors", _traced_only(update)))
    # TE's cuDNN attention sub-backend query reaches the driver: answered by a rule.
    from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa_utils

    answer = torch.compiler.assume_constant_result(_simulated_fused_attn_backend)
    assignments.append((dpa_utils, "_get_fused_attn_backend", answer))
    assignments += [
        (torch, n, _cuda_on_meta(getattr(torch, n))) for n in _FACTORIES if hasattr(torch, n)
    ]
    caches = _te_device_caches()
    for cache in caches:
        cache.cache_clear()
    _ACTIVE.append(gpu)
    try:
        with _attributes(assignments), compiler_shims.rng_replay_on_meta():
            with compiler_shims.inductor_decomposes_meta_mutations():
                with compiler_shims.meta_outputs_keep_their_values(), _CudaToMeta():
                    yield gpu
    finally:
        _ACTIVE.pop()
        for cache in caches:
            cache.cache_clear()
