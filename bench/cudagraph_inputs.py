"""The compiled step's graph inputs that CUDA graphs copy on every replay, found without a GPU.

    python bench/cudagraph_inputs.py [--recipe current|delayed|bf16] [--stack te-transformer]
                                     [--hidden 1024] [--layers 2]

cudagraph trees copy each input of a replayed graph that is not static (a parameter, a buffer,
or an earlier graph's output) into the graph's own buffer, every step: CPU and a small kernel per
graph (docs/perf/history.md, session 53). The stack of bench/stacks.py is traced under
te_compile.simulate_gpu("hopper") through inductor's `compile_fx` (AOTAutograd, the
partitioner); what it tells its inner compiler is static (`static_input_idxs`, the index list
cudagraph trees use) is read there, and the graph then runs as it is, on meta tensors. Prints,
per graph, its inputs, how many are static, and the others by name, shape and dtype. A
te_compile change that turns state into a fresh graph input shows here as a new row.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

import torch
from torch._inductor import compile_fx

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(__file__))

import stacks  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402

import te_compile  # noqa: E402
from te_compile.tools.check_inductor import InductorRecorder  # noqa: E402
from te_compile.tools.check_trace import boxed_runner  # noqa: E402

RECIPES = {"current": R.Float8CurrentScaling, "delayed": R.DelayedScaling, "bf16": lambda: None}


def non_static_inputs(stack: str, recipe_name: str, hidden: int, layers: int) -> list[tuple]:
    """[(graph, inputs, static inputs, [(name, shape, dtype) of the others])], forward first."""
    graphs = []

    def recording(gm, example_inputs, **kwargs):
        static = set(kwargs.get("static_input_idxs") or ())
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        others = [
            (name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for i, (name, t) in enumerate(zip(names, example_inputs, strict=True))
            if isinstance(t, torch.Tensor) and i not in static
        ]
        kind = "backward" if kwargs.get("is_backward") else "forward"
        graphs.append((kind, len(example_inputs), len(static), others))
        return boxed_runner(gm)

    backend = functools.partial(compile_fx.compile_fx, inner_compile=recording)
    torch._dynamo.reset()
    # The inductor check's settings: no constant folding (on meta tensors it would replace the
    # graph's outputs by empty tensors and drop what computes them), no caches (a hit would
    # skip the inner compile that reads the indices).
    with te_compile.simulate_gpu("hopper"), InductorRecorder("hopper").context():
        stacks.HEAD_DIM = 64
        model = stacks.build(stack, hidden, layers).cuda()
        x = torch.randn(512, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        recipe = RECIPES[recipe_name]()

        def step(x):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return model(x)

        torch.compile(step, fullgraph=True, backend=backend)(x).float().sum().backward()
    return graphs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="current", choices=sorted(RECIPES))
    p.add_argument("--stack", default="te-transformer")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    te_compile.patch()
    for kind, n, static, others in non_static_inputs(
        args.stack, args.recipe, args.hidden, args.layers
    ):
        print(f"{kind}: {n} inputs, {static} static, {len(others)} copied on every replay")
        for row in others:
            print("   ", *row)


if __name__ == "__main__":
    main()
