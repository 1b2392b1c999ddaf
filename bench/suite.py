"""The benchmark suite: every stack x recipe x mode x shape, as tables, JSON and PNG plots.

    python bench/suite.py [--quick] [--shapes 1024x1024x4,4096x8192x1,1024x512x4x1]
        [--stacks te,torch,torchao-tensorwise,torchao-rowwise] [--recipes bf16,current,block,delayed]
        [--modes eager,compile,reduce-overhead] [--json PATH] [--plots DIR]

A shape is HIDDEN x TOKENS x LAYERS of a stack from bench/stacks.py (input [TOKENS, HIDDEN]), or
HIDDEN x SEQ x LAYERS x BATCH (input [SEQ, BATCH, HIDDEN], for the transformer stacks; the MLP
stacks take it too). bench/stacks.py's BUILDERS is the only registry: a new module family is a
new builder there, nothing here; PEERS names which stacks a TE stack's ratios compare against. A stack named "te" or "te-*"
runs once per TE recipe, te.autocast inside the step; any other stack runs once, in its own
numerics. A training step: zero grads, forward, backward with a fixed random gradient.

Per cell (fresh model, dynamo and TE state): the first call in seconds (the compile, in compiled
modes); after warm-up, the median ms per step (CUDA events around each of N steps issued back to
back), the median CPU ms to issue one step (GPU idle when it starts), peak GPU memory (over the
warm-up and measured steps: reduce-overhead takes its memory while recording), graphs
compiled and recompiles. A failing cell keeps its error and the suite goes on, unless it left
CUDA unusable (a failed graph capture): then the suite stops there and reports what it
measured. The JSON is rewritten after every cell, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stacks as stack_builders  # noqa: E402
from stacks import BUILDERS, build  # noqa: E402

from te_compile_testing import compile_options  # noqa: E402

MODES = ("eager", "compile", "reduce-overhead")
COMPILED = ("compile", "reduce-overhead")
TE_RECIPES = ("bf16", "current", "block", "delayed")
# Variants, run when named in --recipes as "<recipe>-<variant>": that recipe with these
# te_compile options (the rest at their defaults). "graph": FP8 quantization and GEMMs as graph
# ops wherever they apply (the default: small per-tensor GEMMs only); "tekernels": TE's
# kernels for every GEMM (graph_fp8=False); "tecalls": every GEMM through TE's extension (no
# aten scaled GEMM); "graphweights": current-scaling weights quantized in the graph (opt-in);
# "atenblock": block scaling's GEMMs through aten's blockwise scaled matmul (opt-in).
VARIANTS = {
    "graph": {"graph_fp8": True},
    "tekernels": {"graph_fp8": False},
    "tecalls": {"aten_fp8_gemm": False},
    "graphweights": {"graph_weight_quantize": True},
    "atenblock": {"aten_block_gemm": True},
}
EXTRA_RECIPES = (
    *("current-graph", "delayed-graph", "current-tecalls", "delayed-tecalls"),
    *("current-tekernels", "delayed-tekernels"),
    "current-graphweights",
    "block-atenblock",
    "guide",  # DelayedScaling as TE's getting-started guide sets it (make_recipe)
)
REFERENCE = "te"  # the stack whose speed-ups the ratio table and plot show
# TE stacks compared against peers built on the same block (their ms / ours in the ratios).
PEERS = {
    "te": ("torch", "torchao-tensorwise", "torchao-rowwise"),
    "te-transformer": ("torch-transformer", "torchao-transformer"),
}
SHAPE_RE = r"\d+x\d+x\d+(x\d+)?"
MIB = 1024 * 1024


def parse_shape(shape: str) -> tuple[int, int, int, int | None]:
    """ "HxTxL" -> (H, T, L, None); "HxSxLxB" -> (H, S, L, B)."""
    hidden, tokens, layers, *batch = (int(v) for v in shape.split("x"))
    return hidden, tokens, layers, batch[0] if batch else None


def shape_title(shape: str) -> str:
    hidden, tokens, layers, batch = parse_shape(shape)
    if batch is None:
        return f"H={hidden}, T={tokens}, layers={layers}"
    return f"H={hidden}, S={tokens}, B={batch}, layers={layers}"


def uses_te_recipes(stack: str) -> bool:
    return stack == "te" or stack.startswith("te-")


def row_label(stack: str, recipe: str | None) -> str:
    return f"{stack}/{recipe}" if recipe else stack


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def base_recipe(name: str) -> str:
    """The TE recipe of a recipe name, its variant suffix (VARIANTS) removed."""
    base, _, variant = name.partition("-")
    return base if variant in VARIANTS else name


def make_recipe(name: str):
    """(recipe object, or None for bf16; TE's reason this GPU can't run it, or None)."""
    from transformer_engine.common import recipe as R
    from transformer_engine.pytorch import quantization as q

    if name == "bf16":
        return None, None
    name = base_recipe(name)
    factory, check = {
        "current": (R.Float8CurrentScaling, q.check_fp8_support),
        "block": (R.Float8BlockScaling, q.check_fp8_block_scaling_support),
        "delayed": (R.DelayedScaling, q.check_fp8_support),
        # TE's getting-started guide: E4M3 forward, E5M2 backward, 16 steps of history, "max".
        "guide": (
            lambda: R.DelayedScaling(
                fp8_format=R.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"
            ),
            q.check_fp8_support,
        ),
    }[name]
    ok, why = check()
    return factory(), None if ok else why


AUTOCAST = {"where": "inside"}  # --autocast: "outside" compiles the model, te.autocast eager
INDUCTOR = {"spec": ""}  # --inductor: inductor options for every compiled cell


def compile_kwargs_for(mode: str) -> dict:
    """torch.compile's arguments for a cell: `mode`, or with --inductor the same as options
    (torch.compile takes one or the other)."""
    options = compile_options(INDUCTOR["spec"], mode == "reduce-overhead")
    if options is None:
        return {"fullgraph": True, "mode": None if mode == "compile" else mode}
    return {"fullgraph": True, "options": options}


def make_train_step(model, te_recipe: str | None, recipe, mode: str, x, grad):
    forward = model
    compile_kwargs = compile_kwargs_for(mode)
    if te_recipe is not None:
        import te_compile

        variant = VARIANTS.get(te_recipe.partition("-")[2], {})
        te_compile.configure(**{**dataclasses.asdict(te_compile.options.Options()), **variant})
        import transformer_engine.pytorch as te

        inner = model
        if AUTOCAST["where"] == "outside" and mode != "eager":
            inner, mode = torch.compile(model, **compile_kwargs), "eager-outer"

        def forward(inp):  # compiled whole (inside) or around the compiled model (outside)
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return inner(inp)

    if mode not in ("eager", "eager-outer"):
        forward = torch.compile(forward, **compile_kwargs)

    def step():
        if mode == "reduce-overhead":  # a new CUDA-graph step: last step's outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        x.grad = None
        forward(x).backward(grad)

    return step


def reset_state() -> None:
    torch._dynamo.reset()  # also drops the CUDA-graph trees of the last cell
    if "transformer_engine.pytorch" in sys.modules:
        from transformer_engine.pytorch import quantization as q

        q.FP8GlobalStateManager.reset()
    gc.collect()
    torch.cuda.empty_cache()


def measure(step, model, x, warmup: int, steps: int) -> dict:
    stats = torch._dynamo.utils.counters["stats"]  # not cleared by dynamo.reset: take a delta
    inductor = torch._dynamo.utils.counters["inductor"]
    graphs_before, skips_before = stats["unique_graphs"], inductor["cudagraph_skips"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):  # in reduce-overhead this covers CUDA-graph warm-up and capture
        step()
    # A replayed CUDA graph allocates nothing: its memory is taken while it is recorded, so
    # the peak counts the warm-up steps too (the same steps as measured, in the other modes).
    warmup_peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)  # "before the step": weights and state, no old grads
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(steps)]
    for start, end in events:  # back to back: issuing a step overlaps the last one's GPU work
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    peak = max(warmup_peak, torch.cuda.max_memory_allocated())
    issue = []
    for _ in range(steps):  # GPU idle at the start: the CPU cost of issuing one step alone
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        issue.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    graphs = stats["unique_graphs"] - graphs_before
    return {
        "compile_s": compile_s,
        "step_ms": statistics.median(start.elapsed_time(end) for start, end in events),
        "issue_ms": statistics.median(issue),
        "peak_mib": peak / MIB,
        "step_peak_mib": (peak - base) / MIB,
        "graphs": graphs,
        "recompiles": max(0, graphs - 1),  # one fullgraph function: each graph past 1 is one
        "cudagraph_skips": inductor["cudagraph_skips"] - skips_before,
    }


def run_cell(stack, te_recipe, mode, shape: str, warmup: int, steps: int) -> dict:
    cell = {"shape": shape, "stack": stack, "recipe": te_recipe, "mode": mode, "status": "ok"}
    hidden, tokens, layers, batch = parse_shape(shape)
    dims = (tokens, hidden) if batch is None else (tokens, batch, hidden)
    try:
        recipe, unsupported = make_recipe(te_recipe) if te_recipe else (None, None)
        if unsupported:
            return {**cell, "status": "skipped", "reason": unsupported}
        if mode == "eager" and te_recipe and base_recipe(te_recipe) != te_recipe:  # TE's own
            return {**cell, "status": "skipped", "reason": "eager: the recipe's own eager row"}
        reset_state()
        torch.manual_seed(0)
        model = build(stack, hidden, layers)
        x = torch.randn(*dims, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(*dims, device="cuda", dtype=torch.bfloat16)
        step = make_train_step(model, te_recipe, recipe, mode, x, grad)
        cell.update(measure(step, model, x, warmup, steps))
        if mode == "eager":
            cell["graphs"] = cell["recompiles"] = None
    except Exception as e:  # noqa: BLE001  (a failing cell is reported, not fatal)
        cell.update(status="error", error=first_line(e))
    return cell


def cuda_context_broken() -> str | None:
    """Why the process's CUDA state can no longer measure anything (a failed CUDA-graph capture
    leaves the context or the RNG in capture state), or None. Later cells would only repeat the
    error: the suite stops and says so."""
    try:
        torch.randn(1, device="cuda")
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return first_line(e)
    return None


def usable_stacks(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Builds each stack once, tiny, so a missing package skips its rows with one clear line."""
    usable, skipped = [], {}
    for name in names:
        if name not in BUILDERS:
            raise SystemExit(f"unknown stack {name!r}; bench/stacks.py has {', '.join(BUILDERS)}")
        try:
            build(name, 64, 1)
            usable.append(name)
        except Exception as e:  # noqa: BLE001  (a stack that can't be built skips its rows)
            missing = (getattr(e, "name", None) or "").split(".")[0]
            why = f"{name} unavailable ({first_line(e)}): skipping its rows"
            if isinstance(e, ModuleNotFoundError) and missing:
                why = f"{missing} not installed: skipping {missing} rows (bring its wheel: see "
                why += "docs/performance.md)"
            if why not in skipped.values():
                print(why, flush=True)
            skipped[name] = why
    return usable, skipped


def versions() -> dict:
    def dist(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    te = sys.modules.get("transformer_engine")
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU",
        "torch": torch.__version__,
        "transformer_engine": getattr(te, "__version__", None) or dist("transformer-engine"),
        "torchao": dist("torchao"),
        "te_compile": getattr(sys.modules.get("te_compile"), "__version__", None),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---- Reporting: reads only the results dict (no GPU), so --selftest checks it on a CPU ----


def index(results: dict) -> dict:
    return {(c["shape"], c["stack"], c["recipe"], c["mode"]): c for c in results["cells"]}


def ms_of(cells: dict, shape, stack, recipe, mode) -> float | None:
    cell = cells.get((shape, stack, recipe, mode))
    return cell["step_ms"] if cell and cell["status"] == "ok" else None


def rows_of(results: dict, shape: str) -> list[tuple[str, str | None]]:
    rows = [(c["stack"], c["recipe"]) for c in results["cells"] if c["shape"] == shape]
    return list(dict.fromkeys(rows))


def best(times) -> float | None:
    return min((t for t in times if t), default=None)


def vs_eager(stack: str, mode: str) -> str:
    prefix = "" if stack == REFERENCE else f"{stack}: "
    return f"{prefix}{mode} vs eager {stack}"


def compute_ratios(results: dict) -> list[dict]:
    """Speed-ups per shape and recipe: each TE stack's compiled modes against its own eager
    run, and the reference stack against the peers (their ms / our ms; >1: we win)."""
    cells, out = index(results), []
    compiled = [m for m in COMPILED if m in results["modes"]]
    for shape in results["shapes"]:
        rows = rows_of(results, shape)
        others = [stack for stack, recipe in rows if recipe is None]
        for stack, recipe in [(s, r) for s, r in rows if uses_te_recipes(s)]:
            ours = {m: ms_of(cells, shape, stack, recipe, m) for m in results["modes"]}
            prefix = "" if stack == REFERENCE else f"{stack}: "
            # a variant has no eager run of its own: eager TE is the recipe's
            eager = ours.get("eager") or ms_of(cells, shape, stack, base_recipe(recipe), "eager")
            pairs = [(vs_eager(stack, m), eager, ours[m]) for m in compiled]
            for other in [o for o in PEERS.get(stack, ()) if o in others]:
                theirs = {m: ms_of(cells, shape, other, None, m) for m in compiled}
                pairs += [(f"{prefix}vs {other}, {m}", theirs[m], ours[m]) for m in compiled]
                best_ours = best(ours[m] for m in compiled)
                best_theirs = best(theirs.values())
                pairs.append((f"{prefix}vs {other}, best compiled mode", best_theirs, best_ours))
            out += [
                {"shape": shape, "recipe": recipe, "comparison": name, "speedup": theirs / mine}
                for name, theirs, mine in pairs
                if theirs and mine
            ]
    return out


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = [head, ["---"] * len(head), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def speedup_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_tables(results: dict) -> None:
    cells, modes, meta = index(results), results["modes"], results["meta"]
    print(f"\n{meta['device']}, torch {meta['torch']}, TE {meta['transformer_engine']}, ", end="")
    print(f"torchao {meta['torchao']}, median of {results['steps']} steps")
    for shape in results["shapes"]:
        print(f"\n### {shape_title(shape)}: ms/step, CPU ms to issue, MiB\n")
        timing, first_call, errors, skips = [], [], [], []
        for stack, recipe in rows_of(results, shape):
            label = row_label(stack, recipe)
            timing.append([label])
            first_call.append([label])
            for mode in modes:
                c = cells.get((shape, stack, recipe, mode), {"status": "skipped", "reason": None})
                if c["status"] == "ok":
                    timing[-1] += [fmt(c["step_ms"]), fmt(c["issue_ms"]), fmt(c["peak_mib"], ".0f")]
                    counts = "" if c["graphs"] is None else f" ({c['graphs']}, {c['recompiles']})"
                    if c.get("cudagraph_skips"):  # inductor fell back from CUDA graphs
                        counts += f", {c['cudagraph_skips']} cudagraph skips"
                    first_call[-1].append(f"{c['compile_s']:.1f}{counts}")
                    continue
                text = "n/a"
                if c["status"] == "error":
                    errors.append(f"error {len(errors) + 1}: {label} {mode}: {c['error']}")
                    text = f"error {len(errors)}"
                elif c["reason"] and f"n/a {label}: {c['reason']}" not in skips:
                    skips.append(f"n/a {label}: {c['reason']}")
                timing[-1] += [text, "", ""]
                first_call[-1].append(text)
        cols = ("ms", "CPU ms", "MiB")
        print(md_table(["row"] + [f"{m} {col}" for m in modes for col in cols], timing))
        print("\n".join(errors + skips))
        print("\nFirst call, s (graphs compiled, recompiles); step-peak MiB is in the JSON\n")
        print(md_table(["row", *modes], first_call))
    for name, why in results.get("skipped_stacks", {}).items():
        print(f"\n{name}: {why}")
    for shape in results["shapes"]:
        mine = [r for r in results["ratios"] if r["shape"] == shape]
        recipes = list(dict.fromkeys(r["recipe"] for r in mine))
        if not mine:
            continue
        speedups = {(r["comparison"], r["recipe"]): r["speedup"] for r in mine}
        rows = [
            [name] + [speedup_text(speedups.get((name, rcp))) for rcp in recipes]
            for name in dict.fromkeys(r["comparison"] for r in mine)
        ]
        print(f"\n### Ratios, {shape}: speed-ups (their ms / ours; peers vs {REFERENCE})\n")
        print(md_table(["comparison", *recipes], rows))


def plot(results: dict, folder: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping plots (the JSON has every number)")
        return []
    cells, modes, written = index(results), results["modes"], []

    def grouped_bars(ax, labels, series, width):  # series: {legend label: one value per label}
        for i, (name, values) in enumerate(series.items()):
            offset = (i - (len(series) - 1) / 2) * width
            ax.bar([x + offset for x in range(len(labels))], values, width, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.legend()

    for shape in results["shapes"]:  # one figure per shape: ms/step per row, a bar per mode
        rows = rows_of(results, shape)
        fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.5))
        series = {m: [ms_of(cells, shape, s, r, m) or 0.0 for s, r in rows] for m in modes}
        grouped_bars(ax, [row_label(s, r) for s, r in rows], series, 0.8 / len(modes))
        ax.set_ylabel("ms per training step (lower is better)")
        ax.set_title(f"{shape_title(shape)}, {results['meta']['device']}")
        written.append(os.path.join(folder, f"step-ms-{shape}.png"))
        fig.tight_layout()
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    shapes, compiled = results["shapes"], [m for m in COMPILED if m in modes]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):  # a panel per shape
        te_stacks = [s for s, _ in rows_of(results, shape) if uses_te_recipes(s)]
        ref = REFERENCE if REFERENCE in te_stacks or not te_stacks else te_stacks[0]
        recipes = [r for s, r in rows_of(results, shape) if s == ref]
        mine = [r for r in results["ratios"] if r["shape"] == shape]
        ratio = {(r["comparison"], r["recipe"]): r["speedup"] for r in mine}
        series = {m: [ratio.get((vs_eager(ref, m), rcp), 0.0) for rcp in recipes] for m in compiled}
        grouped_bars(ax, recipes, series, 0.8 / max(1, len(compiled)))
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_title(f"{shape}: speed-up vs eager {ref} (>1 is faster)")
    written.append(os.path.join(folder, "speedup-vs-eager.png"))
    fig.tight_layout()
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def write_json(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def report(results: dict, json_path: str, plots_dir: str) -> None:
    results["ratios"] = compute_ratios(results)
    print_tables(results)
    write_json(results, json_path)
    os.makedirs(plots_dir, exist_ok=True)
    print("\nwrote " + ", ".join([json_path, *plot(results, plots_dir)]))


def selftest() -> None:
    """Tables, ratios, JSON and plots on fabricated cells, in a folder removed afterwards."""
    mlp_rows = [("te", r) for r in TE_RECIPES] + [("te-lnmlp", r) for r in TE_RECIPES]
    mlp_rows += [("torch", None), ("torchao-tensorwise", None)]
    block_rows = [("te-transformer", r) for r in TE_RECIPES]
    block_rows += [("torch-transformer", None), ("torchao-transformer", None)]
    rows_per_shape = {"1024x1024x4": mlp_rows, "4096x8192x1": mlp_rows, "1024x512x4x1": block_rows}
    shapes = list(rows_per_shape)
    results = {"meta": versions(), "steps": 5, "shapes": shapes, "modes": list(MODES)}
    results["skipped_stacks"] = {"torchao-rowwise": "torchao not installed: (fabricated)"}
    results["cells"] = []
    for n, (shape, (stack, recipe), mode) in enumerate(
        (shape, row, mode)
        for shape, rows in rows_per_shape.items()
        for row in rows
        for mode in MODES
    ):
        cell = {"shape": shape, "stack": stack, "recipe": recipe, "mode": mode, "status": "ok"}
        cell.update(compile_s=1.0 + n % 7, step_ms=0.5 + n % 5 / 4, issue_ms=0.3, peak_mib=900.0)
        cell.update(step_peak_mib=300.0, graphs=None if mode == "eager" else 1, recompiles=0)
        if recipe == "block" and mode == "compile":
            cell.update(status="error", error="RuntimeError: fabricated")
        if recipe == "delayed" and shape == shapes[1]:
            cell.update(status="skipped", reason="fabricated: no FP8 on this GPU")
        results["cells"].append(cell)
    with tempfile.TemporaryDirectory() as folder:
        report(results, os.path.join(folder, "bench.json"), folder)
        with open(os.path.join(folder, "bench.json")) as f:
            ratios = json.load(f)["ratios"]
        assert ratios, "no ratios computed"
        block = {r["comparison"] for r in ratios if r["shape"] == "1024x512x4x1"}
        want = "te-transformer: vs torch-transformer, reduce-overhead"
        assert want in block and not any("vs torch," in c for c in block), sorted(block)
        assert parse_shape("1024x512x4x2") == (1024, 512, 4, 2)
        assert parse_shape("1024x1024x4") == (1024, 1024, 4, None)
        print(f"selftest ok: {sorted(os.listdir(folder))}")


def parse_args() -> argparse.Namespace:
    out = os.environ.get("OUT")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    shapes_help = "HIDDENxTOKENSxLAYERS or HIDDENxSEQxLAYERSxBATCH, comma-separated"
    p.add_argument("--shapes", default="1024x1024x4,4096x8192x1", help=shapes_help)
    stacks_help = f"from bench/stacks.py: {', '.join(BUILDERS)}"
    p.add_argument(
        "--stacks", default="te,torch,torchao-tensorwise,torchao-rowwise", help=stacks_help
    )
    p.add_argument("--recipes", default=",".join(TE_RECIPES), help="TE recipes, for te stacks")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--quick", action="store_true", help="smoke run: warm-up 2, measure 5 steps")
    p.add_argument("--warmup", type=int, help="warm-up steps after the first call (default 5)")
    p.add_argument("--steps", type=int, help="measured steps (default 30)")
    json_default = os.path.join(out, "bench.json") if out else "/tmp/te-compile-bench.json"
    p.add_argument("--json", default=json_default, help="results file (default %(default)s)")
    p.add_argument("--plots", help="folder for the PNGs (default: the JSON's folder)")
    p.add_argument("--head-dim", type=int, default=128, help="attention head size (transformers)")
    p.add_argument(
        "--autocast",
        choices=("inside", "outside"),
        default="inside",
        help="te.autocast inside the compiled step (default) or around the compiled model",
    )
    p.add_argument("--inductor", default="", help="inductor options, e.g. cpp_wrapper=1")
    p.add_argument("--selftest", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.warmup = (2 if args.quick else 5) if args.warmup is None else args.warmup
    args.steps = (5 if args.quick else 30) if args.steps is None else args.steps
    args.plots = args.plots or os.path.dirname(os.path.abspath(args.json))
    if not all(re.fullmatch(SHAPE_RE, s) for s in args.shapes.split(",")):
        p.error(f"--shapes: want HIDDENxTOKENSxLAYERS[xBATCH],... (got {args.shapes})")
    for name, allowed in (("modes", MODES), ("recipes", TE_RECIPES + EXTRA_RECIPES)):
        unknown = set(getattr(args, name).split(",")) - set(allowed)
        if unknown:
            p.error(f"--{name}: unknown {', '.join(sorted(unknown))}; known: {', '.join(allowed)}")
    return args


def main() -> None:
    args = parse_args()
    if args.selftest:
        return selftest()
    if not torch.cuda.is_available():
        raise SystemExit("bench/suite.py needs a CUDA GPU (see --help)")
    import te_compile

    te_compile.patch()
    stack_builders.HEAD_DIM = args.head_dim
    AUTOCAST["where"] = args.autocast
    INDUCTOR["spec"] = args.inductor
    modes = [m for m in MODES if m in args.modes.split(",")]
    stacks, skipped = usable_stacks(args.stacks.split(","))
    shapes = args.shapes.split(",")
    results = dict(meta=versions(), argv=sys.argv[1:], warmup=args.warmup, steps=args.steps)
    results["head_dim"] = args.head_dim
    results["autocast"] = args.autocast
    results["inductor"] = args.inductor or "defaults"
    results.update(shapes=shapes, modes=modes, stacks=stacks, skipped_stacks=skipped, cells=[])
    plan = [
        (shape, stack, recipe, mode)
        for shape in shapes
        for stack in stacks
        for recipe in (args.recipes.split(",") if uses_te_recipes(stack) else [None])
        for mode in modes
    ]
    for i, (shape, stack, recipe, mode) in enumerate(plan, 1):
        cell = run_cell(stack, recipe, mode, shape, args.warmup, args.steps)
        results["cells"].append(cell)
        write_json(results, args.json)
        done = f"{cell['status']}: {cell.get('error') or cell.get('reason')}"
        if cell["status"] == "ok":
            done = f"{cell['step_ms']:.3f} ms/step, first call {cell['compile_s']:.1f} s"
        print(f"[{i}/{len(plan)}] {shape} {row_label(stack, recipe)} {mode}: {done}", flush=True)
        broken = cell["status"] == "error" and cuda_context_broken()
        if broken:
            results["stopped"] = (
                f"CUDA state broken after {row_label(stack, recipe)} {mode}: {broken}"
            )
            print(f"stopping: {results['stopped']}; rerun the remaining cells in a new process")
            break  # report() below writes the JSON with the reason
    report(results, args.json, args.plots)


if __name__ == "__main__":
    main()
