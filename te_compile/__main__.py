"""`python -m te_compile`: the doctor report.
`python -m te_compile check FILE.py:FACTORY [--arch hopper] [--recipe delayed,current]
[--backend inductor]`: trace the model FACTORY builds under te_compile.check; exit 1 when a case
fails (a CI gate)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m te_compile")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("doctor", help="versions, GPU, recipe support, patch state (the default)")
    chk = sub.add_parser("check", help="trace a model's compile-readiness without a GPU")
    chk.add_argument("target", help="FILE.py:FACTORY; FACTORY() returns (model, example_inputs)")
    chk.add_argument("--arch", default="hopper", help="hopper/sm90 or blackwell/sm100")
    chk.add_argument("--recipe", default=None, help="comma-separated: none,delayed,current,...")
    chk.add_argument("--whole-model-only", action="store_true", help="skip per-module cases")
    chk.add_argument("--no-patch", action="store_true", help="check TE's own compile path")
    chk.add_argument(
        "--backend",
        default="aot_eager",
        choices=("aot_eager", "inductor"),
        help="inductor: also compile each graph with inductor for the simulated GPU (no run)",
    )
    args = parser.parse_args(argv)

    import te_compile

    if args.command in (None, "doctor"):
        print(te_compile.doctor())
        return 0
    from .tools.check import check_factory, load_factory

    if not args.no_patch:
        te_compile.patch()
    recipes = args.recipe.split(",") if args.recipe else None
    factory = load_factory(args.target)
    report = check_factory(
        factory,
        arch=args.arch,
        recipes=recipes,
        per_module=not args.whole_model_only,
        backend=args.backend,
    )
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
