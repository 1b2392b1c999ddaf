# Source me: puts the NVIDIA pip packages' include/lib folders (nccl, cu13, cudnn) of a venv on
# CPATH, LIBRARY_PATH and LD_LIBRARY_PATH, which TE's torch extension needs on a machine without
# a system CUDA install. Usage: source scripts/env.sh [VENV]   (default: .venv beside scripts/)
_te_venv=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv}
_te_site=$("$_te_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for _te_pkg in nccl cu13 cudnn; do
  _te_dir="$_te_site/nvidia/$_te_pkg"
  [ -d "$_te_dir" ] || continue
  export CPATH="$_te_dir/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$_te_dir/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$_te_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
# torch's CUDA 12 builds (PyPI's torch 2.9.1: scripts/test_floor.sh) bring one NVIDIA package per
# library (nvidia/cuda_runtime, nvidia/cublas, ...). TE 2.20's loader does not look for cudart
# there; naming nvrtc's folder NVRTC_HOME makes it leave the libraries to LD_LIBRARY_PATH.
if [ -d "$_te_site/nvidia/cuda_runtime/lib" ]; then
  for _te_dir in "$_te_site"/nvidia/*/lib; do
    export LD_LIBRARY_PATH="$_te_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  export NVRTC_HOME=${NVRTC_HOME:-$_te_site/nvidia/cuda_nvrtc}
fi
unset _te_venv _te_site _te_pkg _te_dir
