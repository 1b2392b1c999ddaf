"""Kernel launches inductor generates for one compiled fwd+bwd step, counted without a GPU.

    python bench/kernel_count.py [--recipes current,delayed,block,bf16,torch] [--hidden 1024]
        [--tokens 512] [--graph-fp8 auto|on|off]

One te.TransformerLayer (causal, heads of 64; "bf16": no FP8; "torch": bench/stacks.py's plain
PyTorch block of the same shape) is traced under te_compile.simulate_gpu("hopper")
and each graph compiled by inductor for the simulated GPU up to its generated code
(te_compile.tools.check_inductor; nothing runs). Per graph it prints the Triton kernels
launched (distinct names; inductor's benchmark mode, on here, names repeated kernels apart), the
launches in the wrapper (a kernel launched twice counts twice), the megabytes those launches
read and write by inductor's own estimate (`kernel_num_gb`; over the GPU's memory bandwidth, a
floor on their GPU time: 3.35 TB/s on an H100 SXM), the aten scaled GEMMs and the te_compile
ops called, and the graph's tensor inputs and outputs (the forward's outputs are what it saves
for backward plus the layer's output). Each launch costs CPU in default mode and a few
microseconds of GPU at small shapes, so this is the CPU-side number to watch when the graph
path's code changes (the GPU's count: bench/profile_step.py); the megabytes are the GPU-bound
shapes' number; every input and output is handled in Python per call by AOT autograd's wrappers
and, under CUDA graphs, by cudagraph trees.
"""

from __future__ import annotations

import argparse
import ast
import collections
import re
import warnings

import torch
from torch._inductor import config as inductor_config

warnings.filterwarnings("ignore")

import stacks  # noqa: E402  (bench/stacks.py, beside this script)
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402

import te_compile  # noqa: E402
from te_compile.tools.check_inductor import InductorRecorder  # noqa: E402
from te_compile_testing import inductor_options  # noqa: E402

RECIPES = {
    "current": R.Float8CurrentScaling,
    "delayed": R.DelayedScaling,
    "block": R.Float8BlockScaling,
}


_CALL = re.compile(r"\n    def call\(self, args\):|\ndef call\(args\):")
_NUM_GB = re.compile(r"'kernel_name': '(\w+)'.*?'kernel_num_gb': ([0-9.e+-]+)")


def generated_sources(
    recipe_name: str, hidden: int, tokens: int, inductor: dict | None = None
) -> list[str]:
    """Inductor's generated code (wrapper and Triton kernels) of the step's forward and backward
    graphs, in that order."""
    torch._dynamo.reset()
    rec = InductorRecorder("hopper")
    # benchmark_kernel: inductor writes each kernel's bytes read and written into its metadata
    with (
        te_compile.simulate_gpu("hopper"),
        rec.context(),
        inductor_config.patch(benchmark_kernel=True, **(inductor or {})),
    ):
        if recipe_name == "torch":  # the same block in plain PyTorch bf16 (bench/stacks.py)
            stacks.HEAD_DIM = 64
            layer = stacks.TorchTransformerBlock(hidden)
        else:
            layer = te.TransformerLayer(
                hidden,
                4 * hidden,
                hidden // 64,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                params_dtype=torch.bfloat16,
                self_attn_mask_type="causal",
            ).cuda()
        x = torch.randn(tokens, 1, hidden, device="cuda", dtype=torch.bfloat16)
        x.requires_grad_()
        recipe = RECIPES[recipe_name]() if recipe_name in RECIPES else None

        def step(x):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return layer(x)

        torch.compile(step, backend=rec.backend, fullgraph=True)(x).float().sum().backward()
    return rec.sources


def count(
    recipe_name: str, hidden: int, tokens: int, inductor: dict | None = None
) -> list[tuple[int, int, float, collections.Counter]]:
    rows = []
    for source in generated_sources(recipe_name, hidden, tokens, inductor):
        num_gb = {name: float(gb) for name, gb in _NUM_GB.findall(source)}
        code = wrapper_code(source)
        calls = collections.Counter(
            re.findall(r"(extern_kernels\._scaled_mm|te_compile\.\w+)(?:\.default)?\(", code)
        )
        launched = launches(source)
        megabytes = 1e3 * sum(num_gb.get(name, 0.0) for name in launched)
        rows.append((len(set(launched)), len(launched), megabytes, calls, _inputs_outputs(code)))
    return rows


def wrapper_code(source: str) -> str:
    """The graph's own calls: the last `call` of inductor's generated `source` (after each
    kernel's benchmark harness), without its comment lines."""
    body = source[[*_CALL.finditer(source)][-1].start() :]
    return "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))


def launches(source: str) -> list[str]:
    """The Triton kernels the graph launches, in order (a kernel launched twice is listed twice)."""
    return re.findall(r"(\w+)\.run\(", wrapper_code(source))


def _inputs_outputs(code: str) -> tuple[int, int]:
    """The graph's tensor inputs and outputs (the forward's outputs include what it saves for
    backward, the backward's inputs what it reads of them): each costs CPU per call in AOT
    autograd's wrappers and, under CUDA graphs, in cudagraph trees' bookkeeping."""
    unpacked = re.search(r"\n\s*((?:\w+, )*\w+),? = args\n", code)
    returned = code[code.rindex("return (") + len("return ") :].split("\n", 1)[0]
    outputs = len(ast.parse(returned, mode="eval").body.elts)  # the returned tuple's items
    return (len(unpacked.group(1).split(", ")) if unpacked else 0), outputs


GRAPH_FP8 = {"auto": None, "on": True, "off": False}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipes", default="current,delayed")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument(
        "--inductor",
        default="",
        help="inductor config, e.g. combo_kernels=1,triton.cooperative_reductions=1",
    )
    p.add_argument(
        "--graph-fp8",
        choices=sorted(GRAPH_FP8),
        default="auto",
        help="te_compile.configure(graph_fp8=...): auto (None), on (True), off (TE's kernels)",
    )
    args = p.parse_args()
    inductor = inductor_options(args.inductor)
    te_compile.patch()
    te_compile.configure(graph_fp8=GRAPH_FP8[args.graph_fp8])
    print(
        f"1 x te.TransformerLayer, hidden {args.hidden}, {args.tokens} tokens, "
        f"torch {torch.__version__}, inductor: {args.inductor or 'defaults'}, "
        f"graph_fp8: {args.graph_fp8}"
    )
    print(
        "| recipe | graph | Triton kernels | launches | MB moved | inputs / outputs "
        "| scaled GEMMs and te_compile ops |"
    )
    print("|---|---|---|---|---|---|---|")
    # DelayedScaling last: TE's autocast exit (eager, and ours under compile) updates every
    # DelayedScaling layer registered in the process, so a recipe after it would count that too.
    for name in sorted(args.recipes.split(","), key=lambda name: name == "delayed"):
        for graph, (kernels, launches, megabytes, calls, (ins, outs)) in zip(
            ("forward", "backward"),
            count(name, args.hidden, args.tokens, inductor),
            strict=False,
        ):
            ops = ", ".join(f"{op.split('.')[-1]} {n}" for op, n in sorted(calls.items()))
            row = f"| {name} | {graph} | {kernels} | {launches} | {megabytes:.1f} | {ins} / {outs}"
            print(f"{row} | {ops} |")


if __name__ == "__main__":
    main()
