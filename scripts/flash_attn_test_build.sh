#!/usr/bin/env bash
# A flash-attn build for the FlashAttention GPU tests (tests/gpu/test_attention_gpu.py -k flash)
# on a GPU machine without a package registry, where building all of flash-attn (72 kernel
# files) would take most of a session's device time. Test environment only: not for training.
#
#   bash scripts/flash_attn_test_build.sh objects   # CPU machine (nvcc 13, .venv-torch2.11):
#       compiles, from the PyPI sdist of flash-attn 2.8.3.post2, the sm_90 kernels the tests use
#       (bf16, head dims 64 and 128: forward, split-KV forward, backward; ~20 min on 2 cores)
#       and a stub for every other head dim / dtype that aborts with "not built"; writes
#       .te-stage/fa/ (about 14 MB).
#   bash scripts/flash_attn_test_build.sh install   # GPU machine, from the checkout, with
#       .te-stage/fa carried there and TE installed: links flash_attn_2_cuda against the local
#       torch (torch.utils.cpp_extension), installs the flash_attn Python package beside it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
stage=$root/.te-stage/fa
version=2.8.3.post2

objects() {
  local work=/tmp/te-compile-fa py=$root/.venv-torch2.11/bin/python
  mkdir -p "$work/obj" "$stage"
  # The sdist itself (pip download would run its setup.py, which imports torch).
  python3 - "$version" "$work" <<'PY'
import json, sys, urllib.parse, urllib.request
version, work = sys.argv[1:]
index = "https://pypi.org/pypi/flash-attn/json"
meta = json.load(urllib.request.urlopen(index))
url = next(u["url"] for u in meta["releases"][version] if u["packagetype"] == "sdist")
urllib.request.urlretrieve(urllib.parse.urljoin(index, url), f"{work}/flash_attn-{version}.tar.gz")
PY
  tar xzf "$work/flash_attn-$version.tar.gz" -C "$work"
  cd "$work/flash_attn-$version"
  cat > "$work/stubs.cu" <<'CU'
// Head dims / dtypes this test build leaves out: abort loudly rather than compute anything.
#include <cstdio>
#include <cstdlib>
#include "namespace_config.h"
#include "flash.h"
#include <cutlass/numeric_types.h>
namespace FLASH_NAMESPACE {
[[noreturn]] static void not_built(const char *what, int d) {
  std::fprintf(stderr, "flash-attn test build: %s kernel for head dim %d not built\n", what, d);
  std::abort();
}
#define STUB(T, D, C) \
  template<> void run_mha_fwd_<T, D, C>(Flash_fwd_params &, cudaStream_t) { not_built("fwd", D); } \
  template<> void run_mha_fwd_splitkv_dispatch<T, D, C>(Flash_fwd_params &, cudaStream_t) { \
    not_built("fwd_split", D); } \
  template<> void run_mha_bwd_<T, D, C>(Flash_bwd_params &, cudaStream_t) { not_built("bwd", D); }
#define STUBS(T, D) STUB(T, D, true) STUB(T, D, false)
STUBS(cutlass::half_t, 32) STUBS(cutlass::half_t, 64) STUBS(cutlass::half_t, 96)
STUBS(cutlass::half_t, 128) STUBS(cutlass::half_t, 192) STUBS(cutlass::half_t, 256)
STUBS(cutlass::bfloat16_t, 32) STUBS(cutlass::bfloat16_t, 96)
STUBS(cutlass::bfloat16_t, 192) STUBS(cutlass::bfloat16_t, 256)
}  // namespace FLASH_NAMESPACE
CU
  local inc
  inc=$("$py" -c "from torch.utils.cpp_extension import include_paths as p; \
print(' '.join('-I' + x for x in p(device_type='cuda')))" 2>/dev/null)
  # flash-attn's own nvcc flags (its setup.py), for sm_90 only.
  export FA_FLAGS="-O3 -std=c++17 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__
    -U__CUDA_NO_HALF2_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr
    --expt-extended-lambda --use_fast_math -gencode arch=compute_90,code=sm_90 -Icsrc/flash_attn
    -Icsrc/flash_attn/src -Icsrc/cutlass/include $inc -D_GLIBCXX_USE_CXX11_ABI=1
    -DTORCH_EXTENSION_NAME=flash_attn_2_cuda -Xcompiler -fPIC" FA_OBJ=$work/obj
  { echo "$work/stubs.cu"; ls csrc/flash_attn/src/*.cu | grep -E "hdim(64|128)_bf16"; } |
    xargs -P "$(nproc)" -I{} sh -c 'nvcc -c {} -o "$FA_OBJ/$(basename {} .cu).o" $FA_FLAGS'
  tar czf "$stage/fa_src.tar.gz" csrc/flash_attn/flash_api.cpp csrc/flash_attn/src/*.h \
    csrc/flash_attn/src/*.cuh csrc/cutlass/include flash_attn
  (cd "$work/obj" && tar czf "$stage/obj.tgz" ./*.o)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d "$stage" ninja
  ls -la "$stage"
}

install() {
  local work=/root/te-compile-fa site ext
  rm -rf "$work" && mkdir -p "$work/obj"
  tar xzf "$stage/fa_src.tar.gz" -C "$work"
  tar xzf "$stage/obj.tgz" -C "$work/obj"
  python3 -m pip install -q --no-deps --no-index "$stage"/ninja-*.whl
  site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  ext=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  FA_WORK=$work python3 - <<'PY'
import glob, os
from torch.utils.cpp_extension import load
work = os.environ["FA_WORK"]
src = f"{work}/csrc/flash_attn"
load(name="flash_attn_2_cuda", sources=[f"{src}/flash_api.cpp"],
     extra_include_paths=[src, f"{src}/src", f"{work}/csrc/cutlass/include"],
     extra_cflags=["-O3", "-std=c++17"], extra_ldflags=sorted(glob.glob(f"{work}/obj/*.o")),
     with_cuda=True, build_directory=work)
PY
  cp "$work/flash_attn_2_cuda.so" "$site/flash_attn_2_cuda$ext"
  cp -r "$work/flash_attn" "$site/"
  mkdir -p "$site/flash_attn-$version.dist-info"  # what TE's version check reads
  printf "Metadata-Version: 2.1\nName: flash-attn\nVersion: %s\n" "$version" \
    > "$site/flash_attn-$version.dist-info/METADATA"
  python3 -c "import torch, flash_attn; print('flash_attn', flash_attn.__version__, \
hasattr(torch.ops.flash_attn, '_flash_attn_forward'))"
}

"$@"
