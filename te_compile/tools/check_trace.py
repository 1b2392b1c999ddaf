"""What `te_compile.check`'s cases share: the recording backend, the error classification, the
backward of a case's outputs and the fresh dynamo/TE state around each case.

Diagnostics code: one torch internal, AOTAutograd's backend factory (which gives the check the
forward and backward graphs), is imported lazily, with a clear error if torch moved it; the
reset between cases is the public `torch.compiler.reset`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import torch

from ..errors import TECompileError

BACKENDS = ("aot_eager", "inductor")


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One traced case: `target` is "model" or a TE module's qualified name."""

    target: str
    module_type: str
    recipe: str
    # "ok"; failures: "refused" (te-compile's named error), "break" (graph break), "error",
    # "not reached"; neither: "not called" (the model's forward does not call the module),
    # "skipped" (its recorded inputs cannot be rebuilt; the model case covers it)
    status: str
    graphs: int = 0
    ops: tuple[str, ...] = ()
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "not called", "skipped")


def dynamo():
    try:
        from torch._dynamo.backends.common import aot_autograd
    except ImportError as e:  # pragma: no cover  (a torch that moved it)
        raise TECompileError(
            f"te_compile.check needs AOTAutograd's backend factory, which this torch "
            f"({torch.__version__}) does not have where expected: {e}"
        ) from e
    return torch.compiler.reset, aot_autograd


def boxed_runner(gm: torch.fx.GraphModule):
    """`gm` run as is, with AOTAutograd's boxed calling convention (one list of inputs)."""
    forward = gm.forward

    def boxed(args):
        inputs = list(args)
        args.clear()
        return forward(*inputs)

    boxed._boxed_call = True
    return boxed


class Recorder:
    """A torch.compile backend: AOTAutograd whose compilers keep each graph and run it as is
    (on meta tensors). `context()` is what must hold while a case runs (nothing here)."""

    def __init__(self):
        _, aot_autograd = dynamo()
        self.graphs: list[torch.fx.GraphModule] = []

        def keep(gm, example_inputs):
            self.graphs.append(gm)
            gm.graph.lint()
            return boxed_runner(gm)

        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def context(self):
        return contextlib.nullcontext()

    def te_ops(self) -> tuple[str, ...]:
        names = []
        for gm in self.graphs:
            for node in gm.graph.nodes:
                if node.op != "call_function":
                    continue
                wrapped = "auto_functionalized" in str(node.target)  # a mutating op
                name = str(node.args[0] if wrapped else node.target)
                if name.startswith("te_compile."):
                    short = name.split(".")[1]
                    if short not in names:
                        names.append(short)
        return tuple(names)


def make_recorder(backend: str, arch: str) -> Recorder:
    """A fresh recording backend for one case: "aot_eager" (AOTAutograd, graphs run as is) or
    "inductor" (inductor compiles each graph as for a GPU of `arch`: te_compile/check_inductor.py)."""
    if backend == "aot_eager":
        return Recorder()
    if backend == "inductor":
        from .check_inductor import InductorRecorder

        return InductorRecorder(arch)
    raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")


def _te_compile_error_names() -> set[str]:
    names, todo = set(), [TECompileError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def _message(observed: BaseException, top: BaseException) -> str:
    """The message of an error raised in traced code. torch >= 2.14 keeps it in the observed
    error ("raised exception Name('...')"); torch 2.11 keeps only the class there and the message
    in the top-level error's "Developer debug context" (as "ConstantVariable(str: '...')")."""
    text = str(observed).removeprefix("raised exception ")
    if "Variable(" not in text:
        call = re.fullmatch(r"(\w+)\((['\"])(.*)\2\)", text, re.S)  # Name('message')
        return f"{call[1]}: {call[3]}" if call else text
    found = re.search(r"ConstantVariable\(str: (['\"])(.*?)\1\)", str(top), re.S)
    name = type(observed).__name__.removeprefix("Observed").removesuffix("Error")
    return f"{name}: {found[2]}" if found else text


def classify(e: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised while tracing or running a case. Dynamo
    re-raises an error raised in traced code as `Unsupported("Observed exception")` whose
    cause is an `Observed<Name>Error` carrying the original message: unwrap it."""
    chain, seen = [], e
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    ours = _te_compile_error_names()
    for err in chain:
        name = type(err).__name__
        if isinstance(err, TECompileError) or any(f"Observed{n}" in name for n in ours):
            return "refused", _message(err, e)
    text = str(e).strip()
    if type(e).__name__ in ("Unsupported", "UserError") or "graph break" in text.lower():
        observed = [err for err in chain[1:] if type(err).__name__.startswith("Observed")]
        if observed:  # an error raised in traced code (TE's own, e.g. a validation error)
            return "error", _message(observed[0], e)
        return "break", text.split("\n\nfrom user code")[0]
    while type(e).__name__ == "BackendCompilerFailed" and getattr(e, "inner_exception", None):
        e = e.inner_exception  # the backend's own error (inductor's InductorError)
    return "error", f"{type(e).__name__}: {_trimmed(str(e))}"


def _trimmed(text: str) -> str:
    """An error's message without torch's advice on logging and its traceback copies."""
    for tail in ("\nOriginal traceback:", "\n\nUse tlparse", "\n\nSet TORCHDYNAMO_VERBOSE"):
        text = text.split(tail)[0]
    return text.strip()


def backward(out) -> None:
    leaves = [t for t in tensors(out) if t.requires_grad and t.is_floating_point()]
    if leaves:
        torch.autograd.backward([t.float().sum() for t in leaves])


def detached(x):
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def tree_map(fn, out):
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (list, tuple)):
        return type(out)(tree_map(fn, o) for o in out)
    if isinstance(out, dict):
        return {k: tree_map(fn, v) for k, v in out.items()}
    return out


def tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors(o)]
    return []


@contextlib.contextmanager
def fresh_state():
    """Fresh dynamo caches and TE global FP8 state around a case."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    reset, _ = dynamo()
    reset()
    FP8GlobalStateManager.reset()
    try:
        yield
    finally:
        reset()
        FP8GlobalStateManager.reset()


def autocast(recipe):
    import transformer_engine.pytorch as te

    return te.autocast(enabled=recipe is not None, recipe=recipe)
