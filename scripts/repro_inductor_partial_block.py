"""A minimal reproduction, for PyTorch's issue tracker, of an inductor miscompile found while
writing TE's block quantization in torch (session 59; this reduction session 60). Not
te_compile code: plain torch, CPU.

    python scripts/repro_inductor_partial_block.py

Pad the last dimension of [rows, cols] to whole blocks of 128, view it as [rows, blocks, 128],
scale each block by its own amax, view back, slice off the padding, make it contiguous. Eager
and compiled agree on the amax and on the padded product; the compiled sliced result is wrong
in every element of the last, partial block: tiny values that change from run to run (6e-9,
4e-18) where eager has the input times its block's amax, as if that block's amax were read
from memory nothing wrote. Seen on torch 2.14.1's CPU backend (352 of 2,400 elements for
[8, 300]); torch 2.11 and the GPU backend were not checked. te_compile's block quantization
probe (scripts/probe_block_quantize.py) gathers each element's block scale instead, which
compiles right.
"""

import torch


def padded_blocks(x):
    rows, cols = x.shape
    blocks = -(-cols // 128)
    return torch.nn.functional.pad(x, (0, blocks * 128 - cols)).view(rows, blocks, 128)


def block_amax(x):
    return padded_blocks(x).abs().amax(dim=-1)


def scaled_padded(x):
    b = padded_blocks(x)
    return b * b.abs().amax(dim=-1, keepdim=True)


def scaled(x):  # the failing one: scaled_padded, viewed back and sliced
    rows, cols = x.shape
    return scaled_padded(x).view(rows, -1)[:, :cols].contiguous()


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 300)
    print(f"torch {torch.__version__}, x {list(x.shape)}, CPU")
    for fn in (block_amax, scaled_padded, scaled):
        torch.compiler.reset()
        eager, compiled = fn(x), torch.compile(fn, fullgraph=True)(x)
        wrong = eager != compiled
        print(f"{fn.__name__}: {int(wrong.sum())} of {eager.numel()} elements differ")
        if wrong.any():
            at = tuple(wrong.nonzero()[0].tolist())
            print(
                f"  first at {at}: eager {eager[at].item():.6g}, compiled {compiled[at].item():.6g}"
            )


if __name__ == "__main__":
    main()
