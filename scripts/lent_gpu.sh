#!/usr/bin/env bash
# One call on a lent GPU machine (docs/gpu.md, "On this project's lent GPU machines"), after the
# calls that carried TE's parts to /root/te:
#
#   bash scripts/lent_gpu.sh install tests        (PARTS="checkpoint loops1" and the like)
#   BPART="bench2048 guide" bash scripts/lent_gpu.sh bench
#
# Steps, in the order given:
#   install  TE (/root/te/small/install_te.sh, once per machine), then the wheels the call
#            carries: torchao and matplotlib from .whl/, transformers and accelerate from
#            .te-stage/hf/ (docs/gpu.md, docs/performance.md say how to download them)
#   tests    scripts/gpu_suite.sh's queue of $PARTS, PER_GPU (default 2) at a time per GPU,
#            bounded so that the call ends with every part's report: QUEUE_TIMEOUT defaults to
#            what is left of CALL_S (600, the lent machine's call limit) less 30 s
#   bench    PART=p of scripts/gpu_suite.sh for each p of $BPART, one after another (bench1024,
#            bench2048, guide; default bench1024), all in one bench.tgz
#   memory   bench/step_memory.py --case guide, every variant (VARIANTS=... to choose)
# Each step writes under /root/lent/<step> and packs that folder into one $OUT/<step>.tgz (a
# call brings back at most 8 files): `tar xzf` it here.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/lent-out}
work=/root/lent
mkdir -p "$out" "$work"
call_s=${CALL_S:-600}
status=0
pack() { tar czf "$out/$1.tgz" -C "$work" "$1"; }
for step in "$@"; do
  echo "=== $step $(date +%T) (${SECONDS}s into the call)"
  dir=$work/$step
  rm -rf "$dir" && mkdir -p "$dir"
  case "$step" in
    install)
      python3 -c "import transformer_engine.pytorch" 2>/dev/null ||
        bash /root/te/small/install_te.sh >"$dir/install.log" 2>&1 || { tail -20 "$dir/install.log"; exit 1; }
      for wheels in .whl .te-stage/hf; do
        ls "$wheels"/*.whl >/dev/null 2>&1 &&
          python3 -m pip install -q --no-deps --no-index "$wheels"/*.whl >>"$dir/install.log" 2>&1
      done
      python3 -W ignore -c "import torch, transformer_engine as te
try:
    import torchao; ao = torchao.__version__
except ImportError:
    ao = 'no torchao'
print(torch.__version__, 'TE', te.__version__, ao, torch.cuda.get_device_name())" | tee -a "$dir/install.log" ;;
    tests)
      left=$((call_s - SECONDS - 30))
      PER_GPU=${PER_GPU:-2} QUEUE_TIMEOUT=${QUEUE_TIMEOUT:-$left} OUT=$dir \
        bash scripts/gpu_suite.sh | tee "$dir/summary.txt" || status=1
      pack "$step" ;;
    bench)
      for part in ${BPART:-bench1024}; do  # each part names its files after itself
        PART=$part OUT=$dir bash scripts/gpu_suite.sh 2>&1 | tail -40 || status=1
      done
      pack "$step" ;;
    memory)
      variants=${VARIANTS:-eager,compile,reduce-overhead,reduce-overhead-static}
      python3 -W ignore bench/step_memory.py --case guide --recipes "${RECIPES:-delayed}" \
        --variants "$variants" 2>&1 | tee "$dir/step-memory-guide.log" | tail -8 || status=1
      pack "$step" ;;
    *) echo "lent_gpu.sh: no step named $step (install, tests, bench, memory)" >&2; exit 2 ;;
  esac
done
echo "=== end $(date +%T) (${SECONDS}s)"
exit $status
