"""GPU time of one bf16 tensor's amax: TE's kernel against inductor's code for equal formulations.

    python bench/amax_variants.py [--shapes 2048x2048,6144x2048,8192x2048,2048x8192] [--calls 50]
    python bench/amax_variants.py --check   (the equality check alone; runs on a CPU too)
    python bench/amax_variants.py --gelu    (the amax of TE's tanh GELU of each tensor, in float32)

Current scaling's graph path spent about 150 us of a 1,257 us TransformerLayer step at H=2048 in
inductor's amax reductions (docs/perf/session24/), at about half the rate of TE's amax kernel
(session 23; session 26's run of this script: docs/perf/session26/). Each variant below computes
TE's amax (max |x|, NaNs skipped, 0 if all are NaN) by other operations; each is checked equal to
`quantize.amax` on adversarial values (NaN, +-inf, denormals, -0, an all-NaN tensor) before it is
timed, compiled fullgraph in default mode, as GPU time per call of its kernels (torch.profiler)
next to `tex.compute_amax` (TE's kernel). A faster variant is a candidate for quantize.amax; the
cast pass that follows it is not timed here.
"""

from __future__ import annotations

import argparse
import collections

import torch

from te_compile.graph_fp8 import mlp, quantize

# per dtype: (the integer of its size, its bits without the sign, +inf's bits: above are NaNs)
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}


def _no_nan_magnitude(x):
    m = x.abs()
    return torch.where(torch.isnan(m), torch.zeros_like(m), m)


def columns(x):
    """Over the rows first (a reduction along the slow dimension), then over the row."""
    return _no_nan_magnitude(x).amax(dim=0).amax().float().reshape(1)


def max_and_min(x):
    """The largest and the smallest value instead of magnitudes."""
    y = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    largest = torch.maximum(y.amax(dim=-1), -y.amin(dim=-1)).amax()
    return largest.abs().float().reshape(1)  # abs: -0.0 (from -min of zeros) to 0.0


def bits(x):
    """On the bits: a non-negative float's order is its bits' order as an integer, so the
    largest magnitude is the largest sign-less pattern at most +inf's (NaNs above it skipped)."""
    integer, magnitude, inf = _BITS[x.dtype]
    m = x.view(integer) & magnitude
    m = torch.where(m > inf, torch.zeros_like(m), m)
    return m.amax(dim=-1).amax().view(x.dtype).float().reshape(1)


def of_gelu(variant):
    """`variant` of TE's tanh GELU of x in float32, as the graph MLP's current-scaling amax
    reads FC1's output (graph_fp8/mlp.py)."""
    return lambda x: variant(mlp.gelu(x.float()))


def rows(x):
    """Over each row, then over the rows (DelayedScaling's form, fused with its cast)."""
    return quantize.amax(x, by_rows=True)


VARIANTS = {"whole (quantize.amax)": quantize.amax, "rows": rows, "columns": columns}
VARIANTS.update({"max and min": max_and_min, "bits": bits})


def adversarial(shape, device) -> list[torch.Tensor]:
    """bf16 tensors of `shape` whose amax is easy to get wrong."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=g).mul(3).to(torch.bfloat16)
    cases = [base, -base.abs()]  # the largest magnitude negative
    specials = (float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, -1e-40, -3e38)
    for value in specials:
        t = base.clone()
        t.view(-1)[:: max(1, t.numel() // 7)] = value
        cases.append(t)
    cases.append(torch.full(shape, float("nan"), dtype=torch.bfloat16))
    tiny = torch.full(shape, -1e-40, dtype=torch.bfloat16)  # all denormal
    return [t.to(device) for t in (*cases, tiny)]


def check(device: str, gelu: bool, shape=(64, 256)) -> dict[str, str]:
    """Variant -> "" if it equals quantize.amax on every adversarial case, eager and compiled,
    else the first difference (`gelu`: of the GELU of each case)."""
    torch._dynamo.reset()
    failures = {}
    reference = of_gelu(quantize.amax) if gelu else quantize.amax
    cases = adversarial(shape, device)
    wants = [reference(x).cpu() for x in cases]
    for name, fn in VARIANTS.items():
        fn = of_gelu(fn) if gelu else fn
        for mode, f in (("eager", fn), ("compiled", torch.compile(fn, fullgraph=True))):
            for i, (x, want) in enumerate(zip(cases, wants, strict=True)):
                got = f(x).cpu()
                if not torch.equal(want.view(torch.int32), got.view(torch.int32)):
                    failures.setdefault(name, f"{mode}, case {i}: {got.item()} != {want.item()}")
    return {name: failures.get(name, "") for name in VARIANTS}


def gpu_us(fn, x, calls: int) -> float:
    """GPU time per call of the kernels `fn(x)` launches."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    us = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name] += e.device_time / calls
    return sum(us.values())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="2048x2048,6144x2048,8192x2048,2048x8192")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--check", action="store_true", help="the equality check only")
    p.add_argument("--gelu", action="store_true", help="the amax of the GELU of each tensor")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    verdicts = check(device, args.gelu)
    for name, why in verdicts.items():
        print(f"{name}: {'equal to quantize.amax' if not why else 'DIFFERS: ' + why}")
    if args.check or device == "cpu":
        return
    import transformer_engine.pytorch  # noqa: F401  (loads its extension module)
    import transformer_engine_torch as tex

    equal = [name for name, why in verdicts.items() if not why]
    what = "amax of the GELU (TE's kernel: of the tensor itself)" if args.gelu else "amax"
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}: GPU us per {what}")
    print(f"| shape | TE's kernel | {' | '.join(equal)} |\n|---{'|---' * (len(equal) + 1)}|")
    for shape in args.shapes.split(","):
        n_rows, n_cols = (int(v) for v in shape.split("x"))
        x = torch.randn(n_rows, n_cols, device="cuda").mul(3).to(torch.bfloat16)
        amax = torch.zeros(1, device="cuda")
        times = [gpu_us(lambda t, out=amax: tex.compute_amax(t, out), x, args.calls)]
        for name in equal:
            torch._dynamo.reset()
            fn = of_gelu(VARIANTS[name]) if args.gelu else VARIANTS[name]
            times.append(gpu_us(torch.compile(fn, fullgraph=True), x, args.calls))
        print(f"| [{n_rows}, {n_cols}] | {' | '.join(f'{t:.1f}' for t in times)} |")


if __name__ == "__main__":
    main()
