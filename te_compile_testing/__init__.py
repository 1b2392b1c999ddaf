"""Helpers for te-compile's tests and CPU demo (a package of its own: library code never
imports it, and it may use private torch APIs).

`pretend_gpu("hopper")` makes TE believe it sits on a GPU generation by pinning the answers TE
caches for its support checks and its compute-capability query. It lets a machine without a GPU
trace TE code for that generation; nothing runs on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from te_compile.tools import simulate

# name: (compute capability, the support answers TE would cache on that GPU), from the table
# te_compile.simulate_gpu answers with.
GENERATIONS = {
    name: (gpu.capability, gpu.te_support_answers()) for name, gpu in simulate.ARCHS.items()
}


@contextlib.contextmanager
def pretend_gpu(generation: str):
    """Within the block, TE's support checks answer as on `generation` (see GENERATIONS)."""
    from transformer_engine.pytorch import quantization as q
    from transformer_engine.pytorch import utils

    cc, answers = GENERATIONS[generation]
    saved = [(q, name, getattr(q, name)) for name in answers]
    saved += [
        (m, "get_device_compute_capability", m.get_device_compute_capability) for m in (q, utils)
    ]
    try:
        for name, value in answers.items():
            setattr(q, name, value)
        for mod in (q, utils):
            # TE's own is an assume_constant_result function: keep that, compiled code differs
            mod.get_device_compute_capability = torch.compiler.assume_constant_result(lambda: cc)
        yield cc
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


@dataclasses.dataclass
class RecordingBackend:
    """A torch.compile backend that keeps every graph it is handed and runs it as is."""

    graphs: list = dataclasses.field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self) -> list[str]:
        """Names of every call_function target in every graph (see `op_targets`)."""
        return op_targets(self.graphs)


def op_targets(graphs) -> list[str]:
    """Names of every call_function target in `graphs`. A mutating op that functionalization
    wrapped (`auto_functionalized`) is listed under the name of the op it wraps."""
    names = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function":
                wrapped = "auto_functionalized" in str(node.target)
                names.append(str(node.args[0] if wrapped else node.target))
    return names


def te_op_nodes(graphs) -> list[tuple[str, torch.fx.Node]]:
    """(op name without namespace and overload, node) for every te_compile op in `graphs`; a
    mutating op that functionalization wrapped is listed under the op it wraps."""
    out = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            wrapped = "auto_functionalized" in str(node.target)
            name = str(node.args[0] if wrapped else node.target)
            if name.startswith("te_compile."):
                out.append((name.split(".")[1], node))
    return out


def recipe_supported(name: str) -> tuple[bool, str]:
    """TE's own (supported, reason) for a recipe name of the tests ("none" needs nothing)."""
    from transformer_engine.pytorch import quantization as q

    if name == "none":
        return True, ""
    check = {
        "delayed": q.check_fp8_support,
        "current": q.check_fp8_support,
        "custom": q.check_fp8_support,
        "block": q.check_fp8_block_scaling_support,
        "mxfp8": q.check_mxfp8_support,
        "nvfp4": q.check_nvfp4_support,
    }[name]
    return check()


class InductorRecorder:
    """The inductor backend, counting the graphs dynamo hands it (a recompile adds one)."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        self.inductor = lookup_backend("inductor")
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inductor(gm, example_inputs)


@contextlib.contextmanager
def cuda_reported_available():
    """Within the block torch.cuda.is_available() answers True, so TE constructs modules without
    a GPU (build them on device="meta"). Leave the block before compiling: dynamo's metrics
    touch the driver when it answers True."""
    saved = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_available = saved


@contextlib.contextmanager
def fake_cuda():
    """A FakeTensorMode in which `torch.empty(..., device="cuda")` works without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def build_without_gpu(make, device: str) -> torch.nn.Module:
    """`make()` builds a module of TE modules on device="meta"; its parameters are then replaced
    by uninitialised `device` tensors of the same shape and dtype ("cuda" inside fake_cuda(),
    or "meta")."""
    with cuda_reported_available():
        module = make()
    for owner in module.modules():
        for name, p in list(owner.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, device=device, dtype=p.dtype)
            setattr(owner, name, torch.nn.Parameter(empty, requires_grad=p.requires_grad))
    return module


class JointRecorder:
    """AOTAutograd with forward and backward compilers that keep their graphs and run them."""

    def __init__(self, partition: str = "default"):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.fw, self.bw = [], []
        # "min_cut": inductor's partitioner (its recompute choices under checkpointing differ)
        kwargs = {}
        if partition == "min_cut":
            from functorch.compile import min_cut_rematerialization_partition

            kwargs["partition_fn"] = min_cut_rematerialization_partition

        def keep(graphs):
            def compiler(gm, example_inputs):
                graphs.append(gm)
                return make_boxed_func(gm.forward)

            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.fw), bw_compiler=keep(self.bw), **kwargs)

    @staticmethod
    def targets(graphs) -> list[str]:
        return op_targets(graphs)


@contextlib.contextmanager
def recipe_state_on(device: str):
    """TE allocates recipe state (DelayedScaling scales, amax histories) on "cuda"; within the
    block it allocates on `device` instead ("meta" for backward traces without a GPU)."""
    from transformer_engine.pytorch.quantization import RecipeState

    original = vars(RecipeState)["create"]

    def create(recipe, *, device=None, **kwargs):
        return original.__func__(recipe, device=torch.device(device_name), **kwargs)

    device_name = device
    RecipeState.create = staticmethod(create)
    try:
        yield
    finally:
        RecipeState.create = original


def op_args(node: torch.fx.Node) -> dict:
    """The arguments of a call to one of our ops in an FX graph, by schema name (dynamo's graphs
    call the packet, AOT's the overload; functionalized mutating calls carry the op first and
    the arguments as keyword arguments)."""
    target = node.target
    if "auto_functionalized" in str(target):
        target, kwargs = node.args[0], dict(node.kwargs)
        names = [a.name for a in getattr(target, "default", target)._schema.arguments]
        # auto_functionalized_v2 passes a mutated argument as an index into `_all_bases`.
        bases = kwargs.get("_all_bases") or []
        for n in names:
            if kwargs.get(f"_{n}_base_index") is not None:
                kwargs[n] = bases[kwargs[f"_{n}_base_index"]]
        return {n: kwargs.get(n) for n in names}
    names = [a.name for a in getattr(target, "default", target)._schema.arguments]
    args = dict(zip(names, node.args, strict=False))
    args.update(node.kwargs)
    return args


def op_results(node: torch.fx.Node):
    """The traced results of a call to one of our ops, as its declaration returns them: a list
    result without the trailing empty tensor list results carry on torch < 2.14
    (te_compile/ops/registry.py)."""
    from te_compile.ops import registry

    value = node.meta["val"]
    return value[:-1] if isinstance(value, list) and registry.PAD_LIST_RESULTS else value


@contextlib.contextmanager
def graph_fp8(on: bool = True):
    """te_compile.configure(graph_fp8=on) inside the block, the previous value restored after."""
    from te_compile import options

    before = options.current().graph_fp8
    options.configure(graph_fp8=on)
    try:
        yield
    finally:
        options.configure(graph_fp8=before)


def inductor_options(spec: str) -> dict:
    """Inductor config from "key=value,..." (0 and 1 as booleans), as the test harness's
    TE_COMPILE_TEST_INDUCTOR and the bench scripts' --inductor take it."""
    options = {}
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        options[key] = bool(int(value)) if value in ("0", "1") else value
    return options


GUARD_FILTERS = {
    "nn_modules": "skip_guard_on_all_nn_modules_unsafe",
    "globals": "skip_guard_on_globals_unsafe",
    "all": "skip_all_guards_unsafe",
}


def compile_options(spec: str, graphs: bool) -> dict | None:
    """torch.compile's `options` from the bench scripts' `--inductor` spec (None: none given,
    `mode` is used): `triton.cudagraphs` when `graphs` (reduce-overhead's CUDA graphs), and
    `guards=NAME` as one of torch.compiler's guard filters (GUARD_FILTERS)."""
    if not spec:
        return None
    options = {"triton.cudagraphs": True} if graphs else {}
    options |= inductor_options(spec)
    if "guards" in options:
        options["guard_filter_fn"] = getattr(torch.compiler, GUARD_FILTERS[options.pop("guards")])
    return options


def torchrun(script, nproc: int, args: list, timeout: int, env=None, tail: int = 6000):
    """`python -m torch.distributed.run --nproc-per-node nproc script *args` with this checkout
    on PYTHONPATH (the GPU suite's multi-process tests): the finished process, its output's
    tail printed. `env`: variables to set (PET_MASTER_PORT: two side by side on one host)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += [str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-tail:], proc.stderr[-tail:])
    return proc
