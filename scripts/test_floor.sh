#!/usr/bin/env bash
# The CPU test suite on the oldest torch te-compile claims to support (README: torch >= 2.9), in
# its own venv beside .venv (.venv-torch2.9 for 2.9.1; git-ignored).
#
# It reuses scripts/install.sh with TORCH_VERSION and TE_COMPILE_VENV. PyPI's torch 2.9.1 is a
# CUDA 12.8 build, so install.sh takes transformer-engine-cu12 and compiles TE's torch extension
# against the CUDA 12 headers of the NVIDIA pip packages that torch pulled in (nvcc 13.0 on PATH
# only reports the toolkit version; the extension has no CUDA kernels). The built extension is
# cached in ~/.cache/te-compile/wheels/ under its own key (torch2.9.1_cu128): the first run builds
# it (~11 min on 2 cores), later runs take a minute or two.
#
# Usage: bash scripts/test_floor.sh [pytest args]     (FLOOR_TORCH=2.10.0 to try another torch)
set -euo pipefail
FLOOR_TORCH=${FLOOR_TORCH:-2.9.1}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${TE_COMPILE_VENV:-$root/.venv-torch${FLOOR_TORCH%.*}}
TORCH_VERSION=$FLOOR_TORCH TE_COMPILE_VENV=$venv bash scripts/install.sh
# shellcheck source=/dev/null
source scripts/env.sh "$venv"
# pytest exits 5 when no test ran: with `set -e` that fails this script, as it should.
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
