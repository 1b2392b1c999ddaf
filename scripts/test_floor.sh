#!/usr/bin/env bash
# The CPU test suite on the oldest torch te-compile claims to support (README: torch >= 2.11), in
# its own venv beside .venv (.venv-torch2.11 for 2.11.0; git-ignored). Results per torch and what
# an older torch needs: docs/install.md.
#
# It reuses scripts/install.sh with TORCH_VERSION and TE_COMPILE_VENV. For a CUDA 12 torch (PyPI's
# 2.9.1, 2.10.0) install.sh takes transformer-engine-cu12, builds TE's extension against the CUDA
# 12 headers of the NVIDIA pip packages and lifts cuDNN to TE's minimum. The built extension is
# cached in ~/.cache/te-compile/wheels/ under its own key (e.g. torch2.11.0_cu130): the first run
# builds it (~10-20 min on 2 shared cores), later runs take a minute or two.
#
# Usage: bash scripts/test_floor.sh [pytest args]     (FLOOR_TORCH=2.12.1 to try another torch)
set -euo pipefail
FLOOR_TORCH=${FLOOR_TORCH:-2.11.0}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${TE_COMPILE_VENV:-$root/.venv-torch${FLOOR_TORCH%.*}}
TORCH_VERSION=$FLOOR_TORCH TE_COMPILE_VENV=$venv bash scripts/install.sh
# shellcheck source=/dev/null
source scripts/env.sh "$venv"
# pytest exits 5 when no test ran: with `set -e` that fails this script, as it should.
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
