"""A process's first inductor compile of a te.TransformerLayer against its second, on the CPU.

    python bench/first_compile_code.py [--graph-fp8 off] [--recipe delayed] [--dropout 0.1]
        [--no-bias] [--hidden 1024]

Session 49 found that inductor schedules a custom op's multi-user input differently in a
process's first compile (docs/training.md, "Known differences"; the mechanism on a toy op:
tests/cpu/test_inductor_first_compile.py). This compiles one te.TransformerLayer (forward and
backward, `te.autocast` inside) twice in one process with te_compile.check's inductor backend,
which generates inductor's code for a simulated H100 without a GPU (te_compile/tools/
check_inductor.py), and prints where the two compiles' kernel sequences differ. It shows the
code, not the numbers: a difference matters only where a value is rounded differently, as the
dropout gradient's bias sum on TE's kernels (session 49, on the GPU), and not where the graph
path rounds explicitly to what eager TE stores (graph_fp8.quantize.stored_bf16). Use it to try
a change on the CPU before checking its numbers on a GPU (`bench/cudagraph_parity.py`).
Inductor's random ops fall back to ATen here (`fallback_random`: its random lowering needs real
tensors), and its caches are off.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cudagraph_parity import add_layer_flags  # noqa: E402
from kernel_count import GRAPH_FP8  # noqa: E402


def compiled_sources(args) -> list[str]:
    """The generated code of the layer's forward and backward graphs, one compile."""
    import torch._inductor.config as inductor_config
    import transformer_engine.pytorch as te
    from varying_length_parity import RECIPES

    import te_compile
    from te_compile.tools.check_inductor import InductorRecorder

    torch._dynamo.reset()
    with te_compile.simulate_gpu("hopper"):
        layer = te.TransformerLayer(
            args.hidden,
            4 * args.hidden,
            args.hidden // 64,
            params_dtype=torch.bfloat16,
            hidden_dropout=args.dropout,
            attention_dropout=args.dropout,
            bias=args.bias,
        ).cuda()
        x = torch.randn(args.tokens, 1, args.hidden, device="cuda", dtype=torch.bfloat16)
        x.requires_grad_()
    recipe = RECIPES[args.recipe]()

    def forward(x):
        with te.autocast(recipe=recipe):
            return layer(x)

    recorder = InductorRecorder("hopper")
    with te_compile.simulate_gpu("hopper"), recorder.context():
        with inductor_config.patch(fallback_random=True):
            y = torch.compile(forward, backend=recorder.backend, fullgraph=True)(x)
            y.float().square().mean().backward()
    return recorder.sources


def kernel_calls(source: str) -> list[str]:
    """The wrapper's kernel launches and te_compile op calls, buffer numbers dropped."""
    calls = []
    for line in source.splitlines():
        code = line.strip()
        if code.startswith("#") or code.startswith("def ") or "assert_" in code:
            continue
        if ".run(" in code or "torch.ops.te_compile" in code:
            calls.append(re.sub(r"buf\d+", "buf", code)[:160])
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layer_flags(p)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    import te_compile

    te_compile.patch()
    te_compile.configure(graph_fp8=GRAPH_FP8[args.graph_fp8])
    first, second = compiled_sources(args), compiled_sources(args)
    print(f"{vars(args)}")
    for name, a, b in zip(("forward", "backward"), first, second, strict=True):
        calls_a, calls_b = kernel_calls(a), kernel_calls(b)
        same = "the same" if calls_a == calls_b else "different"
        print(
            f"\n{name}: {len(calls_a)} calls in the first compile, {len(calls_b)} in the "
            f"second: {same}"
        )
        for line in difflib.unified_diff(calls_a, calls_b, "first", "second", lineterm="", n=0):
            print("  " + line)


if __name__ == "__main__":
    main()
