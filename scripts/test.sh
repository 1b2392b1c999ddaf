#!/usr/bin/env bash
# README's test command: set up (scripts/install.sh, cached after the first run), lint, run the
# test suite. On a machine without a GPU the GPU tests are skipped; everything else must pass.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install.sh
# shellcheck source=/dev/null
source scripts/env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# pytest exits 5 when no test ran: with `set -e` that fails this script, as it should.
.venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
