"""`te_compile.check`'s per-module cases: each outermost TE module compiled on its own with
`fullgraph=True`, forward and backward, so one failing module does not hide the others.

Each module's inputs are the ones it saw in the whole-model case: while that case traces, each
TE module's forward records its arguments as dynamo sees them (a `comptime` hook: tensors as
shape, strides, dtype and requires_grad; constants as they are). The module's case then
compiles it from fresh meta tensors of those specs, under the recipe. The model's own eager
code never runs for this: code that differs between eager and compiled execution (HF
transformers' mask code calls `.item()` eagerly, which meta tensors cannot answer, and skips
it under compile) does not matter.

When the whole-model case stopped before reaching some modules (a graph break or an error),
the model runs eagerly on meta tensors to reach them, each TE module's output computed by its
own forward compiled with backend="eager" (torch.compile'd helpers between them run eagerly).
If the model's own code raises there, the modules after it are "not reached" and the report
says what raised.

Diagnostics code: torch._dynamo internals (`comptime`, its variable trackers), imported lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from ..errors import TECompileError
from .check_trace import (
    CaseResult,
    autocast,
    backward,
    classify,
    detached,
    dynamo,
    fresh_state,
    make_recorder,
    tree_map,
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(map(int, t.shape)), tuple(map(int, t.stride())), t.dtype, t.requires_grad)

    def build(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        return t.requires_grad_(self.requires_grad and (t.is_floating_point() or t.is_complex()))


@dataclasses.dataclass(frozen=True)
class Const:
    value: Any


@dataclasses.dataclass(frozen=True)
class Seq:
    kind: type
    items: tuple


@dataclasses.dataclass(frozen=True)
class Map:
    items: dict


@dataclasses.dataclass(frozen=True)
class Opaque:
    """An argument the trace cannot hand over (an object built inside the traced code)."""

    what: str


class Unbuildable(Exception):
    pass


def _build(spec):
    if isinstance(spec, TensorSpec):
        return spec.build()
    if isinstance(spec, Const):
        return spec.value
    if isinstance(spec, Seq):
        items = [_build(s) for s in spec.items]
        return spec.kind(*items) if hasattr(spec.kind, "_fields") else spec.kind(items)
    if isinstance(spec, Map):
        return {k: _build(v) for k, v in spec.items.items()}
    raise Unbuildable(spec.what)


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded call of a module: specs of its positional and keyword arguments."""

    args: tuple
    kwargs: dict

    error: str = ""  # why the call could not be recorded (te_compile.check's own failure)

    @classmethod
    def of(cls, args, kwargs) -> Call:
        return cls(tuple(map(_from_value, args)), {k: _from_value(v) for k, v in kwargs.items()})

    def build(self) -> tuple[list, dict]:
        return [_build(a) for a in self.args], {k: _build(v) for k, v in self.kwargs.items()}


def _from_value(value):
    """The spec of an eager argument (on meta tensors)."""
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (list, tuple)):
        return Seq(type(value), tuple(_from_value(v) for v in value))
    if isinstance(value, dict):
        return Map({k: _from_value(v) for k, v in value.items()})
    return Const(value)


def _from_variable(vt):
    """The spec of an argument as dynamo tracks it (a VariableTracker, at trace time)."""
    from torch._dynamo import variables

    if isinstance(vt, variables.TensorVariable):
        return TensorSpec.of(vt.as_proxy().node.meta["example_value"])
    if vt.is_python_constant():
        return Const(vt.as_python_constant())
    if isinstance(vt, variables.BaseListVariable):
        return Seq(vt.python_type(), tuple(_from_variable(v) for v in vt.items))
    if isinstance(vt, variables.ConstDictVariable):
        items = vt.keys_as_python_constant().items()
        return Map({k: _from_variable(v) for k, v in items})
    if isinstance(vt, variables.UserDefinedObjectVariable) and vt.source is not None:
        return Const(vt.value)  # an object that exists outside the traced code
    return Opaque(f"{vt.python_type_name()} built inside the traced code")


def _contents(spec):
    """The items of a recorded tuple or dict (a constant one is recorded as a Const)."""
    return (_from_value(spec.value) if isinstance(spec, Const) else spec).items


def te_modules(model) -> list[tuple[str, torch.nn.Module]]:
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


@contextlib.contextmanager
def _forwards(modules, make):
    """Each module's forward replaced by `make(name, own_forward)`; restored on exit."""
    own = {name: vars(module).get("forward") for name, module in modules}
    try:
        for name, module in modules:
            module.forward = make(name, module.forward)
        yield
    finally:
        for name, module in modules:
            del module.forward
            if own[name] is not None:
                module.forward = own[name]


@contextlib.contextmanager
def recording(model):
    """While the whole-model case traces, record each outermost TE module's first call;
    yields {name: Call}. A call that cannot be recorded is recorded as Opaque."""
    try:
        from torch._dynamo.comptime import comptime
    except ImportError as e:  # pragma: no cover  (a torch that moved it)
        raise TECompileError(f"te_compile.check needs torch._dynamo.comptime: {e}") from e
    calls: dict[str, Call] = {}

    def make(name, own):
        def record(ctx):  # runs at trace time, on dynamo's view of the arguments
            if name in calls:
                return
            try:
                found = [
                    ctx.get_local(n)._i_will_not_complain_if_bc_breaks_VariableTracker()
                    for n in ("args", "kwargs")
                ]
                args, kwargs = (_contents(_from_variable(vt)) for vt in found)
                calls[name] = Call(args, kwargs)
            except Exception as e:  # noqa: BLE001  (never disturb the model's trace)
                calls[name] = Call((), {}, error=f"{type(e).__name__}: {e}")

        def forward(*args, **kwargs):
            comptime(record)
            return own(*args, **kwargs)

        return forward

    with _forwards(te_modules(model), make):
        yield calls


def _eager_calls(model, inputs, recipe, modules):
    """The fallback: `model(*inputs)` eagerly on meta tensors, each TE module's output from its
    own forward compiled with backend="eager". Returns ({name: Call}, failure) where failure is
    None or (culprit, exception): culprit is a module's name or "" for the model's own code."""
    reset, _ = dynamo()
    calls: dict[str, Call] = {}
    raised: dict[str, BaseException] = {}

    def make(name, own):
        def forward(*args, **kwargs):
            calls.setdefault(name, Call.of(args, kwargs))
            try:
                reset()  # the same forward for every instance: no recompile limit
                with torch.compiler.set_stance("default"):
                    compiled = torch.compile(own, backend="eager", fullgraph=True)
                    out = compiled(*map(detached, args), **kwargs)
            except Exception as e:
                raised.setdefault(name, e)
                raise
            return tree_map(lambda t: t.detach(), out)

        return forward

    failure = None
    with fresh_state():
        try:
            with _forwards(modules, make), autocast(recipe):
                with torch.compiler.set_stance("force_eager"):
                    model(*inputs)
        except Exception as e:  # noqa: BLE001
            failure = next(iter(raised.items()), ("", e))
    return calls, failure


def _check_module(name, module, call, recipe, label, backend, arch):
    kind = type(module).__name__
    if call.error:
        reason = f"te_compile.check could not record its inputs in the model's trace: {call.error}"
        return CaseResult(name, kind, label, "error", reason=reason)
    try:
        args, kwargs = call.build()
    except Unbuildable as e:
        reason = f"its recorded inputs cannot be rebuilt: {e}"
        return CaseResult(name, kind, label, "skipped", reason=reason)
    rec = make_recorder(backend, arch)
    with fresh_state(), rec.context():
        try:
            compiled = torch.compile(module.forward, backend=rec.backend, fullgraph=True)
            with autocast(recipe):
                out = compiled(*args, **kwargs)
            backward(out)
        except Exception as e:  # noqa: BLE001  (every failure is a reported result)
            status, reason = classify(e)
            return CaseResult(name, kind, label, status, len(rec.graphs), reason=reason)
    return CaseResult(name, kind, label, "ok", len(rec.graphs), rec.te_ops())


def module_cases(model, inputs, recipe, label, recorded, model_case, backend, arch):
    """The per-module cases of one recipe: (results, notes). `recorded`: the calls recorded
    while `model_case` (its CaseResult) traced."""
    model_ok, model_ops = model_case.ok, model_case.ops
    modules = te_modules(model)
    calls = dict(recorded)
    if model_ok and modules and not calls and model_ops:  # te_compile ops, yet no call seen
        broken = Call((), {}, error="no TE module call was recorded (comptime did not run)")
        calls = {name: broken for name, _ in modules}
    missing = [(name, module) for name, module in modules if name not in calls]
    failure, notes = None, []
    if missing and not model_ok:
        more, failure = _eager_calls(model, inputs, recipe, modules)
        calls.update({name: more[name] for name, _ in missing if name in more})
    results = []
    for name, module in modules:
        kind = type(module).__name__
        if name in calls:
            results.append(_check_module(name, module, calls[name], recipe, label, backend, arch))
        elif failure is None:
            reason = "the model's forward did not call it"
            results.append(CaseResult(name, kind, label, "not called", reason=reason))
        else:
            culprit, _ = failure
            raised = f"{culprit} raised first" if culprit else "the model's own code raised (note)"
            reason = f"not run: the whole-model trace stopped before it; run eagerly, {raised}"
            results.append(CaseResult(name, kind, label, "not reached", reason=reason))
    if failure is not None and not failure[0] and len(calls) < len(modules):
        error = failure[1]
        notes.append(
            f"[{label}] the whole-model case stopped before {len(modules) - len(calls)} TE "
            f"module(s); run eagerly on meta tensors to reach them, the model's own code raised "
            f"{type(error).__name__}: {str(error).strip()}. Per-module cases take their inputs "
            f"from the whole-model trace: make the model case pass (its row says why it "
            f"failed), or check with --whole-model-only / per_module=False."
        )
    return results, notes
