"""Host microseconds per Float8BlockScaling GEMM call, TE's `generic_gemm` against aten's
blockwise `_scaled_mm_v2` (session 60: `configure(aten_block_gemm=True)` made a TransformerLayer
step 0.76-0.86x, about 70-130 us more CPU per GEMM; this says which part costs it).

    python bench/block_gemm_cost.py [--calls 200] [--shape 256,1024,1024]

Per row: the median over 5 rounds of `--calls` back-to-back calls, timed from an idle GPU to the
last call's return (the GPU work is not waited for, as in a step that waits on the CPU; keep the
shape small so the GPU keeps up). Rows per layout (TN fprop, NN dgrad, NT wgrad):
- `te`: te_compile's `extension.gemm` with the option off (TE's `generic_gemm`);
- `te_compile + aten`: the same call with `aten_block_gemm=True` (the views, then aten);
- `aten alone`: `aten._scaled_mm_v2` on arguments prepared once;
- and, for scale, one `tex.quantize` of the input (1x128, both usages).
The `te_compile + aten` output is compared with TE's bit for bit (`aten alone` makes the
same call on the same arguments; its output is not compared).
"""

from __future__ import annotations

import torch
from scaled_mm_cost import calls_and_shape, per_call_us  # bench/, on the path when run as a script


def _quantizer(dims: int):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    q = Float8BlockQuantizer(
        tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dims
    )
    q.internal = True
    return q


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401
    import transformer_engine_torch as tex

    import te_compile
    from te_compile.kernels import aten_gemm, extension

    calls, m, k, n = calls_and_shape("256,1024,1024")
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, w, dy = torch.randn(m, k, **bf16), torch.randn(n, k, **bf16), torch.randn(m, n, **bf16)
    rows, tile = _quantizer(1), _quantizer(2)
    xq, wq, gq = tex.quantize(x, rows), tex.quantize(w, tile), tex.quantize(dy, rows)
    gemms = {"TN fprop": (wq, xq), "NN dgrad": (wq, gq), "NT wgrad": (xq, gq)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, M,K,N = {m},{k},{n}")
    print("| GEMM | te | te_compile + aten | aten alone | aten bits as TE's |")
    print("|---|---|---|---|---|")
    for name, (a, b) in gemms.items():
        layout = name[:2]

        def call(a=a, b=b, layout=layout):
            return extension.gemm(
                a,
                b,
                layout=layout,
                out_dtype=torch.bfloat16,
                split_accumulator=True,
                device_index=0,
            )[0]

        te_compile.configure(aten_block_gemm=False)
        te_us, te_out = per_call_us(call, calls), call()
        te_compile.configure(aten_block_gemm=True)
        ours_us, ours_out = per_call_us(call, calls), call()
        te_compile.configure(aten_block_gemm=False)
        # aten alone: the arguments block_scaled_mm hands it, prepared once
        b_half, a_half = aten_gemm._HALVES[layout]
        (mat1, s1), (mat2, s2) = (
            aten_gemm._block_matrix(b, b_half),
            aten_gemm._block_matrix(a, a_half),
        )

        def bare(mat1=mat1, mat2=mat2, s1=s1, s2=s2, b=b, a=a):
            return torch.ops.aten._scaled_mm_v2(
                mat1,
                mat2.t(),
                [s1],
                [aten_gemm._BLOCK_RECIPE[b._is_2D_scaled]],
                [],
                [s2],
                [aten_gemm._BLOCK_RECIPE[a._is_2D_scaled]],
                [],
                None,
                torch.bfloat16,
                [],
                False,
            )

        bare_us = per_call_us(bare, calls)
        same = torch.equal(te_out.reshape(ours_out.shape), ours_out)
        print(f"| {name} | {te_us:.1f} | {ours_us:.1f} | {bare_us:.1f} | {same} |")
    quant_us = per_call_us(lambda: tex.quantize(x, rows), calls)
    print(f"\none tex.quantize of the input (1x128, both usages): {quant_us:.1f} us")


if __name__ == "__main__":
    main()
