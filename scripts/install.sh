#!/usr/bin/env bash
# Fresh-machine setup for te-compile: a venv with torch (CUDA build), Transformer Engine 2.20.2 and
# this package with its test extras. Works without a GPU: TE's torch extension then needs the
# NVIDIA pip packages' include/lib folders on CPATH/LIBRARY_PATH/LD_LIBRARY_PATH (see env.sh).
#
# The TE torch extension is an sdist that must be compiled against the installed torch (~11 min on
# 2 cores). The built wheel is cached outside the clone, keyed on TE/torch/Python versions:
#   ${TE_COMPILE_CACHE:-~/.cache/te-compile}/wheels/
# A matching prebuilt wheel in ../shared/wheels/ (beside the clone) is taken instead of building,
# unless TE_COMPILE_BUILD_TE=1.
#
# TE's core wheel follows torch's CUDA major version (transformer-engine-cu13 for torch 2.14.1's
# cu130 build, -cu12 for a cu12 build such as PyPI's torch 2.9.1). When that differs from nvcc's,
# the extension is compiled against the NVIDIA pip packages' headers (those torch was built with).
#
# Progress goes to stderr as "[install +Ns] ..."; pip runs quietly and its full output is shown
# only when a step fails.
#
# Usage: bash scripts/install.sh          (venv at .venv; override with TE_COMPILE_VENV,
#        torch with TORCH_VERSION; scripts/test_floor.sh uses both)
set -euo pipefail

TORCH_VERSION=${TORCH_VERSION:-2.14.1}
TE_VERSION=${TE_VERSION:-2.20.2}
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${TE_COMPILE_VENV:-$root/.venv}
cache=${TE_COMPILE_CACHE:-$HOME/.cache/te-compile}
start=$(date +%s)
log() { echo "[install +$(($(date +%s) - start))s] $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating venv at $venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
# pip quietly; on failure show everything it said. On success only pip's own top-level warnings
# (and its dependency-conflict lines) are kept, minus this machine's "index location is ignored"
# notices. Build-backend warnings (indented, e.g. setuptools' "Editable installation" note) are
# dropped.
pip() {
  local out status=0
  out=$(mktemp)
  "$py" -m pip --disable-pip-version-check --no-input "$@" >"$out" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    cat "$out" >&2
    rm -f "$out"
    log "FAILED: pip $*"
    return "$status"
  fi
  grep -E '^(WARNING|ERROR):|^[^ ].* requires .*, but you have ' "$out" |
    grep -v 'is ignored: it is neither a file nor a directory' >&2 || true
  rm -f "$out"
}
pip install -q --upgrade pip wheel 'setuptools>=77'

if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  log "installing torch $TORCH_VERSION"
  # A CUDA build of torch takes about 6 GB in the venv, with its download beside it; pip's own
  # message for a full disk ("No space left on device") comes only after the download.
  free_gb=$(df -Pk "$venv" | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "${free_gb:-99}" -lt 10 ]; then
    log "warning: ${free_gb} GB free where the venv lies ($venv); torch needs about 10 GB to install"
  fi
  pip install -q "torch==$TORCH_VERSION"
fi
info=$("$py" -W ignore -c 'import sys, torch; print(f"cp{sys.version_info[0]}{sys.version_info[1]}", torch.__version__, torch.version.cuda or "13.0")')
read -r pyver torchver torchcudafull <<<"$info"
torchcuda=${torchcudafull%%.*}
log "torch $torchver (CUDA $torchcuda), python $pyver"

# TE's Python code (transformer-engine) and core library (transformer-engine-cuNN) are wheels.
# --no-deps on the meta package: its [pytorch] extra would start a CUDA build of the extension.
log "installing transformer-engine $TE_VERSION (core wheels, cu$torchcuda)"
pip install -q "transformer-engine-cu$torchcuda==$TE_VERSION"
pip install -q --no-deps "transformer-engine==$TE_VERSION"
# TE refuses a cuDNN runtime older than its MIN_CUDNN_VERSION at import (9.12 for TE 2.20), and its
# extension refuses older headers at build time; PyPI's torch 2.9/2.10 pin cuDNN 9.10.2.21. cuDNN 9
# minors are backward compatible, so take TE's minimum (pip then notes the conflict with the pin).
# Any later pip install that resolves torch's requirements puts the pin back: checked again at the end.
cudnnpkg="nvidia-cudnn-cu$torchcuda"
mincudnn=$(sed -n 's/^MIN_CUDNN_VERSION = (\([0-9]*\), *\([0-9]*\), *\([0-9]*\)).*/\1.\2.\3/p' \
  "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/transformer_engine/common/__init__.py")
ensure_cudnn() {
  [ -n "$mincudnn" ] || return 0
  "$py" -c "
import sys, re, importlib.metadata as m
have = tuple(int(p) for p in re.findall(r'\d+', m.version('$cudnnpkg'))[:3])
sys.exit(have < tuple(int(p) for p in '$mincudnn'.split('.')))" 2>/dev/null && return 0
  log "torch $torchver pins an older cuDNN; TE $TE_VERSION needs >= $mincudnn: installing $cudnnpkg~=$mincudnn"
  pip install -q "$cudnnpkg~=$mincudnn"
}
ensure_cudnn
# TE's import loads cuRAND ("curand shared object not found" without it); torch pulled it in up
# to 2.14 (nvidia-curand for CUDA 13, nvidia-curand-cu12 before), torch 2.15.0 no longer does.
curandpkg=nvidia-curand
[ "$torchcuda" = 12 ] && curandpkg=nvidia-curand-cu12
if ! "$py" -c "import importlib.metadata as m; m.version('$curandpkg')" 2>/dev/null; then
  log "torch $torchver does not bring cuRAND, which TE loads at import: installing $curandpkg"
  pip install -q "$curandpkg"
fi

# shellcheck source=/dev/null
source "$root/scripts/env.sh" "$venv"

# The extension lives in transformer_engine/wheel_lib and loads with transformer_engine.pytorch;
# that import fails when it is missing or was built for another torch.
if ! "$py" -W ignore -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
  key="transformer_engine_torch-${TE_VERSION}-torch${torchver//+/_}-${pyver}"
  mkdir -p "$cache/wheels/$key"
  whl=$(ls "$cache/wheels/$key"/*.whl 2>/dev/null | head -1 || true)
  shared=$(ls "$root"/../shared/wheels/transformer_engine_torch-"$TE_VERSION"-"$pyver"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$whl" ] && [ -n "$shared" ] && [ "$torchver" = "2.14.1+cu130" ] && [ -z "${TE_COMPILE_BUILD_TE:-}" ]; then
    log "using prebuilt extension $shared (built for torch 2.14.1+cu130)"
    cp "$shared" "$cache/wheels/$key/" && whl="$cache/wheels/$key/$(basename "$shared")"
  fi
  if [ -z "$whl" ]; then
    log "building transformer-engine-torch $TE_VERSION from sdist against torch $torchver (~11 min on 2 cores)"
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    pip install -q ninja pybind11 cmake
    # No build isolation: the extension must compile against the torch installed above.
    pip download -q --no-deps --no-build-isolation --no-binary transformer-engine-torch \
      -d "$src" "transformer-engine-torch==$TE_VERSION"
    CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
    # The /usr/local/bin/nvcc here is a wrapper script; take the toolkit it execs.
    if [ ! -f "$CUDA_HOME/include/cuda_runtime.h" ] && [ -d /usr/local/cuda ]; then CUDA_HOME=/usr/local/cuda; fi
    export CUDA_HOME
    nvccmajor=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    if [ "$nvccmajor" != "$torchcuda" ]; then
      # The extension is C++ only (no CUDA kernels): it needs CUDA headers matching torch's, which
      # are the NVIDIA pip packages torch pulled in plus nvcc's (crt/*.h) and CCCL's (nv/target),
      # taken from pip too.
      [ "$torchcuda" = 12 ] || { log "nvcc is CUDA $nvccmajor, torch CUDA $torchcudafull: set CUDA_HOME to a CUDA $torchcuda toolkit"; exit 1; }
      log "nvcc is CUDA $nvccmajor, torch is CUDA $torchcudafull: building against the NVIDIA pip packages' CUDA $torchcudafull headers"
      pip install -q "nvidia-cuda-nvcc-cu12~=$torchcudafull.0" "nvidia-cuda-cccl-cu12~=$torchcudafull.0"
      CUDA_HOME=$("$py" -c 'import nvidia.cuda_nvcc as m; print(m.__path__[0])')
      export NVTE_BUILD_USE_NVIDIA_WHEELS=1
    fi
    NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-$(nproc)} \
      pip wheel -q --no-deps --no-build-isolation -w "$cache/wheels/$key" "$src"/transformer_engine_torch-*.tar.gz
    whl=$(ls "$cache/wheels/$key"/*.whl | head -1)
    rm -rf "$src"
  fi
  log "installing $whl"
  pip install -q "$whl"
fi

# The test extra (pyproject.toml): pytest, ruff, and transformers + accelerate for the HF tests.
# Those two are pure-Python wheels; with their dependencies (tokenizers, safetensors and hf-xet
# as binary wheels) they add 13 s with pip's download cache warm, 22 s cold, on 2 cores.
log "installing te-compile with test extras (pytest, pytest-xdist, ruff, transformers, accelerate)"
pip install -q -e "$root[test]"
ensure_cudnn
"$py" -W ignore -c "
import importlib.metadata as m
import transformer_engine.pytorch, te_compile
print('torch', m.version('torch'), '| transformer-engine', m.version('transformer-engine'), '| te-compile', m.version('te-compile'))"
log "done"
