"""Variants of one training step timed in alternation, in one process: A/B comparisons that
the lent hosts' drift does not swamp.

    python bench/ab.py --variant te-transformer/current \\
        --variant te-transformer/current@triton.descriptive_names=0 \\
        --variant te-transformer/current@cpp_wrapper=1 --variant torchao-transformer \\
        [--shape 1024x512x4x1] [--mode compile] [--head-dim 64] [--rounds 12] [--steps 5]
        [--json PATH]

A variant is STACK[/RECIPE][@INDUCTOR][%SETTINGS], the stack and recipe as bench/suite.py
names them, INDUCTOR as its `--inductor` (options joined by commas) and SETTINGS te_compile's,
`NAME=VALUE` joined by commas and set around each of the variant's steps: a plain name is a
`te_compile.configure` option (`%graph_fp8=False`), a dotted one a module attribute
(`%te_compile.graph_fp8.quantize._ONE_KERNEL_ROWS=0`: the graph path's amaxes one by one, as
before session 39). Both are read when dynamo traces, which guards on them, so each setting
gets a compiled entry of its own and the variants switch between entries without compiling. Why: separate processes or calls of
the same step differ by up to 1.3x on a lent host at the CPU-bound shapes (session 36:
13.4 and 16.8 ms for the same cell), more than the changes being measured. Here every variant
is compiled first, then each round runs `--steps` steps of every variant, in an order rotated
from round to round; a variant's figures are medians over the rounds, and its ratio to the
first variant is the median of the per-round ratios, with their range.

TE variants share one model (and TE recipe): two TE models in one process would each update
the other's DelayedScaling state at every autocast exit. `cpp_wrapper=1` is applied as
inductor's global setting around the variant's first step (forward and backward compile), since
torch 2.11 takes it no other way (pytorch#178845), with an option at its default value
(`trace.enabled=0`) that gives it a compiled entry of its own: torch.compile's inductor
backends compare equal when their options do, and dynamo then runs one variant's code for the
other. A variant whose first call compiles nothing is refused for that reason; an A/A pair is
`X` and `X@trace.enabled=0`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import suite  # noqa: E402  (bench/suite.py: the stacks, recipes and compiled steps)
from profile_step import issue_ms  # noqa: E402

DEVICE = "cuda"  # the inputs' (the stacks build on CUDA; tests/cpu/test_bench_ab.py swaps both)


def parse_variant(text: str) -> tuple[str, str | None, str]:
    """STACK[/RECIPE][@INDUCTOR][%SETTINGS] -> (stack, recipe or None, inductor spec)."""
    head, _, inductor = text.partition("%")[0].partition("@")
    stack, _, recipe = head.partition("/")
    if suite.uses_te_recipes(stack) != bool(recipe):
        raise ValueError(f"{text}: a TE stack takes /RECIPE, any other stack none")
    return stack, recipe or None, inductor


def parse_settings(text: str) -> dict[str, object]:
    """A variant's SETTINGS (the text after `%`) -> {name: value}, values as Python literals."""
    settings = {}
    for item in filter(None, text.partition("%")[2].split(",")):
        name, _, value = item.partition("=")
        settings[name.strip()] = ast.literal_eval(value.strip())
    return settings


def _swap_settings(settings: dict[str, object]) -> dict[str, object]:
    """Apply `settings`; returns the values they replaced (apply those to restore)."""
    import te_compile

    old = {}
    for name, value in settings.items():
        if "." in name:
            module, _, attr = name.rpartition(".")
            target = importlib.import_module(module)
            old[name] = getattr(target, attr)
            setattr(target, attr, value)
        else:
            old[name] = getattr(te_compile.options.current(), name)
            te_compile.configure(**{name: value})
    return old


def with_settings(step, settings: dict[str, object]):
    """`step` run with `settings` in force, the previous values restored after it."""
    if not settings:
        return step

    def run():
        old = _swap_settings(settings)
        try:
            return step()
        finally:
            _swap_settings(old)

    return run


def build_steps(variants: list[str], shape: str, mode: str) -> list:
    """One step function per variant (see the module docstring for what they share)."""
    hidden, tokens, layers, batch = suite.parse_shape(shape)
    dims = (tokens, hidden) if batch is None else (tokens, batch, hidden)
    parsed = [parse_variant(v) for v in variants]
    te_recipes = {recipe for _, recipe, _ in parsed if recipe}
    if len(te_recipes) > 1 or len({s for s, r, _ in parsed if r}) > 1:
        raise ValueError("the TE variants must share one stack and recipe (their options differ)")
    models, steps = {}, []
    for variant_text, (stack, recipe_name, inductor) in zip(variants, parsed, strict=True):
        key = (stack, recipe_name)
        if key not in models:
            torch.manual_seed(0)
            model = suite.build(stack, hidden, layers)
            x = torch.randn(*dims, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(*dims, device=DEVICE, dtype=torch.bfloat16)
            recipe, why = suite.make_recipe(recipe_name) if recipe_name else (None, None)
            if why:
                raise SystemExit(f"{stack}/{recipe_name}: {why}")
            models[key] = (model, x, grad, recipe)
        model, x, grad, recipe = models[key]
        items = [item for item in inductor.split(",") if item]
        cpp = "cpp_wrapper=1" in items
        items = [i for i in items if not i.startswith("cpp_wrapper=")]
        # torch.compile's inductor backends compare equal when their options do, and dynamo then
        # reuses the other variant's compiled code: an option at its default value keeps the
        # wrapper variant's own (session 37: it had reused the first variant's, 0.0 s to compile).
        suite.INDUCTOR["spec"] = ",".join(items + ["trace.enabled=0"] * cpp)
        step = suite.make_train_step(model, recipe_name, recipe, mode, x, grad)
        steps.append((with_settings(step, parse_settings(variant_text)), cpp))
    return steps


def first_calls(steps: list, warmup: int) -> list[float]:
    """Compile each variant (its first call, in seconds) and warm it up."""
    from torch._inductor import config as inductor_config

    seconds = []
    frames = torch._dynamo.utils.counters["stats"]
    for step, cpp in steps:
        before = frames["unique_graphs"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if cpp:
            with inductor_config.patch(cpp_wrapper=True):
                step()
        else:
            step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        if frames["unique_graphs"] == before:
            raise RuntimeError(
                "a variant's first call compiled nothing: it reused another variant's compiled "
                "code (equal options; for an A/A pair add an option at its default value, e.g. "
                "@trace.enabled=0), or dynamo's recompile limit was reached"
            )
        for _ in range(warmup):
            step()
    return seconds


def one_round(step, steps: int) -> tuple[float, float]:
    """(median ms per step issued back to back, median CPU ms to issue one step on an idle GPU)."""
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(steps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), issue_ms(step, steps)


def alternate(run_round, n_variants: int, rounds: int) -> list[list[tuple[float, float]]]:
    """Per variant, its (step ms, issue ms) of every round; round r starts at variant r mod n."""
    per_variant = [[] for _ in range(n_variants)]
    for r in range(rounds):
        for i in range(n_variants):
            v = (r + i) % n_variants
            per_variant[v].append(run_round(v))
    return per_variant


def summary(variants: list[str], per_variant, compile_s: list[float]) -> list[dict]:
    rows = []
    base = [step for step, _ in per_variant[0]]
    for name, measured, seconds in zip(variants, per_variant, compile_s, strict=True):
        ratios = [b / step for (step, _), b in zip(measured, base, strict=True)]
        rows.append(
            {
                "variant": name,
                "first_call_s": seconds,
                "step_ms": statistics.median(s for s, _ in measured),
                "issue_ms": statistics.median(i for _, i in measured),
                "speedup_vs_first": statistics.median(ratios),
                "speedup_range": [min(ratios), max(ratios)],
                "rounds": measured,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print("| variant | first call s | ms per step | CPU ms to issue | vs the first (range) |")
    print("|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["speedup_range"]
        print(
            f"| {r['variant']} | {r['first_call_s']:.1f} | {r['step_ms']:.3f} | "
            f"{r['issue_ms']:.3f} | {r['speedup_vs_first']:.3f}x ({lo:.3f}-{hi:.3f}) |"
        )


def selftest() -> None:
    """The rotation and the summary on fabricated rounds (no GPU)."""
    order = []
    measured = alternate(lambda v: order.append(v) or (10.0 / (v + 1), 1.0), 3, 4)
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2], order
    rows = summary(["a", "b", "c"], measured, [1.0, 2.0, 3.0])
    assert [round(r["speedup_vs_first"], 6) for r in rows] == [1.0, 2.0, 3.0]
    assert parse_variant("te-transformer/current@a=1,b=0") == (
        "te-transformer",
        "current",
        "a=1,b=0",
    )
    assert parse_variant("torchao-transformer") == ("torchao-transformer", None, "")
    print_table(rows)
    print("selftest ok")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--variant", action="append", default=[], help="STACK[/RECIPE][@INDUCTOR][%%SETTINGS]"
    )
    p.add_argument("--shape", default="1024x512x4x1", help="as bench/suite.py's --shapes")
    p.add_argument("--mode", choices=suite.COMPILED, default="compile")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the rounds and the summary here")
    p.add_argument("--selftest", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.selftest:
        return selftest()
    if len(args.variant) < 2:
        p.error("name two --variant or more")
    if not torch.cuda.is_available():
        raise SystemExit("bench/ab.py needs a CUDA GPU (see --help)")
    import te_compile

    te_compile.patch()
    suite.stack_builders.HEAD_DIM = args.head_dim
    steps = build_steps(args.variant, args.shape, args.mode)
    compile_s = first_calls(steps, args.warmup)
    measured = alternate(lambda v: one_round(steps[v][0], args.steps), len(steps), args.rounds)
    rows = summary(args.variant, measured, compile_s)
    print(f"{args.shape}, {args.mode}, {args.rounds} rounds of {args.steps} steps per variant")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": suite.versions(), "argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
