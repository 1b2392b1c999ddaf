"""Where a DelayedScaling TransformerLayer stack under CUDA graphs parts from the same steps in
default mode: a diagnosis table, one GPU (session 48's failure; session 49's finding below).

    python bench/cudagraph_parity.py [--graph-fp8 off] [--recipe delayed] [--steps 4]
        [--layers 4] [--dropout 0.1] [--no-bias] [--activation gelu] [--normalization LayerNorm]
        [--autocast inside] [--control] [--warm] [--against-eager] [--fallback-random]
        [--tokens 512] [--check]

Session 48 (H200, torch 2.11, TE 2.20.2): tests/gpu/test_cudagraph_loops_gpu.py's
`test_transformer_stack_cuda_graphs_delayed` (4 te.TransformerLayers, H=1024, FFN 4096, 16
heads, TE's defaults: LayerNorm, GELU, biases, dropout 0.1; [512, 1, 1024] inputs requiring
grad; AdamW) failed on TE's kernels (`TE_COMPILE_GRAPH_FP8=0`) in 3 of 3 cases run: the steps
under `mode="reduce-overhead"` differed from default mode's by up to 0.22-0.31, with 0
cudagraph skips. On the default path (the graph path for these GEMMs) all six cases pass, and on
TE's kernels the same file's Llama-style loops (RMSNorm, SwiGLU, no bias, no dropout) pass.

This runs that stack in default mode, then a fresh copy under CUDA graphs with the same seeds,
and prints per step whether the output and the input gradient are bit-identical and which
modules' DelayedScaling scales and histories differ after the step (forward and backward
directions apart). Reading it: a forward state that differs first points at the forward ops or
the autocast exit's update; a backward state first, at the backward ops (their grad casts and
updates); outputs that differ with equal state at a forward op's arithmetic or inputs. The flags
take one suspect out at a time: `--dropout 0` (the random masks), `--no-bias` (TE's fused dbias
casts), `--activation swiglu`, `--normalization RMSNorm` (the Llama-style modules that passed),
`--layers 1`, `--autocast outside` (the exit's update eager and deferred). `--control` runs
default mode twice instead: if those two differ, the path is not reproducible from run to run at
this shape and the CUDA graphs are not the cause. Run it first.

Session 49 found the cause this way: default mode twice with inductor's caches off
(`TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 ... --control`) differs exactly as the CUDA-graph run
does, and with `--warm` (one compile first, results unused) both comparisons are bit-identical:
a process's first compile is scheduled differently from later ones (docs/perf/history.md,
session 49). `--control` with the caches on reads the first compile's cached code and so agrees.
`--against-eager --control --fallback-random` compares eager TE with default mode under the same
dropout masks (with `--warm`, a later compile; without, with the caches off, a first one).

Session 50 (H200): before the change, eager TE matched a later compile (current scaling, 4
steps) and parted from a first one at step 0 (the FC2 bias gradient). Eager TE sums the dropout's
gradient as stored there, so modules/transformer_layer.py now rounds it as stored. After it,
with the caches off and no `--warm`, every comparison was bit-identical: `--control`,
reduce-overhead, and `--against-eager` at 512, 256 and 4096 tokens (`--tokens`). At 64 tokens
the bias gradients parted from eager TE: its own add then sums the unrounded values
(docs/training.md, "Known differences"). `--check` exits 1 on any difference
(tests/gpu/test_first_compile_gpu.py). Tables: docs/perf/session50/.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_count import GRAPH_FP8  # noqa: E402  (--graph-fp8's values, as kernel_count takes them)

HIDDEN, FFN, HEADS, TOKENS = 1024, 4096, 16, 512


def stack_steps(args, mode: str) -> list[dict]:
    """Per step: the output, the input gradient and every module's DelayedScaling state."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import quantization as q
    from varying_length_parity import RECIPES, state_of

    torch._dynamo.reset()
    q.FP8GlobalStateManager.reset()
    torch.manual_seed(0)
    hidden = args.dropout if args.hidden_dropout is None else args.hidden_dropout
    attention = args.dropout if args.attention_dropout is None else args.attention_dropout
    options = dict(hidden_dropout=hidden, attention_dropout=attention, bias=args.bias)
    options |= dict(activation=args.activation, normalization=args.normalization)
    layers = torch.nn.Sequential(
        *[
            te.TransformerLayer(HIDDEN, FFN, HEADS, params_dtype=torch.bfloat16, **options)
            for _ in range(args.layers)
        ]
    ).cuda()
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-3)
    recipe = RECIPES[args.recipe]()
    inside = args.autocast == "inside"

    def forward(x):
        with te.autocast(recipe=recipe):
            return layers(x)

    graphs = mode == "reduce-overhead"
    compiled = forward if inside else layers
    if mode != "eager":
        compiled = torch.compile(compiled, fullgraph=True, mode=mode if graphs else None)
    torch.manual_seed(1)
    records = []
    for _ in range(args.steps):
        x = torch.randn(args.tokens, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
        x.requires_grad_()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if inside:
            y = compiled(x)
        else:
            with te.autocast(recipe=recipe):
                y = compiled(x)
        y.float().square().mean().backward()
        grads = {f"grad:{n}": p.grad.clone() for n, p in layers.named_parameters()}
        records.append({"output": y.detach().clone(), "dgrad": x.grad.clone(), **state_of(layers)})
        records[-1] |= grads
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return records


def differences(got: dict, want: dict) -> list[tuple[str, float]]:
    """(name, max |diff|) of every tensor in both not bit-identical, in `want`'s order. Eager
    TE keeps DelayedScaling state for modules that te-compile's path does not (its
    DotProductAttention's); those are left out."""
    out = []
    for name, w in want.items():
        g = got.get(name)
        if g is not None and not torch.equal(g, w):
            out.append((name, (g.float() - w.float()).abs().nan_to_num(float("inf")).max().item()))
    return out


def add_layer_flags(p: argparse.ArgumentParser) -> None:
    """The flags this script shares with first_compile_code.py: path, recipe, dropout, bias,
    tokens."""
    p.add_argument("--graph-fp8", choices=sorted(GRAPH_FP8), default="off")
    p.add_argument("--recipe", default="delayed", choices=("delayed", "current"))
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--no-bias", dest="bias", action="store_false")
    p.add_argument("--tokens", type=int, default=TOKENS, help="sequence length (batch 1)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_layer_flags(p)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden-dropout", type=float, help="instead of --dropout's")
    p.add_argument("--attention-dropout", type=float, help="instead of --dropout's")
    p.add_argument("--activation", default="gelu")
    p.add_argument("--normalization", default="LayerNorm")
    p.add_argument("--autocast", choices=("inside", "outside"), default="inside")
    p.add_argument(
        "--warm", action="store_true", help="compile and run one step first, results unused"
    )
    p.add_argument("--control", action="store_true", help="default mode twice (no CUDA graphs)")
    p.add_argument(
        "--against-eager",
        action="store_true",
        help="eager TE as the first run (with --control: "
        "eager against default mode; add --fallback-random for the same dropout masks)",
    )
    p.add_argument("--check", action="store_true", help="exit with status 1 if any step differs")
    p.add_argument(
        "--fallback-random",
        action="store_true",
        help="inductor draws dropout through ATen, as "
        "eager does (torch._inductor.config.fallback_random)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/cudagraph_parity.py needs a CUDA GPU (see --help)")
    from torch._dynamo.utils import counters

    import te_compile

    te_compile.patch()
    te_compile.configure(graph_fp8=GRAPH_FP8[args.graph_fp8])
    if args.fallback_random:
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    if args.warm:
        stack_steps(argparse.Namespace(**(vars(args) | {"steps": 1})), "default")
    default = stack_steps(args, "eager" if args.against_eager else "default")
    counters.clear()
    graphed = stack_steps(args, "default" if args.control else "reduce-overhead")
    skips = counters["inductor"]["cudagraph_skips"]
    print(f"{vars(args)}; cudagraph skips: {skips}")
    first = "eager TE" if args.against_eager else "default mode"
    second = "default mode" if args.control else "CUDA graphs"
    print(f"(first run: {first}; second run: {second})")
    print(
        "| step | output | dgrad | DelayedScaling tensors differing (max abs diff), first 6 "
        "| parameter gradients differing, first 6 |"
    )
    print("|---|---|---|---|---|")
    differing = 0
    for step, (g, w) in enumerate(zip(graphed, default, strict=True)):
        diffs = dict(differences(g, w))
        differing += bool(diffs)
        cells = [f"{diffs[k]:.3g}" if k in diffs else "same" for k in ("output", "dgrad")]
        rest = [(k, v) for k, v in diffs.items() if k not in ("output", "dgrad")]
        state = [f"{k} ({v:.3g})" for k, v in rest if not k.startswith("grad:")]
        grads = [f"{k[5:]} ({v:.3g})" for k, v in rest if k.startswith("grad:")]
        print(
            f"| {step} | {' | '.join(cells)} | {', '.join(state[:6]) or 'none'} "
            f"| {', '.join(grads[:6]) or 'none'} ({len(grads)} in all) |"
        )
    print(f"{differing} of {len(default)} steps differ")
    if args.check and (differing or skips):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
