"""A user's script, run on a machine without a GPU: trace TE code as if on an H100.

    python examples/simulate_trace.py

te.autocast for every recipe (recipe=None and a nested enabled=False included) and a te.Linear
forward + backward per Hopper recipe, each compiled with fullgraph=True. Prints one line per
case and exits non-zero if any case fails.
"""

import sys

import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe

import te_compile

te_compile.patch()

AUTOCAST_RECIPES = {
    "None (TE's default for the GPU)": None,
    "DelayedScaling()": recipe.DelayedScaling(),
    "Float8CurrentScaling()": recipe.Float8CurrentScaling(),
    "Float8BlockScaling()": recipe.Float8BlockScaling(),
}
LINEAR_RECIPES = ["none", "delayed", "current", "block"]  # "none": te.autocast(enabled=False)


class CountingBackend:
    """A torch.compile backend that counts the graphs it gets and runs them as they are."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def autocast_case(fp8_recipe):
    def fn(x):
        with te.autocast(recipe=fp8_recipe):  # recipe=None: TE's default for this GPU
            y = x * 2
            with te.autocast(enabled=False):
                y = y + 1
        return y

    return fn


failures = 0
with te_compile.simulate_gpu("hopper"):
    x = torch.randn(16, 64, device="cuda")
    for name, fp8_recipe in AUTOCAST_RECIPES.items():
        backend = CountingBackend()
        torch.compile(autocast_case(fp8_recipe), backend=backend, fullgraph=True)(x)
        ok = backend.graphs == 1
        failures += not ok
        print(f"te.autocast(recipe={name}), nested enabled=False: {backend.graphs} graph")

    model = te.Linear(64, 128, params_dtype=torch.bfloat16, device="cuda")
    inp = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
report = te_compile.check(model, inp, arch="hopper", recipes=LINEAR_RECIPES, per_module=False)
for case in report.results:
    print(
        f"te.Linear fwd+bwd, {case.recipe}: {case.status}, {case.graphs} graphs "
        f"(forward, backward), ops {', '.join(case.ops)}"
    )
failures += not report.ok
sys.exit(1 if failures else 0)
