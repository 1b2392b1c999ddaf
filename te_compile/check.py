"""`te_compile.check`: is a model ready for `torch.compile(fullgraph=True)`? Answered on any
machine, GPU or not, by tracing it under `simulate_gpu` (nothing runs on a GPU).

For each recipe, two kinds of case:

- the whole model (or function): compiled with `fullgraph=True` under `te.autocast`, forward
  and backward (the backward of the sum of its floating outputs);
- each TE module instance on its own: the model runs eagerly on meta tensors (torch.compile'd
  code it calls, such as TE's jit fusions, runs eagerly too) while each TE module's forward is
  compiled with `fullgraph=True`, so one failing module does not hide the others' results
  (modules after a failure are "not reached": nothing can run in its place).

A case passes when its trace has no graph break and no error. The report lists, per case:
graphs (forward + backward, from AOTAutograd), te_compile ops in them, and the reason of a
failure: the option te-compile refuses, with its named error, or dynamo's graph-break reason.

This is a diagnostics module: it uses torch internals (`torch._dynamo` reset and AOTAutograd's
backend factory), imported lazily, with a clear error if torch moved them. The compile path
itself (te_compile.ops, te_compile.modules) uses public APIs only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import re
import sys
import textwrap

import torch

from .errors import TECompileError
from .simulate import simulate_gpu, simulated_gpu

_RECIPE_CLASSES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "block": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
RECIPE_NAMES = ("none", *_RECIPE_CLASSES)


def default_recipes(arch: str) -> tuple[str, ...]:
    """Every recipe the simulated GPU supports ("none" means te.autocast(enabled=False))."""
    gpu = simulated_gpu(arch)
    blackwell_only = () if gpu.mxfp8[0] else ("mxfp8", "nvfp4")
    return tuple(r for r in RECIPE_NAMES if r not in blackwell_only)


def make_recipe(name: str):
    """TE's recipe object with default arguments for a recipe name (None for "none")."""
    if name == "none":
        return None
    if name not in _RECIPE_CLASSES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {', '.join(RECIPE_NAMES)}")
    from transformer_engine.common import recipe

    return getattr(recipe, _RECIPE_CLASSES[name])()


def _recipe_label(recipe) -> str:
    if recipe is None:
        return "none"
    if isinstance(recipe, str):
        return recipe
    names = {cls: name for name, cls in _RECIPE_CLASSES.items()}
    return names.get(type(recipe).__name__, type(recipe).__name__)


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One traced case: `target` is "model" or a TE module's qualified name."""

    target: str
    module_type: str
    recipe: str
    status: str  # "ok", "refused" (te-compile's named error), "break", "error", "not reached"
    graphs: int = 0
    ops: tuple[str, ...] = ()
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _families(ops: tuple[str, ...]) -> str:
    """ "linear_fwd, linear_bwd, norm_fwd" -> "linear, norm": the op families in the graphs."""
    names = [op.removesuffix("_fwd").removesuffix("_bwd") for op in ops]
    return ", ".join(dict.fromkeys(names)) or "-"


@dataclasses.dataclass(frozen=True)
class CheckReport:
    arch: str
    results: tuple[CaseResult, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.ok]

    def table(self, width: int = 100) -> str:
        head = (
            "target",
            "module",
            "recipe",
            "status",
            "graphs (fwd+bwd)",
            "te_compile ops (_fwd/_bwd)",
        )
        rows = [
            (r.target, r.module_type, r.recipe, r.status, str(r.graphs), _families(r.ops))
            for r in self.results
        ]
        widths = [max(len(str(c)) for c in col) for col in zip(head, *rows, strict=True)]

        def line(cells) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

        gpu = simulated_gpu(self.arch)
        title = (
            f"te_compile.check: traced as on {gpu.name}, sm{gpu.capability[0]}{gpu.capability[1]}"
        )
        out = [title, line(head)]
        out.append(line(["-" * w for w in widths]))
        out += [line(row) for row in rows]
        failed = self.failures()
        if failed:
            out.append("")
            for r in failed:
                why = textwrap.shorten(r.reason, width=width * 4, placeholder=" ...")
                out.append(f"{r.target} [{r.recipe}] {r.status}:")
                out += textwrap.wrap(why, width, initial_indent="  ", subsequent_indent="  ")
        count = f"{len(self.results) - len(failed)} of {len(self.results)} cases passed"
        out.append(f"\n{count}" if failed else count)
        return "\n".join(out)

    __str__ = table


# ---- tracing -----------------------------------------------------------------------------------


def _dynamo():
    try:
        from torch._dynamo import reset
        from torch._dynamo.backends.common import aot_autograd
    except ImportError as e:  # pragma: no cover  (a torch that moved them)
        raise TECompileError(
            f"te_compile.check needs torch._dynamo.reset and AOTAutograd's backend factory, "
            f"which this torch ({torch.__version__}) does not have where expected: {e}"
        ) from e
    return reset, aot_autograd


class _Recorder:
    """A torch.compile backend: AOTAutograd whose compilers keep each graph and run it as is."""

    def __init__(self):
        _, aot_autograd = _dynamo()
        self.graphs: list[torch.fx.GraphModule] = []

        def keep(gm, example_inputs):
            self.graphs.append(gm)
            gm.graph.lint()
            forward = gm.forward

            def boxed(args):  # AOTAutograd calls compiled graphs with one list of inputs
                inputs = list(args)
                args.clear()
                return forward(*inputs)

            boxed._boxed_call = True
            return boxed

        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

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


def _classify(e: BaseException) -> tuple[str, str]:
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
    return "error", f"{type(e).__name__}: {text}"


def _backward(out) -> None:
    leaves = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
    if leaves:
        torch.autograd.backward([t.float().sum() for t in leaves])


def _detached(x):
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def _tree_map(fn, out):
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (list, tuple)):
        return type(out)(_tree_map(fn, o) for o in out)
    return out


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


@contextlib.contextmanager
def _fresh_state():
    """Fresh dynamo caches and TE global FP8 state around a case."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    reset, _ = _dynamo()
    reset()
    FP8GlobalStateManager.reset()
    try:
        yield
    finally:
        reset()
        FP8GlobalStateManager.reset()


def _autocast(recipe):
    import transformer_engine.pytorch as te

    return te.autocast(enabled=recipe is not None, recipe=recipe)


def _te_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """The outermost TE modules inside `model` (their own TE children trace inside them). When
    the model itself is a TE module (a TransformerLayer), the outermost ones below it: the
    model case already covers the whole."""
    if not isinstance(model, torch.nn.Module):
        return []
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if name == "" or not type(module).__module__.startswith("transformer_engine."):
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def _check_model(fn, inputs, recipe, label) -> CaseResult:
    recorder = _Recorder()
    kind = type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", "fn")
    with _fresh_state():
        try:
            compiled = torch.compile(fn, backend=recorder.backend, fullgraph=True)
            with _autocast(recipe):
                out = compiled(*inputs)
            _backward(out)
        except Exception as e:  # noqa: BLE001  (every failure is a reported result)
            status, reason = _classify(e)
            return CaseResult("model", kind, label, status, len(recorder.graphs), reason=reason)
    return CaseResult("model", kind, label, "ok", len(recorder.graphs), recorder.te_ops())


def _check_modules(model, inputs, recipe, label) -> list[CaseResult]:
    modules = _te_modules(model)
    recorders = {name: _Recorder() for name, _ in modules}
    errors: dict[str, BaseException] = {}
    done: set[str] = set()  # modules whose forward and backward traced
    compiled = {}
    for name, module in modules:
        compiled[name] = torch.compile(
            module.forward, backend=recorders[name].backend, fullgraph=True
        )

    def traced(name, forward):
        """The module's compiled forward and, right after it, its backward, on inputs cut
        from the model's autograd graph: each module is checked forward + backward on its own,
        and the model goes on with a detached output."""

        def call(*args, **kwargs):
            try:
                args = [_detached(a) for a in args]
                with torch.compiler.set_stance("default"):  # the model's eager run forces eager
                    out = forward(*args, **kwargs)
                    _backward(out)
            except Exception as e:
                errors.setdefault(name, e)
                raise
            done.add(name)
            return _tree_map(lambda t: t.detach(), out)

        return call

    own_forwards = {name: vars(module).get("forward") for name, module in modules}
    with _fresh_state():
        try:
            for name, module in modules:
                module.forward = traced(name, compiled[name])
            # The model's own code runs eagerly, and so do torch.compile'd functions it calls
            # (TE's jit fusions, e.g. TransformerLayer's bias-dropout-add: inductor on meta
            # tensors fails in torch 2.11's partitioner); only the TE modules compile.
            with _autocast(recipe), torch.compiler.set_stance("force_eager"):
                model(*inputs)
        except Exception as e:  # noqa: BLE001
            if not errors:  # failed outside every TE module: blame the model's own code
                errors["<model>"] = e
        finally:
            for name, module in modules:
                del module.forward
                if own_forwards[name] is not None:
                    module.forward = own_forwards[name]
    results = []
    for name, module in modules:
        rec = recorders[name]
        ops = ()
        if name in errors:
            status, reason = _classify(errors[name])
        elif name in done:
            status, reason, ops = "ok", "", rec.te_ops()
        elif errors:
            first = next(iter(errors))
            status = "not reached"
            culprit = "the model's own code" if first == "<model>" else first
            reason = f"not run: {culprit} raised first"
        else:
            status, reason = "not reached", "never called"
        results.append(
            CaseResult(name, type(module).__name__, label, status, len(rec.graphs), ops, reason)
        )
    return results


def check(
    model_or_fn,
    *example_inputs,
    arch: str = "hopper",
    recipes=None,
    per_module: bool = True,
) -> CheckReport:
    """Trace `model_or_fn(*example_inputs)` forward and backward under `torch.compile(fullgraph=True)`
    for each recipe, under `simulate_gpu(arch)`, and report per case (see this module's docstring).

    Build the model and inputs under `te_compile.simulate_gpu(arch)` (or on a real GPU); see
    `check_factory` for a function that builds them. `recipes`: names from RECIPE_NAMES or TE
    recipe objects (default: every recipe the arch supports). Call `te_compile.patch()` first
    to check te-compile's compile path (without it, TE's own). `per_module=False` traces only
    the whole model. Resets dynamo's caches and TE's global FP8 state around each case.
    """
    recipes = default_recipes(arch) if recipes is None else tuple(recipes)
    results: list[CaseResult] = []
    with simulate_gpu(arch):
        for item in recipes:
            recipe = make_recipe(item) if isinstance(item, str) else item
            label = _recipe_label(item)
            results.append(_check_model(model_or_fn, example_inputs, recipe, label))
            if per_module:
                results += _check_modules(model_or_fn, example_inputs, recipe, label)
    return CheckReport(simulated_gpu(arch).arch, tuple(results))


def check_factory(factory, *, arch: str = "hopper", recipes=None, per_module: bool = True):
    """`factory()` is ordinary GPU code returning (model, example_inputs): it runs under
    `simulate_gpu(arch)`, so its CUDA tensors are meta tensors, then `check` traces them."""
    with simulate_gpu(arch):
        model, inputs = factory()
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    return check(model, *inputs, arch=arch, recipes=recipes, per_module=per_module)


def load_factory(spec: str):
    """ "path/to/file.py:FACTORY" -> the FACTORY callable of that file."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"expected FILE.py:FACTORY, got {spec!r}")
    module_spec = importlib.util.spec_from_file_location("te_compile_check_target", path)
    if module_spec is None or module_spec.loader is None:
        raise FileNotFoundError(f"cannot load {path!r}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"{path} has no {name!r}")
    return getattr(module, name)
