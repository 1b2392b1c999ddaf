"""The guards a compiled TE step evaluates on every call (CPU issue time: under CUDA graphs a
4-layer TransformerLayer step is CPU-bound, and its guards were its largest te_compile-made
part). te_compile's compile paths must leave no guard on an attribute a module lacks: such a
NO_HASATTR guard runs nn.Module.__getattr__'s miss path, an exception, on every call (before
session 16: about half of the guard time of a compiled TransformerLayer, measured on CPU)."""

from __future__ import annotations

import re

import attention_cases as cases
import pytest
import torch
import transformer_engine.pytorch as te
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from transformer_engine.common import recipe as R

import te_compile

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine tracing")


def guard_lines(make, recipe, prepare: bool) -> list[str]:
    """The guards of one compiled forward of `make()` under `recipe`, one line each."""
    torch._dynamo.reset()
    with te_compile.simulate_gpu("hopper"):
        module = make()
        if prepare:
            te_compile.prepare(module, recipe)
        x = cases.layer_input(cases.LAYER_CASES["default"])

        def step(x):
            with te.autocast(recipe=recipe):
                return module(x)

        torch.compile(step, backend="eager", fullgraph=True)(x)
        (entry,) = _debug_get_cache_entry_list(step.__code__)
        return str(entry.guard_manager).splitlines()


def _layer():
    return cases.make_layer(cases.LAYER_CASES["default"])


def _linear():
    return te.Linear(cases.HIDDEN, cases.HIDDEN, params_dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("prepare", [False, True], ids=["scanned", "prepared"])
@pytest.mark.parametrize("recipe", [R.Float8CurrentScaling, R.DelayedScaling])
@pytest.mark.parametrize("make", [_layer, _linear], ids=["transformer_layer", "linear"])
def test_no_guard_on_a_missing_module_attribute(make, recipe, prepare, patched):
    lines = guard_lines(make, recipe(), prepare)
    assert any("te_compile/" in line for line in lines)  # the compile path was traced
    # (torch 2.11 prints dynamo's own dynamic-dims marker check on each tensor this way too.)
    missing = [
        line.strip()
        for line in lines
        if "NO_HASATTR" in line and "te_compile/" in line and "_dynamo_dynamic_indices" not in line
    ]
    assert not missing, "\n".join(missing)


# Constant tables te_compile reads while dynamo traces, as they show in a guard line: an entry of
# a te_compile module global (QuantConfig's allowed kinds and dtypes, userbuffer option names,
# attention formats), an op config's field table (spec.py), and the attention argument binder's
# names and defaults (modules/attention.py). Allowed: AUTOCAST_EAGER (state, a one-item list the
# autocast twin writes).
GLOBAL_ENTRY = re.compile(r"G\['__import_te_compile[a-z_]*'\]\.(\w+)\[")
ALLOWED = {"AUTOCAST_EAGER"}
TABLES = ("_FIELDS", 'guard on "defaults"', 'guard on "names"')


@pytest.mark.parametrize("recipe", [R.Float8CurrentScaling, R.DelayedScaling])
def test_no_guard_on_a_constant_table(recipe, patched):
    """Building an op's config key (spec.py), checking a config (recipes.py), binding
    attention's arguments (modules/attention.py) and the refusal checks read no table while
    dynamo traces: each entry read there was a guard checked on every call (a TransformerLayer's FusedAttnSpec alone:
    115 lines, session 34; the binder's defaults and names about 70, session 35)."""
    lines = guard_lines(_layer, recipe(), prepare=False)
    assert any("te_compile/" in line for line in lines)
    tables = [
        line.strip()
        for line in lines
        if any(t in line for t in TABLES)
        or any(name not in ALLOWED for name in GLOBAL_ENTRY.findall(line))
    ]
    assert not tables, "\n".join(tables[:20])
