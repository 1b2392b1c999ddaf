"""Where a training step's memory goes, phase by phase, and what is alive at its peak.

Three cases, on a CUDA GPU:

- `checkpoint`: the 4-layer Llama-style model of tests/gpu/test_checkpoint_gpu.py without and
  with `te.distributed.checkpoint` per layer, its whole step compiled in default mode ("none",
  "te"), each layer compiled on its own ("blocks-none", "blocks-te") or eager TE ("eager-none",
  "eager-te"); docs/training.md has session 22's table;
- `guide`: TE's getting-started layer (bench/suite.py's `4096x2048x1x8`, heads of 128), eager
  TE against te-compile's default mode (the issue-20 target "peak memory <= eager TE");
- `linear`: one te.Linear at tests/gpu/test_step_memory_gpu.py's size, eager against compiled.

Per phase (forward, backward, optimizer where there is one) of the last of `--steps` steps: its
peak and what stays allocated after it (MiB). `--live N` also records that step's allocations
(torch.cuda.memory's history) and prints the N largest alive at the step's peak, each with the
line that allocated it (an inductor buffer, a te_compile op, TE's Python).

    python bench/step_memory.py --case checkpoint [--recipes current,delayed] [--steps 4]
        [--batch 16 --seq 512]
    python bench/step_memory.py --case guide --recipes delayed --live 12 [--variants compile,eager]
    python bench/step_memory.py --case guide --recipes delayed \
        --variants eager,reduce-overhead,reduce-overhead-static
"""

from __future__ import annotations

import argparse
import linecache
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
import models as M  # noqa: E402
import stacks  # noqa: E402
from profile_step import RECIPES  # noqa: E402  (bf16, current, block, delayed)
from suite import reset_state  # noqa: E402

import te_compile  # noqa: E402

MIB = 1 << 20
OURS = ("te_compile", "transformer_engine", "torchinductor")


BATCH, SEQ = 2, 128  # the checkpoint case's batch (--batch, --seq)


def checkpoint_case(recipe_name: str, variant: str):
    """(run(name, phase) -> None per step, steps' data) for the Llama model, with layers
    checkpointed ("te") or not ("none"): the whole step compiled (variant "none", "te"), each
    layer compiled on its own ("blocks-none", "blocks-te"; torchtitan's order) or eager TE
    ("eager-none", "eager-te")."""
    how, _, checkpoint = variant.rpartition("-")
    model = M.Llama(M.LlamaConfig(max_seq_len=SEQ, num_layers=4, checkpoint=checkpoint)).cuda()
    step = M.train_step(model, RECIPES[recipe_name]())
    if how == "":
        step = torch.compile(step, fullgraph=True)
    elif how == "blocks":
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def one_step(run, tokens, targets):
        loss = run("forward", step, tokens, targets)
        run("backward", loss.backward)
        run("optimizer", lambda: (opt.step(), opt.zero_grad(set_to_none=True)))

    return one_step, lambda steps: M.synthetic_batches(256, BATCH, SEQ, steps, seed=0)


def module_case(model, recipe_name: str, variant: str, x_shape, grad_shape):
    """One TE module's training step on a random input: eager TE ("eager"), compiled in default
    mode ("compile") or under CUDA graphs ("reduce-overhead": cudagraph trees copy the input,
    which is no parameter, into their pool at every replay, as bench/suite.py's step does;
    "reduce-overhead-static": the input marked static, so the graph reads it where it is, as
    it reads an input that an earlier compiled graph produced)."""
    import transformer_engine.pytorch as te

    recipe = RECIPES[recipe_name]()
    x = torch.randn(*x_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(*grad_shape, device="cuda", dtype=torch.bfloat16)

    def forward(inp):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return model(inp)

    if variant == "compile":
        forward = torch.compile(forward, fullgraph=True)
    elif variant.startswith("reduce-overhead"):
        if variant.endswith("-static"):
            torch._dynamo.mark_static_address(x)
        compiled = torch.compile(forward, fullgraph=True, mode="reduce-overhead")

        def forward(inp):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(inp)

    def one_step(run, _tokens, _targets):
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = run("forward", forward, x)
        run("backward", out.backward, grad)

    return one_step, lambda steps: [(None, None)] * steps


def guide_case(recipe_name: str, variant: str):
    """TE's guide layer (heads of 128, [S, B, H] = [2048, 8, 4096])."""
    stacks.HEAD_DIM = 128
    model = stacks.build("te-transformer", 4096, 1).cuda()
    return module_case(model, recipe_name, variant, (2048, 8, 4096), (2048, 8, 4096))


def linear_case(recipe_name: str, variant: str):
    """te.Linear 2048 -> 8192 on 8,192 tokens (tests/gpu/test_step_memory_gpu.py's size)."""
    import transformer_engine.pytorch as te

    model = te.Linear(2048, 8192, params_dtype=torch.bfloat16)
    return module_case(model, recipe_name, variant, (8192, 2048), (8192, 8192))


CASES = {
    "checkpoint": (
        checkpoint_case,
        ("none", "te", "blocks-none", "blocks-te", "eager-none", "eager-te"),
    ),
    "guide": (guide_case, ("eager", "compile", "reduce-overhead", "reduce-overhead-static")),
    "linear": (linear_case, ("eager", "compile")),
}


def where(frames: list[dict]) -> str:
    """The innermost frame in te_compile, TE or inductor's generated code, with its line."""
    for f in frames:
        if any(k in f["filename"] for k in OURS):
            text = linecache.getline(f["filename"], f["line"]).strip()
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}: {text[:90]}"
    return "(no te_compile/TE/inductor frame)"


def alive_at_peak(snapshot: dict, top: int) -> list[tuple[float, str]]:
    """Replays the recorded allocations; the `top` largest alive when their sum peaked."""
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_best: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][torch.cuda.current_device()]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], where(event.get("frames", [])))
            total += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
        if total > best:
            best, at_best = total, dict(live)
    rows = sorted(at_best.values(), reverse=True)[:top]
    return [(best / MIB, "all allocations of the step alive at its peak")] + [
        (size / MIB, site) for size, site in rows
    ]


def phases(case: str, recipe_name: str, variant: str, steps: int, live: int):
    reset_state()  # dynamo's and TE's state, and the cached blocks of the case before
    torch.manual_seed(0)
    one_step, data = CASES[case][0](recipe_name, variant)
    out: dict[str, float] = {}

    def run(name, fn, *args):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        result = fn(*args)
        torch.cuda.synchronize()
        out[f"{name} peak"] = torch.cuda.max_memory_allocated() / MIB
        out[f"after {name}"] = torch.cuda.memory_allocated() / MIB
        # over every step, the first ones too: under CUDA graphs the recording steps allocate
        # what the replays then reuse unseen by the allocator's counters (bench/suite.py's peak)
        out["peak of all steps"] = max(out.get("peak of all steps", 0.0), out[f"{name} peak"])
        return result

    batches = list(data(steps))
    for i, (tokens, targets) in enumerate(batches):
        last = i == len(batches) - 1
        if last and live:
            torch.cuda.memory._record_memory_history(context="alloc", stacks="python")
        out["start"] = torch.cuda.memory_allocated() / MIB
        one_step(run, tokens, targets)  # each step overwrites the one before
    sites = []
    if live:
        sites = alive_at_peak(torch.cuda.memory._snapshot(), live)
        torch.cuda.memory._record_memory_history(enabled=None)
    return out, sites


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=sorted(CASES), default="checkpoint")
    p.add_argument("--recipes", default="current,delayed")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--live", type=int, default=0, help="list the N largest alive at the peak")
    p.add_argument("--variants", help="comma-separated, in this order (default: the case's all)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    global BATCH, SEQ
    BATCH, SEQ = args.batch, args.seq
    variants = args.variants.split(",") if args.variants else CASES[args.case][1]
    te_compile.patch()
    rows = []
    for recipe_name in args.recipes.split(","):
        for variant in variants:
            values, sites = phases(args.case, recipe_name, variant, args.steps, args.live)
            rows.append((recipe_name, variant, values))
            for mib, site in sites:
                print(f"{recipe_name}/{variant}: {mib:9.2f} MiB  {site}")
    keys = list(rows[0][2])
    print("| recipe | variant | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for recipe_name, variant, values in rows:
        print(
            f"| {recipe_name} | {variant} | " + " | ".join(f"{values[k]:.2f}" for k in keys) + " |"
        )


if __name__ == "__main__":
    main()
