"""GPU time per kernel of one compiled te.TransformerLayer training step, and by kind of work.

    python bench/layer_kernels.py [--recipe current] [--hidden 2048] [--tokens 1024] [--batch 2]
                                  [--head-dim 64] [--off graph_fp8] [--steps 5]

One causal te.TransformerLayer (the te-transformer block of stacks.py) compiled fullgraph in
default mode, its parameters' gradients dropped before each step; torch.profiler records
`--steps` steps after warm-up. Prints every kernel (us per step, launches per step, name), then
the kinds: GEMMs, attention, norms, quantization (amax, cast, transpose, scales: inductor's
kernels on the graph path, TE's on its kernels), TE's GELU kernels, dbias sums, DelayedScaling's
update. The GPU time is what a CUDA-graph step waits on at the GPU-bound shapes: comparing the
graph path with `--off graph_fp8` (TE's kernels) shows where the graph path's time goes
(docs/perf/history.md, session 23).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import profile_step  # noqa: E402
import stacks  # noqa: E402

import te_compile  # noqa: E402

KINDS = (  # (kind, predicate on the kernel's name), first match wins
    ("GEMM", lambda n: n.startswith("nvjet") or "gemm" in n.lower()),
    ("attention", lambda n: "cudnn" in n or "flash" in n or "fused_attn" in n),
    ("norm", lambda n: "normalization" in n),
    ("DelayedScaling update", lambda n: "amax_and_scale_update" in n),
    ("dbias sums", lambda n: "reduce_kernel" in n or "reduce_dbias" in n),
    ("TE GELU / dGELU", lambda n: "transformer_engine" in n and "gelu" in n),
    ("quantization", lambda n: True),
)


def kind(name: str) -> str:
    return next(k for k, match in KINDS if match(name))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="current", choices=["current", "delayed"])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--off", default="", help="te_compile options to turn off, e.g. graph_fp8")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    te_compile.patch()
    if args.off:
        te_compile.configure(**{name: False for name in args.off.split(",")})
    stacks.HEAD_DIM = args.head_dim
    torch.manual_seed(0)
    model = stacks.build("te-transformer", args.hidden, 1)
    x = torch.randn(args.tokens, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16)
    x.requires_grad_(True)
    recipe = profile_step.RECIPES[args.recipe]()
    step = profile_step.make_train_step(model, recipe, "compile", x, torch.randn_like(x))
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    us, launches = collections.defaultdict(float), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name] += e.device_time / args.steps
            launches[e.name] += 1
    by_kind = collections.defaultdict(float)
    for name, t in sorted(us.items(), key=lambda item: -item[1]):
        by_kind[kind(name)] += t
        print(f"{t:9.1f} us {launches[name] / args.steps:5.1f}x  {name[:140]}")
    print(
        f"\n1 x te.TransformerLayer, {args.recipe}, hidden {args.hidden}, input "
        f"[{args.tokens}, {args.batch}, {args.hidden}], off: {args.off or 'none'}, "
        f"{torch.cuda.get_device_name()}: GPU us per fwd+bwd step\n| kind | us |\n|---|---|"
    )
    for k, _ in KINDS:
        print(f"| {k} | {by_kind.get(k, 0.0):.0f} |")
    print(f"| total | {sum(us.values()):.0f} |")


if __name__ == "__main__":
    main()
