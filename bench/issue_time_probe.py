"""Does a default-mode step cost more CPU to issue at a larger shape because the GPU runs its
kernels meanwhile? (docs/perf/history.md, session 44.) Plain PyTorch's block (bench/stacks.py,
4 layers, heads of 64) compiled in default mode at H=1024 (512 tokens) and H=2048 (2 x 1024):
the median CPU ms to issue one step with the GPU idle at its start, and with the GPU held by a
sleep kernel for the whole issue, so that none of the step's kernels runs while it is issued;
each twice, alternating. A diagnosis, run alone on a GPU machine (no TE needed):

    python3 bench/issue_time_probe.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import stacks  # noqa: E402

SHAPES = ((1024, 512, 1), (2048, 1024, 2))  # hidden, sequence, batch
SLEEP_CYCLES = 120_000_000  # about 60 ms at 2 GHz: longer than any issue measured here


def issue_ms(step, hold_gpu: bool, n: int = 30) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        if hold_gpu:
            torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def measure(hidden: int, seq: int, batch: int) -> tuple:
    torch._dynamo.reset()
    model = stacks.build("torch-transformer", hidden, 4)
    x = torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    compiled = torch.compile(model)

    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        compiled(x).backward(grad)

    for _ in range(5):
        step()
    idle, held = issue_ms(step, False), issue_ms(step, True)
    idle2, held2 = issue_ms(step, False), issue_ms(step, True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        step()
    end.record()
    torch.cuda.synchronize()
    return hidden, idle, held, idle2, held2, start.elapsed_time(end) / 20


def main() -> None:
    stacks.HEAD_DIM = 64
    rows = [measure(*shape) for shape in SHAPES]
    print("| H | issue, GPU idle | issue, GPU held | again idle | again held | ms/step |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | " + " | ".join(f"{v:.3f}" for v in row[1:]) + " |")


if __name__ == "__main__":
    main()
