#!/usr/bin/env bash
# The whole GPU suite in one command, on a machine with a CUDA GPU and TE installed:
#   bash scripts/gpu_suite.sh
# Runs the doctor, the GPU tests and the benchmarks (BENCH=0 skips them); logs go to $OUT (or /tmp/te-compile-gpu);
# a short table comes last. Uses the python3 on PATH (override with PYTHON=...).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/te-compile-gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -m te_compile 2>&1 | tee "$out/doctor.txt"
"$py" -m pytest tests -m gpu -q -p no:cacheprovider -rfEs --junitxml="$out/gpu-tests.xml" \
  "$@" 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
for bench in $([ "${BENCH:-1}" = 1 ] && ls bench/*.py); do
  [ -f "$bench" ] || continue
  echo "== $bench" | tee -a "$out/bench.log"
  "$py" "$bench" 2>&1 | tee -a "$out/bench.log"
done
"$py" - "$out/gpu-tests.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
import torch
try:
    import transformer_engine as te; te_ver = te.__version__
except Exception as e:  # noqa: BLE001
    te_ver = f"unavailable ({e})"
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print("\n| device | torch | TE | passed | failed | errors | skipped |")
print("|---|---|---|---|---|---|---|")
print(f"| {dev} | {torch.__version__} | {te_ver} | {n - f - e - s} | {f} | {e} | {s} |")
PY
exit "$status"
