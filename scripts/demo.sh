#!/usr/bin/env bash
# README's demo command: set up (scripts/install.sh), then run examples/demo.py (a te.Linear MLP)
# and examples/gpt_demo.py (a GPT of te.TransformerLayer blocks). Arguments go to gpt_demo.py
# (--out DIR for its PNG, --steps N).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install.sh >/dev/null
# shellcheck source=/dev/null
source scripts/env.sh
.venv/bin/python examples/demo.py
echo
exec .venv/bin/python examples/gpt_demo.py "$@"
