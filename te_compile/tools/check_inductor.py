"""`te_compile.check(..., backend="inductor")`: each case's graphs compiled by inductor as for a
GPU of the simulated arch, on any machine. Nothing runs on a GPU.

A case traces as every check case does (meta tensors under `simulate_gpu`), through inductor's
`compile_fx`: its decompositions, joint-graph passes and min-cut partitioner, as
`torch.compile(backend="inductor")` runs them. Each forward and backward graph that
`compile_fx` hands to its inner compiler is then copied onto fake CUDA tensors (same shapes,
strides and dtypes; the copy's metadata propagated again) and compiled by inductor's
`compile_fx_inner`: post-grad passes (reinplacing, the decomposition of mutating custom ops),
lowering, scheduling, fusion and code generation of the wrapper and its Triton kernels, with
inductor's device queries answered as the simulated GPU would (Triton target sm90/sm100). It
stops where inductor would load the generated module: compiling the Triton kernels needs a
GPU. The case then runs the graphs as they are, on meta tensors.

Why not inductor on the meta tensors themselves (what `torch.compile(backend="inductor")` does
under `simulate_gpu`): inductor does not generate code for the meta device. Its joint-graph
pass replaces every meta output with an empty tensor, dropping the computation before
lowering, and its pattern passes skip nodes with meta inputs (a mutating custom op's
`auto_functionalized_v2` node then stays: "auto_functionalized_v2 was not removed", which
`simulate_gpu` now works around). A trace on meta tensors checks dynamo and AOTAutograd; this
checks inductor's compile as well.

Limits: the joint-graph passes run on meta tensors (their pattern rewrites skip there, and
uniform-value constant folding is off: on meta it drops the graph); shapes are static, as in
a first compile; inductor's caches are off during the case.

Diagnostics code: torch._inductor internals, imported lazily.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from unittest import mock

import torch

from ..errors import TECompileError
from .check_trace import Recorder, boxed_runner
from .simulate import simulated_gpu

_CUDA = torch.device("cuda", 0)
# What inductor reads of a device beyond what simulate_gpu's properties carry (H100 and B200
# share these; L2 is per arch below).
_PROPERTIES = dict(
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    warp_size=32,
    shared_memory_per_block=48 * 1024,
    shared_memory_per_block_optin=227 * 1024,
    shared_memory_per_multiprocessor=228 * 1024,
    gcnArchName="",
    is_integrated=False,
    is_multi_gpu_board=False,
)
_L2 = {"hopper": 50 << 20, "blackwell": 126 << 20}


class _Generated(Exception):
    """Raised where inductor would load the module it generated: the compile got that far."""

    def __init__(self, source: str):
        super().__init__("inductor generated its code")
        self.source = source


def _stop_before_loading(graph_lowering):
    wrapper, _ = graph_lowering.codegen()
    raise _Generated(getattr(wrapper, "value", str(wrapper)))


class _TritonTarget:
    """Triton's active driver for code generation: the target of the simulated GPU."""

    def __init__(self, capability: tuple[int, int]):
        self.capability = capability

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.capability[0] * 10 + self.capability[1], 32)

    def get_current_device(self):
        return 0

    def get_device_capability(self, device=0):
        return self.capability

    def get_current_stream(self, device=0):
        return 0

    def get_active_torch_device(self):
        return _CUDA

    def get_device_interface(self):
        return torch.cuda


def _device_caches():
    """functools caches of device answers inductor keeps: cleared on entry and exit."""
    import torch.utils._triton as triton_utils
    from torch._inductor import utils
    from torch._inductor.runtime.hints import DeviceProperties

    found = [
        getattr(triton_utils, "has_triton", None),
        getattr(triton_utils, "triton_backend", None),
        getattr(triton_utils, "triton_hash_with_backend", None),
        DeviceProperties.create,
        getattr(utils, "is_big_gpu", None),
        getattr(utils, "get_gpu_dram_gbps", None),
    ]
    return [f for f in found if hasattr(f, "cache_clear")]


@contextlib.contextmanager
def _simulated_cuda(arch: str):
    """Inductor's view of CUDA answered as one GPU of `arch` would (compile only)."""
    try:
        from torch._dynamo import device_interface
        from torch._inductor.graph import GraphLowering
        from triton.runtime.driver import driver
    except ImportError as e:
        raise TECompileError(
            f"the inductor check needs torch._inductor and Triton, which do not import: {e}"
        ) from e
    gpu = simulated_gpu(arch)
    props = gpu.device_properties(L2_cache_size=_L2.get(gpu.arch, 50 << 20), **_PROPERTIES)
    cuda = device_interface.CudaInterface
    capability = gpu.capability[0] * 10 + gpu.capability[1]
    answers = {
        "get_device_properties": lambda device=None: props,
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "get_compute_capability": lambda device=None: capability,
        "exchange_device": lambda device: 0,
        "maybe_exchange_device": lambda device: 0,
        "get_raw_stream": lambda device: 0,
        "is_bf16_supported": lambda including_emulation=True: True,
    }
    caches = _device_caches()
    with contextlib.ExitStack() as stack:
        for name, answer in answers.items():
            stack.enter_context(mock.patch.object(cuda, name, staticmethod(answer)))
        stack.enter_context(
            mock.patch.dict(device_interface.caching_worker_device_properties, {"cuda": [props]})
        )
        stack.enter_context(
            mock.patch.object(torch.cuda, "get_device_properties", answers["get_device_properties"])
        )
        stack.enter_context(mock.patch.object(driver, "_active", _TritonTarget(gpu.capability)))
        stack.enter_context(
            mock.patch.object(GraphLowering, "compile_to_module", _stop_before_loading)
        )
        for cache in caches:
            cache.cache_clear()
        stack.callback(lambda: [cache.cache_clear() for cache in caches])
        yield


@contextlib.contextmanager
def _outside_simulation():
    """simulate_gpu's mapping of "cuda" to meta suspended (its TorchFunctionMode and factory
    wrappers), so that inductor's own fake CUDA tensors stay on CUDA."""
    from .simulate import _FACTORIES

    functions = torch._C._VariableFunctions
    with contextlib.ExitStack() as stack:
        for name in _FACTORIES:
            real = getattr(functions, name, None)
            if real is not None and getattr(torch, name) is not real:
                stack.enter_context(mock.patch.object(torch, name, real))
        modes = []
        while torch._C._len_torch_function_stack():
            modes.append(torch._C._pop_torch_function_stack())
        for mode in reversed(modes):
            stack.callback(torch._C._push_on_torch_function_stack, mode)
        yield


def _on_fake_cuda(gm: torch.fx.GraphModule, example_inputs):
    """A copy of `gm` whose tensors are fake CUDA tensors: device arguments, inputs and every
    node's metadata. Returns (graph module, inputs, fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.utils._python_dispatch import _disable_current_modes

    mode = FakeTensorMode()

    def fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        with _disable_current_modes():
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, _CUDA)

    def on_cuda(arg):
        return _CUDA if isinstance(arg, torch.device) and arg.type == "meta" else arg

    graph = copy.deepcopy(gm.graph)  # node metadata is copied shallowly, replaced below
    for node in graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, on_cuda)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, on_cuda)
    copied = torch.fx.GraphModule(gm, graph)
    inputs = [fake(t) for t in example_inputs]
    FakeTensorProp(copied, mode).propagate_dont_convert_inputs(*inputs)
    for node in copied.graph.nodes:  # what inductor's auto_functionalized decomposition reads
        if "eager_input_vals" in node.meta:
            vals = node.meta["eager_input_vals"]
            node.meta["eager_input_vals"] = torch.utils._pytree.tree_map_only(
                torch.Tensor, fake, vals
            )
    return copied, inputs, mode


def _generated_source(e: BaseException) -> str | None:
    seen: list[BaseException] = []
    while e is not None and e not in seen:
        if isinstance(e, _Generated):
            return e.source
        seen.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None


def compile_for_gpu(gm: torch.fx.GraphModule, example_inputs, arch: str, **kwargs) -> str:
    """Inductor's inner compile of `gm` (an AOTAutograd graph on meta tensors) as for one GPU
    of `arch`, up to its generated code, which is returned ("" when there is nothing to
    compile). Inductor's errors propagate."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    with _outside_simulation():
        copied, inputs, mode = _on_fake_cuda(gm, example_inputs)
        with _simulated_cuda(arch), V.set_fake_mode(mode), tracing(TracingContext(mode)):
            try:
                compile_fx_inner(copied, inputs, **kwargs)
            except Exception as e:
                source = _generated_source(e)
                if source is None:
                    raise
                return source
    return ""


class InductorRecorder(Recorder):
    """A torch.compile backend: inductor's `compile_fx` whose inner compiler compiles each
    graph for the simulated GPU (`compile_for_gpu`) and keeps it; the case runs the graphs as
    they are, on meta tensors."""

    def __init__(self, arch: str):  # noqa: D107  (Recorder's AOTAutograd backend is not used)
        try:
            from torch._inductor.compile_fx import compile_fx
        except ImportError as e:  # pragma: no cover
            raise TECompileError(f"the inductor check needs torch._inductor: {e}") from e
        self.graphs: list[torch.fx.GraphModule] = []
        self.sources: list[str] = []
        self.arch = arch
        self.backend = functools.partial(compile_fx, inner_compile=self._inner)

    def _inner(self, gm, example_inputs, **kwargs):
        self.graphs.append(gm)
        self.sources.append(compile_for_gpu(gm, example_inputs, self.arch, **kwargs))
        return boxed_runner(gm)

    @contextlib.contextmanager
    def context(self):
        """Inductor's caches off (a cache hit would load code) and no compile workers."""
        from torch._functorch import config as aot_config
        from torch._inductor import config

        with (
            config.patch(fx_graph_cache=False, joint_graph_constant_folding=False),
            config.patch(compile_threads=1),
            aot_config.patch(enable_autograd_cache=False),
        ):
            yield

    def triton_kernels(self) -> int:
        return sum(source.count("@triton.jit") for source in self.sources)
