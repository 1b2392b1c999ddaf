"""Where FSDP2 + DelayedScaling with per-block compilation parts from the same model without
FSDP2: a diagnosis table, one GPU, one process (session 32's open divergence,
docs/distributed.md "Known issue").

    python bench/fsdp2_delayed_probe.py [--steps 4] [--recipe delayed_local] [--graph-fp8 auto]

The GPT of examples/models.py (2 TransformerLayers), te.autocast entered eagerly around the
model (`M.train_step`), AdamW, the same batches. Four runs: eager and compiled per block
(`layer.compile(fullgraph=True)`), each plain and under `fully_shard` (world size 1: FSDP2's
all-gather and reduce-scatter are copies, so its runs should match the plain ones but for eager
TE's own FSDP2 branch, which re-quantizes the weight for dgrad in backward). After every step
it records the loss, every parameter's gradient (before the optimizer step) and every TE
module's DelayedScaling scales and histories, then prints, per step and pair of runs, the
first tensors that differ and by how much (`--only` picks runs). A fifth run repeats the
compiled FSDP2 one with `skip_fsdp_guards=False`: dynamo then wraps an FSDP-managed module's
tensors as it wraps a plain module's, static inputs. The graphs dynamo compiled per run are
counted (eager runs count 1 too: TE torch.compiles fused helpers itself, its `jit_fuser`).
Reading it: "compiled plain vs compiled fsdp2" should be equal. Session 32's divergence showed as gradients parting
at step 1 there and not with the guards (docs/distributed.md: AOT autograd's partitioner saved
a forward-time value of the backward scale, since fixed).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import models as M  # noqa: E402
from transformer_engine.common import recipe as R  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS  # noqa: E402

import te_compile  # noqa: E402

RECIPES = {
    "delayed_local": lambda: R.DelayedScaling(reduce_amax=False),
    "delayed": lambda: R.DelayedScaling(reduce_amax=True),
    "current": lambda: R.Float8CurrentScaling(),
}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (world size 1: the whole tensor), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def run(fsdp: bool, compiled: bool, recipe_name: str, data) -> list[dict]:
    """Per step: {name: tensor} of the loss, gradients and DelayedScaling state."""
    torch._dynamo.reset()
    FGS.reset()
    torch.manual_seed(0)
    from torch.distributed.fsdp import fully_shard

    gpt = M.GPT(M.GPTConfig(max_seq_len=data[0][0].shape[1]))
    for layer in gpt.layers:  # as examples/distributed_gpt.py: shard, compile, then the root
        if fsdp:
            fully_shard(layer)
        if compiled:
            layer.compile(fullgraph=True)
    if fsdp:
        fully_shard(gpt)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    step = M.train_step(gpt, RECIPES[recipe_name]())
    records = []
    for tokens, targets in data:
        loss = step(tokens, targets)
        loss.backward()
        rec = {"loss": loss.detach().float().reshape(1)}
        for name, p in gpt.named_parameters():
            if p.grad is not None:
                rec[f"grad {name}"] = _local(p.grad).detach().clone()
        for name, m in gpt.named_modules():
            meta = getattr(m, "fp8_meta", None)
            if not isinstance(meta, dict):
                continue
            for d in ("scaling_fwd", "scaling_bwd"):
                s = meta.get(d)
                if s is not None and hasattr(s, "amax_history"):
                    rec[f"{name} {d}.scale"] = s.scale.detach().clone()
                    rec[f"{name} {d}.amax_history"] = s.amax_history.detach().clone()
        records.append(rec)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return records


def differences(a: dict, b: dict, limit: int = 4) -> str:
    """The first `limit` tensors that differ between records `a` and `b`, in record order."""
    found = []
    for name in a:
        if name not in b:
            found.append(f"{name}: only in the first run")
            continue
        x, y = a[name].float(), b[name].float()
        if x.shape != y.shape:
            found.append(f"{name}: shapes {tuple(x.shape)} vs {tuple(y.shape)}")
        elif not torch.equal(x, y):
            diff = (x - y).abs()
            where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
            found.append(
                f"{name}: max |diff| {diff.max().item():.4g} at {where} "
                f"({x[where].item():.6g} vs {y[where].item():.6g})"
            )
        if len(found) == limit:
            break
    found += [f"{n}: only in the second run" for n in b if n not in a][: limit - len(found)]
    return "\n      ".join(found) if found else "equal"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--recipe", default="delayed_local", choices=sorted(RECIPES))
    p.add_argument("--graph-fp8", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--only", nargs="*", help="run only these variants (labels as printed)")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    te_compile.patch()
    te_compile.configure(graph_fp8={"auto": None, "on": True, "off": False}[args.graph_fp8])
    data = M.synthetic_batches(256, 4, 128, args.steps, seed=1)
    from torch._dynamo.utils import counters

    variants = {  # label: (fsdp, compiled, dynamo config)
        "eager plain": (False, False, {}),
        "eager fsdp2": (True, False, {}),
        "compiled plain": (False, True, {}),
        "compiled fsdp2": (True, True, {}),
        # dynamo skips guards on FSDP-managed modules by default: with them, does it part still?
        "fsdp2+guards": (True, True, {"skip_fsdp_guards": False}),
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only}
    runs, graphs = {}, {}
    for name, (fsdp, compiled, config) in variants.items():
        print(f"--- run: {name}", flush=True)
        before = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(config):
            runs[name] = run(fsdp, compiled, args.recipe, data)
        graphs[name] = counters["stats"]["unique_graphs"] - before
    pairs = [("compiled plain", "compiled fsdp2"), ("compiled plain", "fsdp2+guards")]
    pairs += [("eager plain", "compiled plain"), ("eager plain", "eager fsdp2")]
    pairs += [("eager fsdp2", "compiled fsdp2")]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, TE {version('transformer-engine')}, "
        f"recipe {args.recipe}, graph_fp8 {args.graph_fp8}; graphs compiled: {graphs}"
    )
    pairs = [(a, b) for a, b in pairs if a in runs and b in runs]
    for i in range(args.steps):
        print(
            f"step {i}: losses "
            + ", ".join(f"{k} {r[i]['loss'].item():.5f}" for k, r in runs.items())
        )
        for a, b in pairs:
            print(f"  {a:>14s} vs {b:<14s} {differences(runs[a][i], runs[b][i])}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
