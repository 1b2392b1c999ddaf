#!/usr/bin/env bash
# README's demo command: set up (scripts/install.sh), then run examples/demo.py.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install.sh >/dev/null
# shellcheck source=/dev/null
source scripts/env.sh
exec .venv/bin/python examples/demo.py "$@"
