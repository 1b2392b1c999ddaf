"""One rank of tests/gpu/test_amax_group_gpu.py, under torchrun on 2 or 4 GPUs: DelayedScaling
with `reduce_amax=True` and `amax_reduction_group` set to a subgroup: on 2 GPUs this rank alone
(eager TE reduces nothing across ranks), on 4 the pair {0, 1} or {2, 3} (a real reduction over
a group of two, and none between the pairs). Three runs of 3 training steps from one seed, on inputs that
differ per rank: eager TE, compiled with te.autocast inside the compiled function, and the
model compiled with te.autocast entered eagerly around it (the backward update deferred to the
exit). Writes each run's DelayedScaling state (per module: forward and backward amax history
and scale) to --out/rank<R>.pt."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as R
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS

import te_compile


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    return torch.nn.Sequential(
        te.LayerNormLinear(256, 256, params_dtype=bf16),
        te.Linear(256, 256, params_dtype=bf16),
    ).cuda()


def run(mode: str, group, rank: int) -> dict:
    FGS.reset()
    torch._dynamo.reset()
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = R.DelayedScaling(reduce_amax=True, amax_history_len=4)

    def traced(x):
        with te.autocast(recipe=recipe, amax_reduction_group=group):
            return model(x)

    fn = {"eager": traced, "traced": torch.compile(traced, fullgraph=True)}.get(mode)
    compiled_model = torch.compile(model, fullgraph=True) if mode == "outside" else None
    for step in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + 10 * rank + step)
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        x = (x * (1 + 3 * rank)).requires_grad_(True)  # ranks' amaxes differ
        if compiled_model is not None:
            with te.autocast(recipe=recipe, amax_reduction_group=group):
                y = compiled_model(x)
        else:
            y = fn(x)
        y.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    te_compile.flush_delayed_updates()
    state = {}
    for i, m in enumerate(model):
        for side in ("scaling_fwd", "scaling_bwd"):
            meta = m.fp8_meta[side]
            state[f"{i}.{side}.history"] = meta.amax_history.detach().cpu().clone()
            state[f"{i}.{side}.scale"] = meta.scale.detach().cpu().clone()
    return state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    te_compile.patch()
    # Every rank creates every group; each uses the one that holds it.
    world = dist.get_world_size()
    members = [[r] for r in range(world)] if world < 4 else [[0, 1], [2, 3]]
    groups = [dist.new_group(m) for m in members]
    group = next(g for g, m in zip(groups, members, strict=True) if rank in m)
    results = {mode: run(mode, group, rank) for mode in ("eager", "traced", "outside")}
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
