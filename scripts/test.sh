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
# One pytest worker per core (at most 4: each holds torch, TE and inductor's compile pool) by
# file, so that a file's module fixtures build once; TE_COMPILE_TEST_WORKERS=0 runs in-process.
# In one process the suite took 70 min in CI (2 cores); 2 workers took 36 min on a 2-core machine.
cores=$(nproc)
workers=${TE_COMPILE_TEST_WORKERS:-$((cores < 4 ? cores : 4))}
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile)
# pytest exits 5 when no test ran: with `set -e` that fails this script, as it should.
.venv/bin/python -m pytest -q -p no:cacheprovider "${parallel[@]}" tests "$@"
