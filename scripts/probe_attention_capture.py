"""GPU probe: te_compile's fused attention ops inside CUDA graph capture, packed vs separate
q/k/v layouts (the diagnosis of session 3's reduce-overhead failures, docs/architecture.md,
"Attention inside CUDA graphs").

    python3 scripts/probe_attention_capture.py [--part ops|fused_qkv|rope]

Per layout and head dim: the op's forward + backward captured in one manual torch.cuda.graph,
replayed on new values, vs the same ops run eagerly; then a torch.compile(mode=
"reduce-overhead") function (matmul -> packed QKV view -> attention) over 4 steps vs eager.
--part fused_qkv / rope: the TransformerLayer of tests/gpu/test_transformer_layer_gpu.py at its
sequence of 32, 4 reduce-overhead steps vs eager (with cuDNN <= 9.15 this now raises TE's named
refusal). Prints table rows of max abs differences (0 = bit-identical):
| layout | d | manual capture | reduce-overhead | eager packed vs separate |

Session 4 on an H100 (the ops then took a packed-layout switch, since removed): every op row
0; the layer rows 28-65, packed or separate alike: cuDNN's known CUDA-graph issue at sequences
that are not a multiple of 128.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

import te_compile
import te_compile.ops  # noqa: F401  (registers the te_compile:: ops)
from te_compile.ops.attention import FusedAttnSpec

S, B, H = 128, 2, 4


def packed_shape(layout: str, d: int) -> tuple[int, ...]:
    if layout == "sb3hd":
        return (S, B, 3, H, d)
    if layout == "sbh3d":
        return (S, B, H, 3, d)
    return (S, B, H, d)


def attention(qkv: list[torch.Tensor], layout: str) -> torch.Tensor:
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
    out, _, _ = torch.ops.te_compile.fused_attn_fwd(
        qkv,
        cu,
        cu,
        [None, None],
        [S, S],
        FusedAttnSpec(
            qkv_layout=layout,
            attn_mask_type="causal",
            window_size=(-1, 0),
            bottom_right_diagonal=False,
            attn_scale=0.25,
            dropout=0.0,
            fast_zero_fill=True,
            is_training=True,
            deterministic=False,
            backend=1,
        ).key,
    )
    return out


def split_inputs(layout: str, d: int, w: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    """x [S*B, K] @ w [K, 3*H*d] viewed as `layout`'s tensors (views of one GEMM output)."""
    y = x @ w
    if layout in ("sb3hd", "sbh3d"):
        return [y.view(packed_shape(layout, d))]
    q, k, v = y.view(S, B, 3, H, d).unbind(2)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def separate_of(layout: str, d: int, w: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    """The q/k/v of packed `layout`, copied apart (contiguous, "sbhd_sbhd_sbhd")."""
    y = (x @ w).view(packed_shape(layout, d))
    return [t.contiguous() for t in y.unbind(2 if layout == "sb3hd" else 3)]


def packed_vs_separate(layout: str, d: int) -> float:
    """Eager: the op on the packed buffer vs on q/k/v copied apart; max diff of out and grads."""
    torch.manual_seed(0)
    w = torch.randn(64, 3 * H * d, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(S * B, 64, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(S, B, H, d, device="cuda", dtype=torch.bfloat16)
    results = []
    for make, lay in ((split_inputs, layout), (separate_of, "sbhd_sbhd_sbhd")):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = attention(make(layout, d, wi, xi), lay)
        out.backward(g)
        results.append([out.detach(), xi.grad, wi.grad])
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(*results, strict=True))


def step(layout: str, d: int, w, x, g):
    out = attention(split_inputs(layout, d, w, x), layout)
    out.backward(g)
    return out


def manual_capture(layout: str, d: int) -> float:
    torch.manual_seed(0)
    k = 64
    w = torch.randn(k, 3 * H * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(S * B, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(S, B, H, d, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            w.grad = x.grad = None
            step(layout, d, w, x, g)
    torch.cuda.current_stream().wait_stream(side)
    w.grad = x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(layout, d, w, x, g)
    worst = 0.0
    for _ in range(3):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            g.copy_(torch.randn_like(g))
        graph.replay()
        torch.cuda.synchronize()
        got = [out.clone(), x.grad.clone(), w.grad.clone()]
        xe = x.detach().clone().requires_grad_()
        we = w.detach().clone().requires_grad_()
        oute = step(layout, d, we, xe, g)
        for a, b in zip(got, [oute, xe.grad, we.grad], strict=True):
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst


def compiled_ro(layout: str, d: int) -> float:
    torch._dynamo.reset()
    torch.manual_seed(0)
    k = 64
    w = torch.randn(k, 3 * H * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def fn(x):
        return attention(split_inputs(layout, d, w, x), layout)

    cfn = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    worst = 0.0
    for i in range(4):
        torch.manual_seed(100 + i)
        x = torch.randn(S * B, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(S, B, H, d, device="cuda", dtype=torch.bfloat16)
        results = []
        for f in (fn, cfn):
            if f is cfn:
                torch.compiler.cudagraph_mark_step_begin()
            xi = x.clone().requires_grad_()
            w.grad = None
            out = f(xi)
            out.backward(g)
            results.append([out.detach().clone(), xi.grad.clone(), w.grad.clone()])
        for a, b in zip(*results, strict=True):
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst


def layer_row(case: str) -> list[str]:
    """The failing GPU test's TransformerLayer (tests/gpu/test_transformer_layer_gpu.py), 4
    reduce-overhead steps vs eager."""
    import torch._inductor.config as inductor_config

    sys.path[:0] = ["tests", "tests/gpu"]
    import test_transformer_layer_gpu as t

    with inductor_config.patch(t.EAGER_ROUNDING):
        want = t.steps(case, "none", False, n=4, lr=0.01)
        got = t.steps(case, "none", True, n=4, lr=0.01, mode="reduce-overhead")
    worst = max(
        (g[k].float() - w[k].float()).abs().max().item()
        for g, w in zip(got, want, strict=True)
        for k in w
    )
    return [f"TransformerLayer {case}", "16", "-", f"{worst:.3g}"]


def op_rows() -> list[list[str]]:
    rows = []
    for layout in ("sbhd_sbhd_sbhd", "sb3hd", "sbh3d"):
        for d in (16, 64):
            row = [layout, str(d)]
            probes = (manual_capture, compiled_ro)
            if "_" not in layout:
                probes += (packed_vs_separate,)
            for probe in probes:
                try:
                    row.append(f"{probe(layout, d):.3g}")
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row.append(f"error: {type(e).__name__}")
                    if "illegal memory" in str(e):
                        return rows + [row]
            rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["ops", "fused_qkv", "rope"], default="ops")
    args = p.parse_args()
    te_compile.patch()
    rows = op_rows() if args.part == "ops" else [layer_row(args.part)]
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
