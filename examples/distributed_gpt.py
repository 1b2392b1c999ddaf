"""The GPT of examples/models.py trained data-parallel on several GPUs, compiled and eagerly,
with TE FP8: DDP and FSDP2, DelayedScaling (amax reduced over the data-parallel group) and
Float8CurrentScaling (`delayed_local`: DelayedScaling without the reduction). Launch with torchrun:

    torchrun --nproc-per-node 2 examples/distributed_gpt.py [--steps 50] [--out DIR]

Per case (wrapper x recipe x compile), every rank trains from the same initial weights on its
own batches; rank 0 prints the mean loss over ranks of the last step, the largest loss
difference between compiled and eager over all steps, the median step time and the first
step's seconds, and writes `distributed-gpt.json` (and a PNG of the curves) under --out. For
FSDP2 with DelayedScaling, after a `ddp/` case of the same recipe, it also prints the compiled
run against eager DDP: eager TE's FSDP2 backward quantizes the weight for dgrad differently
(docs/distributed.md), and compiled code keeps TE's arithmetic without FSDP2.

- ddp: `DistributedDataParallel` around a module whose forward is the training step (forward +
  loss, te.autocast inside), that module compiled with fullgraph=True.
- ddp-outside: the same, with the model alone compiled (fullgraph) and te.autocast entered
  eagerly around it (DelayedScaling's backward update deferred to the autocast's exit).
- fsdp2: `fully_shard` on each TransformerLayer, then on the model; compiled per block
  (`torch.compile(layer, fullgraph=True)` on each TransformerLayer, te.autocast around the
  model call, as torchtitan compiles), the regional compilation FSDP2 is used with.
- fsdp2-whole: the same sharding, the whole model compiled as one `torch.compile(gpt)`
  (`te.autocast` around it). Not fullgraph: FSDP2 runs its hooks outside dynamo's graph by
  design (`torch._dynamo.disable`), so the model's graph breaks at each of them and dynamo
  compiles the code between; a fullgraph compile of the model fails there (docs/distributed.md).
- fsdp2-fp8: as fsdp2 (per block), with FP8 primary weights: the TransformerLayers are built
  under `te.quantized_model_init(enabled=True, recipe=...)` on the meta device, sharded, then
  materialized shard by shard by TE's `reset_parameters()` (TE's FSDP2 recipe: the local shards
  become TE QuantizedTensors and FSDP2 all-gathers their FP8 bytes through TE's
  `fsdp_pre_all_gather`/`fsdp_post_all_gather`); TE's FusedAdam with FP32 master weights, seeded
  from the high-precision values the FP8 weights were made from. The JSON's `fp8_allgather`
  (per run, eager and compiled) records what was all-gathered (see `watch_fp8_all_gathers`).

`--resume`: DelayedScaling, compiled, under DDP and under FSDP2 (per block): a checkpoint
(torch.distributed.checkpoint: the model with TE's fp8_meta in its extra state, sharded under
FSDP2, and AdamW) saved at step 5 of 10 and loaded into a fresh compiled model: the resumed
steps' losses and the final DelayedScaling state compared with the uninterrupted run's.

Then, for DelayedScaling with amax reduction, a stack of TE GEMM modules alone
(te.LayerNormMLP + te.Linear, whose compiled graph has no op of its own between TE's kernels)
under DDP: after every step the amax histories and scales of every module are checked to be
identical across ranks and identical to eager TE's (rank r's inputs are scaled by 1 + r, so
equal states across ranks come from the reduction).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformer_engine.pytorch as te
from torch.distributed.checkpoint.api import CheckpointException
from transformer_engine.common import recipe as R
from transformer_engine.pytorch.quantization import FP8GlobalStateManager as FGS

import te_compile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models as M  # noqa: E402

BATCH, SEQ, LR = 4, 128, 3e-3
RECIPES = {
    "delayed": lambda: R.DelayedScaling(reduce_amax=True),
    "delayed_local": lambda: R.DelayedScaling(reduce_amax=False),  # each rank's own amaxes
    "current": lambda: R.Float8CurrentScaling(),
    "block": lambda: R.Float8BlockScaling(),
}
DEFAULT_CASES = "ddp/delayed,ddp/current,ddp/block,fsdp2/delayed,fsdp2/current,fsdp2/block"
FP8_WRAPPER = "fsdp2-fp8"  # FSDP2 per block with FP8 primary weights (quantized_model_init)
SHARD_SEED = 1000  # + rank: the RNG that initialises each rank's shard of the FP8 weights


class LossStep(torch.nn.Module):
    """Forward and loss under te.autocast: the module DDP wraps, compiled with fullgraph=True
    (DDP's own forward, a logger call included, is not traceable)."""

    def __init__(self, model, recipe):
        super().__init__()
        self.model, self.recipe = model, recipe

    def forward(self, tokens, targets):
        with te.autocast(recipe=self.recipe, amax_reduction_group=None):
            logits = self.model(tokens)
        return M.lm_loss(logits, targets)


def build(wrapper: str, recipe, compiled: bool):
    """The training step's module, wrapped and compiled as `wrapper` wants it."""
    if wrapper == FP8_WRAPPER:
        return build_fp8(recipe, compiled)
    gpt = M.GPT(M.GPTConfig(max_seq_len=SEQ))
    if wrapper in ("ddp", "ddp-outside"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        step = LossStep(gpt, recipe)
        if compiled and wrapper == "ddp-outside":  # the model alone; te.autocast eager around it
            gpt.compile(fullgraph=True)
        elif compiled:  # DDP's own forward does not trace (fullgraph); compile what it wraps
            step.compile(fullgraph=True)
        return gpt, DDP(step, device_ids=[torch.cuda.current_device()])
    from torch.distributed.fsdp import fully_shard

    for layer in gpt.layers:
        fully_shard(layer)
        if compiled and wrapper == "fsdp2":  # per block
            layer.compile(fullgraph=True)
    fully_shard(gpt)
    if compiled and wrapper == "fsdp2-whole":  # the whole model; breaks at FSDP2's hooks
        gpt.compile()
    return gpt, LossStep(gpt, recipe)


def train(wrapper: str, recipe_name: str, compiled: bool, data):
    torch._dynamo.reset()
    FGS.reset()
    torch.manual_seed(0)
    gpt, step = build(wrapper, RECIPES[recipe_name](), compiled)
    watched = None
    if wrapper == FP8_WRAPPER:
        opt = fp8_optimizer(gpt)
        watched = watch_fp8_all_gathers(gpt)
    else:
        opt = torch.optim.AdamW(gpt.parameters(), lr=LR)
    losses, times = M.timed_steps(step, opt, data)
    mean = torch.stack(losses).float()
    dist.all_reduce(mean)  # the mean loss over ranks, per step
    result = {
        "losses": (mean / dist.get_world_size()).tolist(),
        "median_ms": 1e3 * statistics.median(times[1:]),
        "first_step_s": times[0],
    }
    if watched is not None:
        result["fp8_allgather"] = fp8_all_gather_report(gpt, watched, len(data))
    return result


# ---- FSDP2 with FP8 primary weights (te.quantized_model_init) -----------------------------------


def build_fp8(recipe, compiled: bool):
    """The GPT of `build`, its TransformerLayers holding FP8 primary weights, sharded with FSDP2
    and compiled per block as the fsdp2 wrapper does. TE's way (its quantized_model_init FSDP2
    example and tests): build the layers on the meta device under quantized_model_init, shard,
    then let each TE module's reset_parameters() initialise and quantize the local shard (FSDP2
    then gathers the QuantizedTensor shards through TE's fsdp_pre/post_all_gather; TE's
    block-scaled tensors are gathered that way only when made like this).
    `fuse_qkv_params=True`: TE refuses split QKV weights in FP8. Each rank initialises its shard
    from its own seed (SHARD_SEED + rank, in a forked RNG); the same in the eager and the compiled
    run, so both start from the same weights."""
    import dataclasses

    from torch.distributed.fsdp import fully_shard
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    c = M.GPTConfig(max_seq_len=SEQ)
    # Embeddings and final norm as in build() (same RNG draws); the layers are made below.
    gpt = M.GPT(dataclasses.replace(c, num_layers=0))
    gpt.config = c
    with te.quantized_model_init(
        enabled=True, recipe=recipe, preserve_high_precision_init_val=True
    ):
        gpt.layers = torch.nn.ModuleList(
            M.gpt_layer(c, i, fuse_qkv_params=True, device="meta") for i in range(c.num_layers)
        )
    for layer in gpt.layers:
        fully_shard(layer)
    fully_shard(gpt)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.manual_seed(SHARD_SEED + dist.get_rank())
        for module in gpt.layers.modules():
            if isinstance(module, TransformerEngineBaseModule):
                module.reset_parameters()
    if compiled:  # per block
        for layer in gpt.layers:
            layer.compile(fullgraph=True)
    return gpt, LossStep(gpt, recipe)


def fp8_optimizer(gpt):
    """TE's FusedAdam with FP32 master weights (TE's optimizer for FP8 primary weights; it
    re-quantizes the FP8 shards after each step), its master weights seeded from the
    high-precision values the FP8 weights were made from (TE's FSDP2 example).
    weight_decay=0.01: torch's AdamW default, which the other cases use."""
    from torch.distributed.tensor import DTensor

    opt = te.optimizers.FusedAdam(
        gpt.parameters(),
        lr=LR,
        weight_decay=0.01,
        master_weights=True,
        master_weight_dtype=torch.float32,
    )
    for param in gpt.parameters():
        opt.initialize_state(param, store_param_remainders=False)
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, te.QuantizedTensor):
            high = local.get_high_precision_init_val()
            opt.set_scaled_state(param, "master_param", high.to("cuda", torch.float32))
            local.clear_high_precision_init_val()
    return opt


def watch_fp8_all_gathers(model) -> dict:
    """Counts what FSDP2 all-gathers for each FP8 parameter: the parameter's local shard (a TE
    QuantizedTensor) gets an `fsdp_pre_all_gather` of its own, an instance attribute that FSDP2
    calls in place of the class's (FSDP2 re-reads a shard's extension at its lazy init for such
    patches). It calls TE's and records the dtype and bytes of every tensor TE hands FSDP2 to
    all-gather, and the bytes the same shard would send in its nominal dtype (bf16)."""
    from torch.distributed.tensor import DTensor

    stats = {
        "fp8_params": [],
        "pre_all_gather_calls": 0,
        "input_bytes": {},  # dtype -> bytes this rank contributed to the all-gathers
        "param_dtype_bytes": 0,  # what the same shards would contribute in their nominal dtype
    }
    for name, param in model.named_parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        if isinstance(local, te.QuantizedTensor):
            stats["fp8_params"].append(name)
            local.fsdp_pre_all_gather = _counting_pre_all_gather(local, stats)
    return stats


def _counting_pre_all_gather(local, stats: dict):
    te_pre_all_gather = local.fsdp_pre_all_gather  # TE's, bound to this shard
    nominal_bytes = local.numel() * local.dtype.itemsize

    # FSDP2 checks the signature: these five parameters.
    def fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, metadata = te_pre_all_gather(
            mesh, orig_size, contiguous_orig_stride, module, mp_policy
        )
        stats["pre_all_gather_calls"] += 1
        stats["param_dtype_bytes"] += nominal_bytes
        by_dtype = stats["input_bytes"]
        for t in inputs:
            key = str(t.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + t.numel() * t.element_size()
        return inputs, metadata

    return fsdp_pre_all_gather


def fp8_all_gather_report(model, stats: dict, steps: int) -> dict:
    """`stats` (watch_fp8_all_gathers) and what FSDP2 holds after training: the types of the
    sharded parameters' local tensors, and (FSDP2's own objects, private API) the types of the
    unsharded parameters it handed the modules and the dtypes of its all-gather output buffers
    (counts over all parameters, FP8 or not)."""
    from collections import Counter

    from torch.distributed.tensor import DTensor

    sharded = Counter()
    for param in model.parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        sharded[type(local).__name__] += 1
    report = {**stats, "steps": steps, "sharded_types": dict(sharded)}
    try:
        unsharded, outputs = Counter(), Counter()
        for module in model.modules():
            if not hasattr(module, "_get_fsdp_state"):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                param = getattr(fsdp_param, "_unsharded_param", None)
                unsharded[type(param).__name__ if param is not None else "none"] += 1
                for t in fsdp_param.all_gather_outputs:
                    outputs[str(t.dtype).removeprefix("torch.")] += 1
        report["unsharded_types"] = dict(unsharded)
        report["all_gather_output_dtypes"] = dict(outputs)
    except Exception as exc:  # noqa: BLE001 (FSDP2's private objects: reported, not fatal)
        report["fsdp2_state_error"] = f"{type(exc).__name__}: {exc}"
    return report


# ---- DelayedScaling state: across ranks and against eager TE ------------------------------------


def gemm_stack():
    torch.manual_seed(0)
    h = 256
    return torch.nn.Sequential(
        te.LayerNormMLP(h, 4 * h, params_dtype=torch.bfloat16, device="cuda"),
        te.Linear(h, h, params_dtype=torch.bfloat16, device="cuda"),
    )


def fp8_state(model) -> dict[str, torch.Tensor]:
    """Every TE module's DelayedScaling histories and scales, by "module direction.tensor"."""
    out = {}
    for name, m in model.named_modules():
        meta = getattr(m, "fp8_meta", None)
        if meta and "scaling_fwd" in meta:
            for k in ("scaling_fwd", "scaling_bwd"):
                for t in ("amax_history", "scale"):
                    out[f"{name} {k}.{t}"] = getattr(meta[k], t).clone()
    return out


def max_diff(a: list, b: list) -> float:
    """The largest |a[i] - b[i]| of two loss curves of one length."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def state_run(compiled: bool, steps: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    FGS.reset()
    recipe = R.DelayedScaling(reduce_amax=True, amax_history_len=8)

    class Fwd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = gemm_stack()

        def forward(self, x, target):
            with te.autocast(recipe=recipe):
                out = self.stack(x)
            return (out.float() * target).sum()

    inner = Fwd()
    if compiled:
        inner.compile(fullgraph=True)
    model = fwd = DDP(inner, device_ids=[torch.cuda.current_device()])
    states = []
    g = torch.Generator(device="cpu").manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(256, 256, generator=g).to("cuda", torch.bfloat16) * (1 + dist.get_rank())
        target = torch.randn(256, 256, generator=g).to("cuda")
        fwd(x, target).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
        states.append(fp8_state(model.module.stack))
    return states


def check_state(steps: int) -> dict:
    eager = state_run(False, steps)
    compiled = state_run(True, steps)
    report = {"steps": steps, "equal_to_eager": True, "equal_across_ranks": True}
    for step, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        assert c.keys() == e.keys()
        if not all(torch.equal(c[name], e[name]) for name in c):
            report["equal_to_eager"] = False
            report.setdefault("first_mismatch", step)
        flat = torch.cat([t.flatten().float() for t in c.values()])
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flat)
        if not all(torch.equal(gathered[0], t) for t in gathered[1:]):
            report["equal_across_ranks"] = False
    # The ranks' inputs differ (rank r's are scaled by 1 + r): equal states across ranks show
    # the reduction.
    return report


def _extra_states_as_bytes(model_sd: dict, placeholder: bool = False) -> dict:
    """TE keeps a module's FP8 metadata (DelayedScaling amax history and scale) in its
    `_extra_state`: a uint8 tensor of pickled bytes whose length varies with what it holds
    (and is 0 before the first FP8 forward). DCP loads tensors in place at their saved size,
    so that tensor cannot round-trip; as a bytes object DCP saves it whole and loads it back
    whole. `placeholder`: the load side (any non-tensor value marks the entry as bytes)."""
    for key, value in model_sd.items():
        if key.endswith("_extra_state") and isinstance(value, torch.Tensor):
            model_sd[key] = b"" if placeholder else value.cpu().numpy().tobytes()
    return model_sd


def _extra_states_as_tensors(model_sd: dict) -> dict:
    for key, value in model_sd.items():
        if key.endswith("_extra_state") and isinstance(value, bytes):
            model_sd[key] = torch.tensor(list(value), dtype=torch.uint8)
    return model_sd


def resume_run(data, folder: str, resume: bool, at: int, wrapper: str = "ddp"):
    """Compiled `wrapper` + DelayedScaling over `data`: uninterrupted (saving a checkpoint after
    step `at`), or resumed from that checkpoint before its first step. Returns (losses of steps
    at.., final fp8 state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch._dynamo.reset()
    FGS.reset()
    torch.manual_seed(0)
    gpt, step = build(wrapper, RECIPES["delayed"](), True)
    opt = torch.optim.AdamW(gpt.parameters(), lr=LR)
    if resume:
        # AdamW's state must exist to be loaded into: get_state_dict initialises it.
        model_sd, optim_sd = get_state_dict(gpt, opt)
        state = {"model": _extra_states_as_bytes(model_sd, placeholder=True), "optim": optim_sd}
        dcp.load(state, checkpoint_id=folder)
        model_sd = _extra_states_as_tensors(state["model"])
        set_state_dict(gpt, opt, model_state_dict=model_sd, optim_state_dict=state["optim"])
    losses = []
    for i, (tokens, targets) in enumerate(data):
        if resume and i < at:
            continue
        loss = step(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= at:
            losses.append(loss.item())
        if not resume and i + 1 == at:
            # Compiled modules leave DelayedScaling's backward update (an amax reduction over
            # ranks here) to the next autocast exit: apply it on every rank before saving, or
            # the checkpoint holds unreduced amaxes (DCP keeps rank 0's extra state).
            te_compile.flush_delayed_updates()
            model_sd, optim_sd = get_state_dict(gpt, opt)
            state = {"model": _extra_states_as_bytes(model_sd), "optim": optim_sd}
            dcp.save(state, checkpoint_id=folder)
    return losses, fp8_state(gpt)


def check_resume(data, at: int = 5) -> dict:
    """Per wrapper (DDP, FSDP2 per-block: its state dict is sharded), the resumed run against
    the uninterrupted one."""
    import tempfile

    report = {}
    for wrapper in ("ddp", "fsdp2"):
        folder = os.path.join(tempfile.gettempdir(), f"te-compile-distributed-gpt-{wrapper}")
        full, full_state = resume_run(data, folder, False, at, wrapper)
        dist.barrier()
        resumed, resumed_state = resume_run(data, folder, True, at, wrapper)
        report[wrapper] = {
            "losses_full": full,
            "losses_resumed": resumed,
            "losses_equal": full == resumed,
            "max_loss_diff": max_diff(full, resumed),
        }
        assert full_state.keys() == resumed_state.keys()
        differing = []
        for name, a in full_state.items():
            b = resumed_state[name]
            if not torch.equal(a, b):
                rows = sorted({int(i) for i in torch.nonzero(a != b)[:, 0].tolist()})[:8]
                diff = (a.float() - b.float()).abs().max().item()
                differing.append(f"{name}: max |diff| {diff:.4g}, rows {rows}")
        report[wrapper]["fp8_state_equal"] = not differing
        if differing:
            report[wrapper]["state_differences"] = differing[:6]
    return report


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("OUT") or ".")
    p.add_argument("--cases", default=DEFAULT_CASES, help="WRAPPER/RECIPE,...")
    p.add_argument("--resume", action="store_true", help="the checkpoint resume check")
    p.add_argument("--no-state", action="store_true", help="skip the DelayedScaling state check")
    p.add_argument("--backend", default="nccl", help="gloo: ranks sharing one GPU (NCCL refuses)")
    args = p.parse_args()
    if args.resume:  # bit-exact resume needs TE's deterministic attention backward
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        # TE loads DelayedScaling metadata (a pickle in its extra state) only when allowed:
        # the checkpoint here is the one this run wrote.
        os.environ.setdefault("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    te_compile.patch()
    data = M.synthetic_batches(256, BATCH, SEQ, args.steps, seed=1 + rank)
    results = {"device": torch.cuda.get_device_name(), "world": dist.get_world_size()}
    results["torch"] = torch.__version__

    def save(results: dict) -> None:  # after every case: a run cut short keeps what it has
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "distributed-gpt.json"), "w") as f:
                json.dump(results, f, indent=1)

    for case in args.cases.split(",") if args.cases else []:
        wrapper, recipe_name = case.split("/")
        runs = {}
        try:
            for c in (False, True):
                runs[c] = train(wrapper, recipe_name, c, data)
            diff = max_diff(runs[True]["losses"], runs[False]["losses"])
            results[case] = {"eager": runs[False], "compiled": runs[True], "max_diff": diff}
            # Eager TE under FSDP2 re-quantizes the weight for dgrad in backward with the scale
            # the autocast exit has updated (its module/linear.py, `is_fsdp2`); compiled code
            # keeps TE's arithmetic without FSDP2, so DelayedScaling's reference is eager DDP.
            ddp = results.get(f"ddp/{recipe_name}")
            if wrapper in ("fsdp2", "fsdp2-whole") and recipe_name.startswith("delayed") and ddp:
                results[case]["max_diff_vs_ddp_eager"] = max_diff(
                    runs[True]["losses"], ddp["eager"]["losses"]
                )
            if rank == 0:
                e, c = runs[False], runs[True]
                print(
                    f"{case:16s} loss eager {e['losses'][-1]:.4f} compiled "
                    f"{c['losses'][-1]:.4f} max|diff| {diff:.4f}  ms eager "
                    f"{e['median_ms']:.2f} compiled {c['median_ms']:.2f}  first step s "
                    f"{c['first_step_s']:.1f}",
                    flush=True,
                )
                if "max_diff_vs_ddp_eager" in results[case]:
                    print(
                        f"{'':16s} compiled vs eager ddp/{recipe_name} max|diff| "
                        f"{results[case]['max_diff_vs_ddp_eager']:.4f}",
                        flush=True,
                    )
                if "fp8_allgather" in c:
                    g = c["fp8_allgather"]
                    print(
                        f"{'':16s} FP8 all-gather (compiled run, rank 0): "
                        f"{len(g['fp8_params'])} FP8 params, {g['pre_all_gather_calls']} "
                        f"pre-all-gather calls, bytes by dtype {g['input_bytes']} vs "
                        f"{g['param_dtype_bytes']} in bf16, sharded {g['sharded_types']}",
                        flush=True,
                    )
        except Exception as exc:  # noqa: BLE001 (reported, the other cases go on)
            results[case] = {"error": f"{type(exc).__name__}: {exc}"}
            if False in runs:  # the eager run finished: kept (the error is the compiled run's)
                results[case]["eager"] = runs[False]
            if rank == 0:
                print(f"{case:16s} ERROR {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        save(results)
    checks = {} if args.no_state else {"delayed_state": lambda: check_state(min(args.steps, 10))}
    if args.resume:
        checks["resume"] = lambda: check_resume(data[:10])
    for name, check in checks.items():
        try:
            results[name] = check()
        # DCP's CheckpointException is a BaseException.
        except (Exception, CheckpointException) as exc:  # noqa: BLE001
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if rank == 0:
            print(f"{name}:", str(results[name])[:1500], flush=True)
        save(results)
    if rank == 0:
        plot(results, args.out)
    dist.destroy_process_group()
    failed = any(isinstance(v, dict) and "error" in v for v in results.values())
    return 1 if failed else 0


def plot(results: dict, folder: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cases = [k for k, v in results.items() if isinstance(v, dict) and "compiled" in v]
    for i, case in enumerate(cases):
        ax.plot(results[case]["eager"]["losses"], f"C{i}--", label=f"{case}, eager TE")
        ax.plot(results[case]["compiled"]["losses"], f"C{i}", alpha=0.8, label=f"{case}, compiled")
    ax.set_xlabel("step")
    ax.set_ylabel("mean training loss over ranks")
    ax.set_title(f"GPT on {results['world']} x {results['device']}, FP8")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "distributed-gpt-loss.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
