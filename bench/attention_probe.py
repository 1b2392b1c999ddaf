"""Does PyTorch's cuDNN attention give TE's fused attention bits? A probe for issue 20's "fewer
calls into TE": TE's `fused_attn_fwd`/`fused_attn_bwd` took 110-150 us of CPU per call in a
compiled step (session 37's profile), and a source reading (session 37; torch 2.11's MHA.cpp
inferred from neighbouring versions) found no difference between the cudnn-frontend SDPA
graphs the two build for bf16, separate q/k/v in sbhd, causal or no mask, no dropout, given the
same strides and an explicit scale. Nothing in te_compile uses this yet.

    python bench/attention_probe.py [--heads 16] [--groups 16,4] [--head-dim 64,128]
                                    [--seq 128,1000,2048] [--batch 2] [--calls 200]

Per case: TE's DotProductAttention (the FusedAttention backend forced: NVTE_FLASH_ATTN=0,
NVTE_UNFUSED_ATTN=0) against `F.scaled_dot_product_attention` under
`sdpa_kernel(CUDNN_ATTENTION)` on permuted views of the same sbhd tensors, with TE's softmax
scale and causal flag. It prints, bit for bit: the output; dQ, dK and dV against TE's (and TE
against itself, run twice: its dQ may accumulate with atomics); the default CUDA generator's
offset advance per forward (TE draws 16 for its Philox state on every call, torch none without
dropout, which would move every later dropout mask); and the host microseconds per
forward+backward call of each, issued back to back. Run it with CUDNN_FRONTEND_LOG_INFO=1 and
CUDNN_FRONTEND_LOG_FILE=stdout to see which SDPA implementation and engine each picked.
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("NVTE_FLASH_ATTN", "0")
os.environ.setdefault("NVTE_UNFUSED_ATTN", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def offset_advance(fn) -> int:
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    before = gen.get_offset()
    fn()
    return gen.get_offset() - before


def make_te(heads, groups, dim, causal):
    return te.DotProductAttention(
        heads,
        dim,
        num_gqa_groups=groups,
        qkv_format="sbhd",
        attn_mask_type="causal" if causal else "no_mask",
    )


def te_step(module, q, k, v, d_out):
    """TE's output [s, b, h*d] and (dq, dk, dv) for incoming gradient d_out."""
    out = module(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out, grads


def torch_step(q, k, v, d_out, causal, scale, heads):
    """The same through aten's cuDNN attention on [b, h, s, d] views of the sbhd buffers."""
    s, b = q.shape[:2]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        views = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(
            *views, is_causal=causal, scale=scale, enable_gqa=k.shape[2] != heads
        )
        grad_view = d_out.view(s, b, heads, -1).permute(1, 2, 0, 3)
        grads = torch.autograd.grad(out, (q, k, v), grad_view)
    return out.permute(2, 0, 1, 3).reshape(s, b, -1), grads


def host_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def case(args, heads, groups, dim, seq, causal) -> str:
    torch.manual_seed(0)
    shape = (seq, args.batch)
    q = torch.randn(*shape, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(*shape, groups, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    d_out = torch.randn(*shape, heads * dim, device="cuda", dtype=torch.bfloat16)
    module = make_te(heads, groups, dim, causal)
    scale = 1.0 / math.sqrt(dim)  # TE's default softmax scale
    te_out, te_grads = te_step(module, q, k, v, d_out)
    _, te_again = te_step(module, q, k, v, d_out)
    t_out, t_grads = torch_step(q, k, v, d_out, causal, scale, heads)
    same = [same_bits(te_out, t_out)] + [
        same_bits(a, b) for a, b in zip(te_grads, t_grads, strict=True)
    ]
    self_same = [same_bits(a, b) for a, b in zip(te_grads, te_again, strict=True)]
    rng = (
        offset_advance(lambda: module(q, k, v)),
        offset_advance(lambda: torch_step(q, k, v, d_out, causal, scale, heads)),
    )
    cost = (
        host_us(lambda: te_step(module, q, k, v, d_out), args.calls),
        host_us(lambda: torch_step(q, k, v, d_out, causal, scale, heads), args.calls),
    )
    flags = " | ".join("same" if ok else "DIFFER" for ok in same)
    te_self = "/".join("same" if ok else "differ" for ok in self_same)
    return (
        f"| {heads}/{groups} | {dim} | {seq} | {'causal' if causal else 'none'} | {flags} | "
        f"{te_self} | {rng[0]} / {rng[1]} | {cost[0]:.0f} / {cost[1]:.0f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", default="16,4")
    p.add_argument("--head-dim", default="64,128")
    p.add_argument("--seq", default="128,1000,2048")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    try:
        cudnn = torch.backends.cudnn.version()
    except RuntimeError as e:  # torch built against one cuDNN and another loaded first
        cudnn = f"unusable by torch ({str(e).splitlines()[0][:120]})"
    print(
        f"torch {torch.__version__}, cuDNN {cudnn}, TE {transformer_engine.__version__}, "
        f"{torch.cuda.get_device_name()}, batch {args.batch}, sbhd bf16"
    )
    print(
        "| heads/groups | d | s | mask | out | dq | dk | dv | TE's grads run twice | "
        "generator offset per fwd, TE / torch | host us per fwd+bwd, TE / torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for groups in (int(g) for g in args.groups.split(",")):
        for dim in (int(d) for d in args.head_dim.split(",")):
            for seq in (int(s) for s in args.seq.split(",")):
                for causal in (True, False):
                    try:
                        print(case(args, args.heads, groups, dim, seq, causal), flush=True)
                    except Exception as e:  # noqa: BLE001 - one failing case must not stop the rest
                        print(
                            f"| {args.heads}/{groups} | {dim} | {seq} | {causal} | failed: "
                            f"{str(e).splitlines()[0][:160]} |",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
