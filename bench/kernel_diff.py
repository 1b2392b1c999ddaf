"""Whether another torch generates other Triton kernels for the graph path: inductor's kernels
for one te.TransformerLayer step (bench/kernel_count.py's layer, simulated H100, no GPU), dumped
per torch and compared kernel by kernel.

    python bench/kernel_diff.py dump DIR [--recipes current,delayed] [--hidden 1024] [--tokens 512]
    python bench/kernel_diff.py compare DIR_A DIR_B [--show]

`dump` writes `<recipe>-<forward|backward>.py` (the generated module) into DIR. `compare` reads
two such folders, one per torch (each venv runs `dump`), and prints per graph the kernel counts,
how many kernel bodies are the same text once kernel names are taken out, and the names of those
that are not; `--show` adds their diffs. The GPU suite checks bits on the lent machines' torch
(2.11); a kernel whose text is unchanged on another torch computes the same there, for the same
Triton. A changed one is where to look: session 38 found torch 2.15.0's kernels the same as
2.14.1's but for one DelayedScaling forward kernel split in two (docs/install.md).
"""

from __future__ import annotations

import argparse
import collections
import difflib
import os
import re

_KERNEL = re.compile(r"@triton\.jit\ndef (\w+)\(.*?\):\n(?:(?:    .*|)\n)+")


def kernels(source: str) -> dict[str, str]:
    """Kernel name -> its text with the name taken out and blank lines dropped."""
    found = {}
    for m in _KERNEL.finditer(source):
        text = m.group(0).replace(m.group(1), "KERNEL")
        found[m.group(1)] = "\n".join(line for line in text.splitlines() if line.strip())
    return found


def compare(dir_a: str, dir_b: str, show: bool) -> None:
    for name in sorted(set(os.listdir(dir_a)) | set(os.listdir(dir_b))):
        paths = [os.path.join(d, name) for d in (dir_a, dir_b)]
        if not all(os.path.exists(p) for p in paths):
            print(f"{name}: only in {[p for p in paths if os.path.exists(p)]}")
            continue
        a, b = (kernels(open(p).read()) for p in paths)
        texts_a, texts_b = collections.Counter(a.values()), collections.Counter(b.values())
        same = sum((texts_a & texts_b).values())
        print(f"{name}: {len(a)} / {len(b)} kernels, {same} the same text")
        for label, mine, theirs in (("A", a, texts_b), ("B", b, texts_a)):
            for kernel, text in mine.items():
                if text not in theirs:
                    print(f"  only in {label}: {kernel}")
                    if show and label == "A" and kernel in b:  # the same name in B: its diff
                        diff = difflib.unified_diff(
                            text.splitlines(), b[kernel].splitlines(), n=0, lineterm=""
                        )
                        print("\n".join(f"    {line}" for line in list(diff)[2:]))


def dump(folder: str, recipes: list[str], hidden: int, tokens: int) -> None:
    import kernel_count  # noqa: PLC0415  (bench/, beside this script; imports TE)
    import torch

    import te_compile

    te_compile.patch()
    os.makedirs(folder, exist_ok=True)
    # DelayedScaling last, as kernel_count does: its autocast exit updates every layer of it.
    for recipe in sorted(recipes, key=lambda name: name == "delayed"):
        sources = kernel_count.generated_sources(recipe, hidden, tokens)
        for graph, source in zip(("forward", "backward"), sources, strict=False):
            with open(os.path.join(folder, f"{recipe}-{graph}.py"), "w") as f:
                f.write(source)
        print(f"{recipe}: {[len(kernels(s)) for s in sources]} kernels, torch {torch.__version__}")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("folder")
    d.add_argument("--recipes", default="current,delayed")
    d.add_argument("--hidden", type=int, default=1024)
    d.add_argument("--tokens", type=int, default=512)
    c = sub.add_parser("compare")
    c.add_argument("folders", nargs=2)
    c.add_argument("--show", action="store_true")
    args = p.parse_args()
    if args.command == "dump":
        dump(args.folder, args.recipes.split(","), args.hidden, args.tokens)
    else:
        compare(*args.folders, args.show)


if __name__ == "__main__":
    main()
