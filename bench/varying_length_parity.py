"""Where a compiled DelayedScaling TransformerLayer parts from eager TE over varying sequence
lengths: a diagnosis table, one GPU (session 28's open failure).

    python bench/varying_length_parity.py [--recipe delayed]
        [--orders 64,128:128,128:128,64:64,64,128]

Session 28 (H100): tests/gpu/test_transformer_layer_gpu.py::test_varying_sequence_length_
matches_eager[delayed-*] failed: one layer (attention_cases "causal": LayerNorm, GELU, biases)
over 64, 128, 96, 64 tokens, step 0 bit-identical, step 1's output 0.0078 apart; current
scaling passed, and DelayedScaling over a fixed length passes. On the CPU the second graph
reads and updates the state in the same order as the first (helper's dump, closing note).

Each row runs one compiled variant over a sequence order and compares with eager TE on the
same order: per step, whether the output and every gradient are bit-identical (the first
differing tensor and its max |diff|), and whether each module's DelayedScaling scales and
histories after the step equal eager TE's. Variants: inductor with eager's rounding (as the
test) or aot_eager (no inductor kernels); te_compile's default path (graph_fp8 None: the graph
path for these small GEMMs) or TE's kernels (graph_fp8=False). Reading it: a state that
differs after step 0 is an update's fault; equal state and a differing step-1 output with
aot_eager equal points at an inductor kernel's arithmetic on that data; a fixed order
(128,128) failing says the length change is not needed.
`inductor-static` turns off automatic dynamic shapes (each length a static graph, as step 0's):
matching there puts the cause in the dynamic-shape code. Eager TE's own bias-dropout-add is a
torch.compile'd function that recompiles for the new length too: run once more with
NVTE_BIAS_DROPOUT_FUSION=0 in the environment to take it out of both sides.

Session 29 (H200): the graph path alone parted (aot_eager too, TE's kernels not), `--modules`
put it in self_attention.layernorm_qkv's output, and bench/norm_cast_probe.py found the value
(graph_fp8/norm.py's multiply-add rounded twice); after the fix every variant is bit-identical.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch._inductor import config as inductor_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import attention_cases as cases  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch import quantization as q  # noqa: E402

import te_compile  # noqa: E402

RECIPES = {"delayed": R.DelayedScaling, "current": R.Float8CurrentScaling}


def state_of(layer) -> dict:
    """Every TE GEMM module's DelayedScaling tensors, by module and direction."""
    out = {}
    for name, m in layer.named_modules():
        meta = getattr(m, "fp8_meta", None) or {}
        for d in ("scaling_fwd", "scaling_bwd"):
            if d in meta and hasattr(meta[d], "scale"):
                out[f"{name}.{d}.scale"] = meta[d].scale.clone()
                out[f"{name}.{d}.amax_history"] = meta[d].amax_history.clone()
    return out


CAPTURED: list = []  # ("module[output index]", tensor) of the running step, with --modules


def capture_outputs(layer) -> None:
    """Forward hooks appending each TE submodule's tensor outputs to CAPTURED (dynamo traces
    them and replays the appends after the graph)."""
    for name, m in layer.named_modules():
        if name and type(m).__module__.startswith("transformer_engine"):

            def hook(mod, args, out, name=name):
                outs = out if isinstance(out, (tuple, list)) else (out,)
                for i, o in enumerate(outs):
                    if isinstance(o, torch.Tensor):
                        CAPTURED.append((f"{name}[{i}]", o.detach().clone()))

            m.register_forward_hook(hook)


def run(
    recipe: str,
    seqs: tuple,
    backend: str | None,
    graph_fp8: bool | None = None,
    modules: bool = False,
) -> list:
    """Per step ({out, dgrad, grads}, state after the step); backend None: eager TE.
    `graph_fp8`: te_compile's option (None, the default: the graph path for small GEMMs)."""
    torch._dynamo.reset()
    q.FP8GlobalStateManager.reset()
    cases.reset_backend_choice()
    default = te_compile.configure().graph_fp8
    te_compile.configure(graph_fp8=graph_fp8)
    layer = cases.fresh_layer(cases.LAYER_CASES["causal"])
    rec = RECIPES[recipe]()
    if modules:
        capture_outputs(layer)

    def fn(x):
        with te.autocast(recipe=rec):
            return layer(x)

    if backend is not None:
        fn = torch.compile(fn, fullgraph=True, backend=backend.removesuffix("-static"))
    # "-static": no automatic dynamic shapes, so each length's graph is static like step 0's
    static = backend is not None and backend.endswith("-static")
    with torch._dynamo.config.patch(automatic_dynamic_shapes=not static):
        steps = _steps(fn, layer, seqs)
    te_compile.configure(graph_fp8=default)
    return steps


def _steps(fn, layer, seqs) -> list:
    states = []

    def after_step(m):
        states.append(state_of(m) | {f"fwd {k}": v for k, v in CAPTURED})
        CAPTURED.clear()

    CAPTURED.clear()
    records = cases.varying_length_records(fn, layer, seqs, after_step=after_step)
    return list(zip(records, states, strict=True))


def tensors_apart(got: dict, want: dict) -> str:
    """The first six tensors of `want` that `got` holds unequal, with their max |diff|."""
    # eager TE also sets up DotProductAttention's state, which no compiled module reads
    apart = [
        f"{key} {(got[key].float() - w.float()).abs().max().item():.3g}"
        for key, w in want.items()
        if key in got and not torch.equal(got[key], w)
    ]
    return ", ".join(apart[:6]) or "="


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="delayed", choices=sorted(RECIPES))
    parser.add_argument("--orders", default="64,128:128,128:128,64:64,64,128")
    parser.add_argument(
        "--modules",
        action="store_true",
        help="also compare each TE submodule's forward outputs (in the state column, in order)",
    )
    args = parser.parse_args()
    te_compile.patch()
    orders = [tuple(int(s) for s in o.split(",")) for o in args.orders.split(":")]
    variants = [
        ("inductor", None),
        ("inductor-static", None),
        ("inductor", False),
        ("aot_eager", None),
    ]
    if args.modules:
        variants = [("aot_eager", None), ("inductor", None)]
    print("| order | backend | graph_fp8 | per step: first tensor apart / state |")
    print("|---|---|---|---|")
    with inductor_config.patch({"emulate_precision_casts": True}):
        for seqs in orders:
            want = run(args.recipe, seqs, None, modules=args.modules)
            for backend, path in variants:
                got = run(args.recipe, seqs, backend, path, args.modules)
                cells = [
                    f"{tensors_apart(g_t, w_t)} / {tensors_apart(g_s, w_s)}"
                    for (g_t, g_s), (w_t, w_s) in zip(got, want, strict=True)
                ]
                print(f"| {seqs} | {backend} | {path} | {' ; '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
