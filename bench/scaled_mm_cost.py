"""Host microseconds per `torch._scaled_mm` call, by the arguments that differ between
te_compile's graph path and torchao (session 45: 50 against 30 us per call in one step).

    python bench/scaled_mm_cost.py [--calls 200] [--shape 512,1024,3072]

Per variant: the median over 5 rounds of `--calls` back-to-back calls, each round timed from an
idle GPU to the last call's return (the GPU work is not waited for, as in a compiled step that
waits on the CPU). Variants: the bias in the GEMM's epilogue (te_compile and TE) or none
(torchao adds it apart), scales shaped [1] (te_compile's scale_inv) or [] (torchao's), fast
accumulation on (fprop) or off (dgrad, wgrad). Each variant's output is compared with the
first's of the same bias and accumulation, bit for bit: a scale's shape must not change bits.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch


def per_call_us(fn, calls: int) -> float:
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def calls_and_shape(default_shape: str) -> tuple[int, int, int, int]:
    """(--calls, M, K, N) from the command line (--shape M,K,N of y[M,N] = x[M,K] @ w[N,K].T)."""
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--shape", default=default_shape, help="M,K,N of y[M,N] = x[M,K] @ w[N,K].T")
    args = p.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    return args.calls, m, k, n


def main() -> None:
    calls, m, k, n = calls_and_shape("512,1024,3072")
    torch.manual_seed(0)
    fp8 = torch.float8_e4m3fn
    x = torch.randn(m, k, device="cuda").to(fp8)
    w = torch.randn(n, k, device="cuda").to(fp8)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    scales = {"[1]": torch.full((1,), 0.5, device="cuda"), "[]": torch.tensor(0.5, device="cuda")}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, y[{m},{n}] = x @ w.T")
    print("| bias | scales | fast accum | host us per call | bits as the first of its row group |")
    print("|---|---|---|---|---|")
    first = {}
    for with_bias, fast in itertools.product((True, False), (True, False)):
        for name, s in scales.items():

            def call(s=s, with_bias=with_bias, fast=fast):
                return torch._scaled_mm(
                    x,
                    w.t(),
                    s,
                    s,
                    bias=bias if with_bias else None,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=fast,
                )

            us = per_call_us(call, calls)
            y = call()
            same = torch.equal(first.setdefault((with_bias, fast), y), y)
            print(
                f"| {'epilogue' if with_bias else 'none'} | {name} | {fast} | {us:.1f} | {same} |"
            )


if __name__ == "__main__":
    main()
