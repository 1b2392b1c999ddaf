"""`te_compile.check`: is a model ready for `torch.compile(fullgraph=True)`? Answered on any
machine, GPU or not, by tracing it under `simulate_gpu` (nothing runs on a GPU).

For each recipe, two kinds of case:

- the whole model (or function): compiled with `fullgraph=True` under `te.autocast`, forward
  and backward (the backward of the sum of its floating outputs);
- each outermost TE module instance on its own (te_compile/check_modules.py): compiled with
  `fullgraph=True`, forward and backward, from fresh inputs shaped as the ones it saw in the
  whole-model trace, so one failing module does not hide the others' results.

`backend`: "aot_eager" (the default: AOTAutograd's graphs, run as they are on meta tensors) or
"inductor" (each graph also compiled by inductor as for a GPU of the arch, up to its generated
code: te_compile/check_inductor.py), so inductor-only failures show on a CPU machine.

A case passes when its trace has no graph break and no error. The report lists, per case:
graphs (forward + backward, from AOTAutograd), te_compile ops in them, and the reason of a
failure: the option te-compile refuses, with its named error, or dynamo's graph-break reason.

This is a diagnostics module: it uses torch internals (AOTAutograd's backend factory,
dynamo's `comptime`, inductor's compile_fx), imported lazily, with a clear error if torch moved
them. The compile path itself (te_compile.modules, ops, kernels, graph_fp8) imports no torch
internals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import textwrap

import torch

from ..recipes import RECIPE_CLASS_NAMES
from .check_modules import module_cases, recording
from .check_trace import (
    BACKENDS,
    CaseResult,
    autocast,
    backward,
    classify,
    fresh_state,
    make_recorder,
)
from .simulate import simulate_gpu, simulated_gpu

RECIPE_NAMES = ("none", *RECIPE_CLASS_NAMES)


def default_recipes(arch: str) -> tuple[str, ...]:
    """Every recipe the simulated GPU supports ("none" means te.autocast(enabled=False))."""
    gpu = simulated_gpu(arch)
    blackwell_only = () if gpu.mxfp8[0] else ("mxfp8", "nvfp4")
    return tuple(r for r in RECIPE_NAMES if r not in blackwell_only)


def make_recipe(name: str):
    """TE's recipe object with default arguments for a recipe name (None for "none")."""
    if name == "none":
        return None
    if name not in RECIPE_CLASS_NAMES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {', '.join(RECIPE_NAMES)}")
    from transformer_engine.common import recipe

    return getattr(recipe, RECIPE_CLASS_NAMES[name])()


def _recipe_label(recipe) -> str:
    if recipe is None:
        return "none"
    if isinstance(recipe, str):
        return recipe
    names = {cls: name for name, cls in RECIPE_CLASS_NAMES.items()}
    return names.get(type(recipe).__name__, type(recipe).__name__)


def _families(ops: tuple[str, ...]) -> str:
    """ "linear_fwd, linear_bwd, norm_fwd" -> "linear, norm": the op families in the graphs."""
    names = [op.removesuffix("_fwd").removesuffix("_bwd") for op in ops]
    return ", ".join(dict.fromkeys(names)) or "-"


@dataclasses.dataclass(frozen=True)
class CheckReport:
    arch: str
    results: tuple[CaseResult, ...]
    notes: tuple[str, ...] = ()
    backend: str = "aot_eager"

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
        if self.backend == "inductor":
            title += "; graphs compiled by inductor for it (code generated, not run)"
        out = [title, line(head)]
        out.append(line(["-" * w for w in widths]))
        out += [line(row) for row in rows]
        failed = self.failures()
        explained = [r for r in self.results if r.status != "ok"]  # failures, skips, unused
        if explained:
            out.append("")
            for r in explained:
                why = textwrap.shorten(r.reason, width=width * 4, placeholder=" ...")
                out.append(f"{r.target} [{r.recipe}] {r.status}:")
                out += textwrap.wrap(why, width, initial_indent="  ", subsequent_indent="  ")
        for note in self.notes:
            out.append("")
            out += textwrap.wrap(f"note: {note}", width, subsequent_indent="  ")
        count = f"{len(self.results) - len(failed)} of {len(self.results)} cases passed"
        others = [r.status for r in explained if r.ok]
        if others:
            count += " (" + ", ".join(f"{others.count(s)} {s}" for s in dict.fromkeys(others)) + ")"
        out.append(f"\n{count}" if explained or self.notes else count)
        return "\n".join(out)

    __str__ = table


# ---- cases --------------------------------------------------------------------------------------


def _check_model(fn, inputs, recipe, label, backend, arch, record) -> tuple[CaseResult, dict]:
    """The whole-model case; with `record`, also each TE module's first call (check_modules)."""
    rec = make_recorder(backend, arch)
    kind = type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__name__", "fn")
    calls: dict = {}
    with fresh_state(), rec.context():
        try:
            with recording(fn) if record else contextlib.nullcontext({}) as recorded:
                calls = recorded
                compiled = torch.compile(fn, backend=rec.backend, fullgraph=True)
                with autocast(recipe):
                    out = compiled(*inputs)
            backward(out)
        except Exception as e:  # noqa: BLE001  (every failure is a reported result)
            status, reason = classify(e)
            return CaseResult("model", kind, label, status, len(rec.graphs), reason=reason), calls
    return CaseResult("model", kind, label, "ok", len(rec.graphs), rec.te_ops()), calls


def check(
    model_or_fn,
    *example_inputs,
    arch: str = "hopper",
    recipes=None,
    per_module: bool = True,
    backend: str = "aot_eager",
) -> CheckReport:
    """Trace `model_or_fn(*example_inputs)` forward and backward under `torch.compile(fullgraph=True)`
    for each recipe, under `simulate_gpu(arch)`, and report per case (see this module's docstring).

    Build the model and inputs under `te_compile.simulate_gpu(arch)` (or on a real GPU); see
    `check_factory` for a function that builds them. `recipes`: names from RECIPE_NAMES or TE
    recipe objects (default: every recipe the arch supports). Call `te_compile.patch()` first
    to check te-compile's compile path (without it, TE's own). `per_module=False` traces only
    the whole model. `backend`: "aot_eager" or "inductor" (graphs also compiled by inductor as
    for that GPU, nothing run). Resets dynamo's caches and TE's global FP8 state around each
    case.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    recipes = default_recipes(arch) if recipes is None else tuple(recipes)
    results: list[CaseResult] = []
    notes: list[str] = []
    with simulate_gpu(arch):
        for item in recipes:
            recipe = make_recipe(item) if isinstance(item, str) else item
            label = _recipe_label(item)
            args = (model_or_fn, example_inputs, recipe, label)
            model, calls = _check_model(*args, backend, arch, per_module)
            results.append(model)
            if per_module:
                more, why = module_cases(*args, calls, model, backend, arch)
                results += more
                notes += why
    return CheckReport(simulated_gpu(arch).arch, tuple(results), tuple(notes), backend)


def check_factory(
    factory, *, arch: str = "hopper", recipes=None, per_module: bool = True, backend="aot_eager"
):
    """`factory()` is ordinary GPU code returning (model, example_inputs): it runs under
    `simulate_gpu(arch)`, so its CUDA tensors are meta tensors, then `check` traces them."""
    with simulate_gpu(arch):
        model, inputs = factory()
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    return check(model, *inputs, arch=arch, recipes=recipes, per_module=per_module, backend=backend)


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
