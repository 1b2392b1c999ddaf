"""A Megatron-style MLP stack and a te.TransformerLayer stack trained tensor-parallel on 2
GPUs, eagerly with TE and compiled with te_compile, from the same weights and batches. Launch
with torchrun:

    torchrun --nproc-per-node 2 examples/tensor_parallel.py [--steps 50] [--out DIR] \
        [--cases none/tp,current/sp,layer:delayed/sp,...] [--backend nccl|gloo]

With fewer GPUs than ranks, ranks share GPUs; NCCL refuses two ranks on one GPU, so pass
`--backend gloo` there (gloo's collectives on CUDA tensors: slower, and for 2 ranks the same
sums; eager and compiled runs use the same backend either way).

Each block is x + fc2(relu(fc1(ln(x)))): te.LayerNorm, fc1 a column-parallel te.Linear
(4H / tp outputs per rank, with bias), fc2 a row-parallel te.Linear without bias, tp_group =
all ranks. (A row-parallel bias is added after the reduction in plain torch, as TE adds it;
its gradient, a sum over tokens, is then inductor's reduction in the compiled step and ATen's
in eager, summed in another order: with it, the runs would differ by that, not by TE's.)
"layer:" cases train te.TransformerLayer blocks instead (set_parallel_mode: QKV and FC1
column-, proj and FC2 row-parallel; causal, 64-wide heads, no bias for the same reason).

A case is [layer:]RECIPE/MODE: RECIPE one of none (bf16), current, delayed (DelayedScaling
with its amax reduced over the group, TE's default), block; MODE "tp" (the input replicated,
the row-parallel outputs all-reduced) or "sp" (sequence parallel: each rank holds a slice of
the sequence, the column-parallel GEMMs all-gather it, the row-parallel ones reduce-scatter). The model is compiled whole (fullgraph, inductor), the
loss is computed outside it. The non-TE math (ReLU, residual add) is exact in any
implementation, so compiled and eager steps can be compared bit for bit. Under sequence
parallelism the gradients of the replicated parameters (those TE marks `sequence_parallel`)
are summed over the group, as Megatron does.

Per case, rank 0 prints and `tensor-parallel.json` records: the losses of every step (rank 0's
shard), whether every step's loss and every final parameter are bit-identical between eager and
compiled on every rank, DelayedScaling's amax histories (equal to eager, equal across ranks),
graphs (1: no recompile) and breaks, median step time and peak memory, eager and compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import transformer_engine
import transformer_engine.pytorch as te
from torch._dynamo.utils import counters
from transformer_engine.common import recipe as R
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS

import te_compile

H, FFN, SEQ, BATCH, LAYERS, LR = 1024, 4096, 1024, 2, 3, 1e-3
RECIPES = {
    "none": lambda: None,
    "current": R.Float8CurrentScaling,
    "delayed": lambda: R.DelayedScaling(reduce_amax=True),
    "block": R.Float8BlockScaling,
}
DEFAULT_CASES = ",".join(
    f"{k}{r}/{m}" for k in ("", "layer:") for r in RECIPES for m in ("tp", "sp")
)


class Block(torch.nn.Module):
    def __init__(self, group, sp: bool):
        super().__init__()
        world = dist.get_world_size(group)
        kw = dict(params_dtype=torch.bfloat16, tp_group=group, tp_size=world)
        kw.update(sequence_parallel=sp)
        self.ln = te.LayerNorm(H, params_dtype=torch.bfloat16, sequence_parallel=sp)
        self.fc1 = te.Linear(H, FFN, parallel_mode="column", **kw)
        self.fc2 = te.Linear(FFN, H, parallel_mode="row", bias=False, **kw)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


def transformer_layer(group, sp: bool):
    """te.TransformerLayer with TE's tensor parallelism (QKV LayerNormLinear and FC1 column-,
    proj and FC2 row-parallel), causal, no bias (see the module docstring), no dropout."""
    world = dist.get_world_size(group)
    return te.TransformerLayer(
        H,
        FFN,
        H // 64,
        bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type="causal",
        params_dtype=torch.bfloat16,
        tp_group=group,
        tp_size=world,
        set_parallel_mode=True,
        sequence_parallel=sp,
    )


class Model(torch.nn.Module):
    def __init__(self, group, sp: bool, recipe, kind: str = "mlp"):
        super().__init__()
        make = transformer_layer if kind == "layer" else Block
        self.blocks = torch.nn.ModuleList(make(group, sp) for _ in range(LAYERS))
        self.group, self.recipe = group, recipe

    def forward(self, x):
        with te.autocast(
            enabled=self.recipe is not None, recipe=self.recipe, amax_reduction_group=self.group
        ):
            for block in self.blocks:
                x = block(x)
        return x


def batches(steps: int, sp: bool, rank: int, world: int):
    """The same sequences on every rank (tensor parallelism); under sequence parallelism each
    rank takes its slice of the sequence dimension."""
    g = torch.Generator(device="cuda").manual_seed(7)
    out = []
    for _ in range(steps):
        x = torch.randn(SEQ, BATCH, H, device="cuda", dtype=torch.bfloat16, generator=g)
        target = 0.5 * torch.randn(SEQ, BATCH, H, device="cuda", generator=g)
        if sp:
            rows = SEQ // world
            x, target = x[rank * rows : (rank + 1) * rows], target[rank * rows : (rank + 1) * rows]
        out.append((x.contiguous(), target.contiguous()))
    return out


GEMM_MODULES = (te.Linear, te.LayerNormLinear, te.LayerNormMLP)


def delayed_histories(model) -> list[torch.Tensor]:
    """The GEMM modules' (DotProductAttention quantizes nothing without fp8_dpa: eager TE
    creates its FP8 state anyway, the compiled path does not)."""
    return [
        m.fp8_meta[k].amax_history.clone()
        for m in model.modules()
        if isinstance(m, GEMM_MODULES)
        for k in ("scaling_fwd", "scaling_bwd")
        if hasattr(m.fp8_meta.get(k), "amax_history")
    ]


def train(model, data, group, sp: bool, compiled: bool) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    run = torch.compile(model, fullgraph=True) if compiled else model
    losses, times = [], []
    torch.cuda.reset_peak_memory_stats()
    for x, target in data:
        torch.cuda.synchronize()
        start = time.perf_counter()
        x = x.detach().requires_grad_()  # an input that requires grad: dgrad runs too
        loss = torch.nn.functional.mse_loss(run(x).float(), target)
        loss.backward()
        if sp:  # replicated parameters see only their shard's gradient
            for p in model.parameters():
                if getattr(p, "sequence_parallel", False) and p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses).tolist(),
        "median_ms": 1e3 * statistics.median(times[2:]),
        "first_step_s": times[0],
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "params": [p.detach().clone() for p in model.parameters()],
        "histories": delayed_histories(model),
    }


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def run_case(case: str, steps: int, group) -> dict:
    kind, _, rest = case.rpartition(":")
    recipe_name, mode = rest.split("/")
    sp = mode == "sp"
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(steps, sp, rank, world)
    runs, initial = {}, None
    for compiled in (False, True):
        torch.compiler.reset()
        counters.clear()
        FGS.reset()
        torch.manual_seed(1234 + rank)  # each rank its own shards of the weights
        model = Model(group, sp, RECIPES[recipe_name](), kind or "mlp").cuda()
        if initial is None:
            initial = {
                k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()
            }
        else:  # the eager run's initial weights
            model.load_state_dict(initial)
        runs[compiled] = train(model, data, group, sp, compiled)
        runs[compiled]["graphs"] = counters["stats"]["unique_graphs"]
        runs[compiled]["breaks"] = sum(counters["graph_break"].values())
    eager, comp = runs[False], runs[True]
    local = {
        "losses_equal": eager["losses"] == comp["losses"],
        "params_equal": same(eager["params"], comp["params"]),
        "histories_equal": same(eager["histories"], comp["histories"]),
    }
    flags = torch.tensor([float(v) for v in local.values()], device="cuda")
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank
    across = True
    for h in comp["histories"]:
        other = h.clone()
        dist.broadcast(other, src=0)
        across = across and torch.equal(h, other)
    across_t = torch.tensor([float(across)], device="cuda")
    dist.all_reduce(across_t, op=dist.ReduceOp.MIN)
    diff = max(abs(a - b) for a, b in zip(eager["losses"], comp["losses"], strict=True))
    out = {k: bool(v) for k, v in zip(local, flags.tolist(), strict=True)}
    out.update(histories_equal_across_ranks=bool(across_t.item()), max_diff=diff)
    out["n_histories"] = len(comp["histories"])
    for name, r in (("eager", eager), ("compiled", comp)):
        out[name] = {k: r[k] for k in ("losses", "median_ms", "first_step_s", "peak_mib")}
    out["compiled"].update({k: comp[k] for k in ("graphs", "breaks")})  # 1 graph: no recompile
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--cases", default=DEFAULT_CASES, help="RECIPE/MODE,...")
    p.add_argument("--backend", default="nccl")
    args = p.parse_args()
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # attention: bit-exact runs
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    te_compile.patch()
    group = dist.new_group(list(range(dist.get_world_size())))
    results = {"device": torch.cuda.get_device_name(), "world": dist.get_world_size()}
    results.update(torch=torch.__version__, te=transformer_engine.__version__, steps=args.steps)
    results.update(backend=args.backend, gpus=torch.cuda.device_count())
    failed = False
    for case in args.cases.split(","):
        try:
            r = results[case] = run_case(case, args.steps, group)
            if rank == 0:
                e, c = r["eager"], r["compiled"]
                print(
                    f"{case:12s} loss {e['losses'][0]:.4f}->{e['losses'][-1]:.4f} "
                    f"bit-identical losses {r['losses_equal']} params {r['params_equal']} "
                    f"histories {r['histories_equal']}/{r['histories_equal_across_ranks']} "
                    f"max|diff| {r['max_diff']:.2e} graphs {c['graphs']} breaks {c['breaks']} "
                    f"ms {e['median_ms']:.2f}/{c['median_ms']:.2f} "
                    f"MiB {e['peak_mib']:.0f}/{c['peak_mib']:.0f}",
                    flush=True,
                )
        except Exception as exc:  # noqa: BLE001 (reported, the other cases go on)
            failed = True
            results[case] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            if rank == 0:
                print(f"{case:12s} ERROR {results[case]['error'][:600]}", flush=True)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "tensor-parallel.json"), "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
