#!/usr/bin/env bash
# The whole GPU suite in one command, on a machine with a CUDA GPU and TE installed:
#   bash scripts/gpu_suite.sh            (PART=1 or PART=2: one half of the test files, see below)
# Runs the doctor, the GPU tests and the benchmarks (BENCH=0 skips them); logs go to $OUT (or /tmp/te-compile-gpu);
# a short table comes last. Uses the python3 on PATH (override with PYTHON=...).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/te-compile-gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# PARTS="1 2a 2b ..." (on a machine of several GPUs): the listed parts run as a queue, one pytest
# process per GPU: each GPU takes the next part not yet taken when its last one ends (list the
# longest first). Logs in $OUT/part<N>/ and $OUT/part<N>.log; no benchmarks. GPUS=4 overrides
# the count (default: nvidia-smi -L); GPU_LIST="2 3" names the GPUs to use instead. PER_GPU=2 runs two parts side by side on each GPU (on a
# one-GPU machine: PARTS="graph 1" PER_GPU=2). PART_TIMEOUT=S stops a part after S seconds
# (timeout(1)), so a lent machine's call ends with every finished part's report on disk; a
# stopped part's summary counts pytest's progress characters up to the stop and names the test
# it was in (part<N>/progress.txt has every test's seconds). QUEUE_TIMEOUT=S
# bounds the whole queue: each part stops by then, and a part not started QUEUE_MARGIN s (60)
# before it is reported as not started (session 55: four parts under PART_TIMEOUT=470, two per worker, ran
# past the 560-s call that held them, and the call returned no report).
progress_of() {  # pytest's -q progress lines in log $1, as counts
  grep -E '^[.sFExX]+( +\[ *[0-9]+%\])?$' "$1" | tr -cd '.sFExX' | fold -w1 | LC_ALL=C sort | uniq -c |
    awk 'BEGIN { n["."]="passed"; n["s"]="skipped"; n["F"]="failed"; n["E"]="errors";
                 n["x"]="xfailed"; n["X"]="xpassed" }
         { printf "%s%d %s", (NR > 1 ? ", " : ""), $1, n[$2] }'
}
running_at_stop() {  # the test a stopped part was in (tests/conftest.py's progress file $1)
  [ -f "$1" ] && awk -F'\t' -v now="$(date +%s)" '
    $1 == "started" { last = $3; since = $2; next } { ended[$3] = 1 }
    END { if (last != "" && !(last in ended)) printf "%s (for %d s)", last, now - since }' "$1"
}
# A part is a label of the case statement below; a misspelt one is refused before anything
# runs (session 37's "loops", for loops1/loops2, had run the whole suite until its stop).
known_part() { grep -qE "^  ([a-z0-9]+ \| )*$1( \| [a-z0-9]+)*\)" "$root/scripts/gpu_suite.sh"; }
for part in ${PARTS:-${PART:-all}}; do
  known_part "$part" || { echo "gpu_suite.sh: no part named $part (the case labels in scripts/gpu_suite.sh)" >&2; exit 2; }
done
if [ -n "${PARTS:-}" ]; then
  gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  [ "$gpus" -ge 1 ] || gpus=1
  read -ra gpu_ids <<<"${GPU_LIST:-$(seq -s ' ' 0 $((gpus - 1)))}"
  gpus=${#gpu_ids[@]}
  per_gpu=${PER_GPU:-1}
  claims=$(mktemp -d) status=0 pids=()
  deadline=$((SECONDS + ${QUEUE_TIMEOUT:-0}))
  worker() {  # $1: the GPU, then pytest's arguments; claims a part by creating its marker
    local gpu=$1 limit left  # (mkdir is atomic)
    shift
    for part in $PARTS; do
      limit=${PART_TIMEOUT:-0}  # 0: timeout(1)'s "no limit"
      if [ "${QUEUE_TIMEOUT:-0}" -gt 0 ]; then
        left=$((deadline - SECONDS))
        [ "$left" -ge "${QUEUE_MARGIN:-60}" ] || break  # parts not claimed stay "not started"
        if [ "$limit" -eq 0 ] || [ "$limit" -gt "$left" ]; then limit=$left; fi
      fi
      mkdir "$claims/$part" 2>/dev/null || continue
      echo "GPU $gpu: PART=$part from $(date +%T)" >>"$out/queue.log"
      PARTS= PART=$part BENCH=0 OUT="$out/part$part" CUDA_VISIBLE_DEVICES=$gpu \
        timeout "$limit" bash "$root/scripts/gpu_suite.sh" "$@" \
        >"$out/part$part.log" 2>&1 || echo "$part" >>"$claims/failed"
      echo "GPU $gpu: PART=$part done $(date +%T)" >>"$out/queue.log"
    done
  }
  for ((w = 0; w < gpus * per_gpu; w++)); do
    worker "${gpu_ids[$((w / per_gpu))]}" "$@" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  [ -s "$claims/failed" ] && status=1
  for part in $PARTS; do  # pytest's own count
    if [ ! -d "$claims/$part" ]; then
      echo "PART=$part: not started (QUEUE_TIMEOUT)"
      continue
    fi
    count=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|errors?)( |,|$)' \
      "$out/part$part.log" | tail -1)
    if [ -z "$count" ]; then
      count="no pytest summary (stopped by PART_TIMEOUT, or crashed)"
      progress=$(progress_of "$out/part$part.log")
      [ -n "$progress" ] && count="$count; progress before the stop: $progress"
      running=$(running_at_stop "$out/part$part/progress.txt")
      [ -n "$running" ] && count="$count; running at the stop: $running"
    fi
    echo "PART=$part: $count"
  done
  rm -rf "$claims"
  exit $status
fi
"$py" -m te_compile 2>&1 | tee "$out/doctor.txt"
# PART=1 / PART=2: the suite in two halves that each fit a lent machine's 10-minute call
# (te.Linear, autocast, CUDA graphs, norms, TF32; then the layers, attention and models);
# PART=3: the per-tensor cases again on TE's kernels (below); PART=graph, PART=stack: below.
# The training-stack files (checkpoint, CUDA-graph loops) and graph_fp8 run in calls of
# their own: docs/gpu.md.
g=tests/gpu
case "${PART:-all}" in
  1) files=($g/test_linear_gpu.py $g/test_linear_options_gpu.py $g/test_linear_split_gpu.py
            $g/test_linear_training_gpu.py $g/test_autocast_gpu.py $g/test_cudagraphs_gpu.py
            $g/test_norm_gpu.py $g/test_tf32_capture_gpu.py $g/test_aten_gemm_gpu.py
            $g/test_resume_gpu.py $g/test_deferred_update_gpu.py) ;;
  2) files=($g/test_layernorm_linear_gpu.py $g/test_layernorm_mlp_gpu.py
            $g/test_transformer_layer_gpu.py $g/test_attention_gpu.py $g/test_models_gpu.py
            $g/test_fp8_params_gpu.py $g/test_step_memory_gpu.py) ;;
  # PART=2 in two halves (about 5 minutes each on an H100), for a queue over several GPUs.
  2a) files=($g/test_layernorm_linear_gpu.py $g/test_layernorm_mlp_gpu.py $g/test_step_memory_gpu.py) ;;
  2b) files=($g/test_transformer_layer_gpu.py $g/test_attention_gpu.py $g/test_models_gpu.py
             $g/test_fp8_params_gpu.py) ;;
  # PART=2b in two (session 28 on an H100: the TransformerLayer file alone ran 530 s and more,
  # its four varying-length cases about 75 s each)
  2c) files=($g/test_transformer_layer_gpu.py) ;;
  2d) files=($g/test_attention_gpu.py $g/test_models_gpu.py $g/test_fp8_params_gpu.py) ;;
  # Per-tensor recipes' small GEMMs take the graph path by default: PART=3 runs their
  # cases once more on TE's kernels (graph_fp8=False).
  3) export TE_COMPILE_GRAPH_FP8=0
     files=($g/test_linear_gpu.py $g/test_linear_training_gpu.py $g/test_cudagraphs_gpu.py
            $g/test_layernorm_linear_gpu.py $g/test_layernorm_mlp_gpu.py
            $g/test_transformer_layer_gpu.py $g/test_models_gpu.py -k "current or delayed") ;;
  # The CUDA-graph loops on TE's kernels: under mode="reduce-overhead" docs/training.md
  # recommends graph_fp8=False, so the loop orders run on that path too (session 48's stack
  # failure there was a process's first compile: session 49).
  # test_first_compile_gpu.py: a process's first compile with dropout (session 50).
  3loops) export TE_COMPILE_GRAPH_FP8=0
     files=($g/test_cudagraph_loops_gpu.py $g/test_first_compile_gpu.py -k "current or delayed") ;;
  # The graph path's own files, and the training-stack files (CUDA-graph loops, checkpointing):
  # each about 5-8 minutes on an H100 whole; `-k delayed` and the like cut them down.
  graph) files=($g/test_graph_fp8_gpu.py $g/test_graph_fp8_layers_gpu.py $g/test_graph_fp8_norm_gpu.py
    $g/test_gpt_blocks_gpu.py $g/test_graph_dbias_gpu.py $g/test_history_kernel_gpu.py
    $g/test_history_graph_ops_gpu.py) ;;
  # PART=graph in two (session 28 on an H100: graph_fp8's two files over 530 s, the GPT blocks about 340 s)
  graph1) files=($g/test_graph_fp8_gpu.py $g/test_graph_fp8_layers_gpu.py $g/test_graph_fp8_norm_gpu.py) ;;
  # PART=graph1 in two (session 59: 488 of its 509 cases in a call beside another part)
  graph1a) files=($g/test_graph_fp8_gpu.py) ;;
  graph1b) files=($g/test_graph_fp8_layers_gpu.py $g/test_graph_fp8_norm_gpu.py) ;;
  gpt) files=($g/test_gpt_blocks_gpu.py) ;;
  # The `aten_block_gemm` option (off until this part passes: session 59): block-scaled GEMMs
  # through aten against TE's, and a TransformerLayer trained with them against eager TE
  atenblock) files=($g/test_aten_gemm_gpu.py -k block) ;;
  # The `graph_dbias` option (off by default): its sum against TE's kernel, modules trained
  dbias) files=($g/test_graph_dbias_gpu.py) ;;
  # `triton_history_update` (on by default since session 43): its kernel against TE's update,
  # modules trained with it on, and with it off (the graph operations)
  history) files=($g/test_history_kernel_gpu.py $g/test_history_graph_ops_gpu.py) ;;
  stack) files=($g/test_cudagraph_loops_gpu.py $g/test_checkpoint_gpu.py $g/test_first_compile_gpu.py) ;;
  # PART=stack in parts of at most about 9 minutes each on an H100 (session 21's timings)
  checkpoint) files=($g/test_checkpoint_gpu.py) ;;
  # The checkpoint file's CUDA-graph cases alone (sessions 58 and 59: the whole file, beside
  # other parts, did not reach `under_cuda_graphs[delayed]` within a 10-minute call)
  checkpointcg) files=($g/test_checkpoint_gpu.py -k under_cuda_graphs) ;;
  loops1) files=($g/test_cudagraph_loops_gpu.py -k whatever_ran_before) ;;
  loops2) files=($g/test_cudagraph_loops_gpu.py -k transformer_stack) ;;
  # PART=loops1 in two (sessions 58 and 59: 17-18 of its 20 cases in a call beside other parts)
  loops1a) files=($g/test_cudagraph_loops_gpu.py -k "whatever_ran_before and (delayed or current)") ;;
  loops1b) files=($g/test_cudagraph_loops_gpu.py -k "whatever_ran_before and (block or none)") ;;
  # HF transformers + accelerate (skips without them: docs/gpu.md brings them as wheels);
  # about 2 minutes on an H100 (session 25)
  hf) files=($g/test_hf_gpu.py) ;;
  # examples/distributed_gpt.py on one rank (FSDP2 and DDP, one GPU; about 2 minutes)
  dp1) files=($g/test_fsdp2_one_rank_gpu.py) ;;
  # Inductor's C++ wrapper (docs/training.md): the layers bit for bit against eager TE with the
  # wrapper on. torch 2.11 takes it only as the global setting (pytorch#178845).
  cppwrapper) export TORCHINDUCTOR_CPP_WRAPPER=1
     files=($g/test_graph_fp8_layers_gpu.py $g/test_attention_gpu.py -k "not large") ;;
  # PART=cppwrapper in two (sessions 58 and 59: 34-39 of its 67 cases in a call beside others)
  cppwrapper1) export TORCHINDUCTOR_CPP_WRAPPER=1
     files=($g/test_graph_fp8_layers_gpu.py -k "not large") ;;
  cppwrapper2) export TORCHINDUCTOR_CPP_WRAPPER=1
     files=($g/test_attention_gpu.py -k "not large") ;;
  # PART=cppwrapper1 in two (session 60: 33 of its 39 cases in a call beside cppwrapper2; the
  # two CUDA-graph stacks compile longest)
  cppwrapper1a) export TORCHINDUCTOR_CPP_WRAPPER=1
     files=($g/test_graph_fp8_layers_gpu.py -k "not large and not stack and not transpos") ;;
  cppwrapper1b) export TORCHINDUCTOR_CPP_WRAPPER=1
     files=($g/test_graph_fp8_layers_gpu.py -k "stack or transpos") ;;
  # The files that need 2 or more GPUs (torchrun inside; they skip with one): not in a PARTS
  # queue, whose parts see one GPU each. DDP/FSDP2 about 10 minutes, tensor parallel about 2.
  multi) files=($g/test_amax_group_gpu.py $g/test_tensor_parallel_gpu.py $g/test_distributed_gpu.py) ;;
  # PART=multi in two for a lent machine's 10-minute calls (session 53 on 2 x H200: the first
  # 2.7 minutes; the second about 10 alone, so give it a call of its own)
  multi1) files=($g/test_amax_group_gpu.py $g/test_tensor_parallel_gpu.py) ;;
  multi2) files=($g/test_distributed_gpu.py) ;;
  # Not tests: issue 20's benchmark (bench/suite.py; torchao's stacks skip without torchao:
  # docs/performance.md brings it as a wheel), then its target table (bench/targets.py), and
  # session 28's diagnosis of DelayedScaling over varying lengths. Each alone on its GPU
  # (timings). PART=bench: the two small shapes, about 5 minutes each on an H100 (session 34),
  # so PART=bench1024 and PART=bench2048 for a lent machine's 10-minute calls; PART=guide: TE's
  # guide layer with the guide's recipe (under 2 minutes). bench/targets.py over the calls'
  # JSON files together gives the whole table.
  bench | bench1024 | bench2048 | guide)
    steps=(--warmup 3 --steps 20)
    case "$PART" in
      bench) shapes=1024x512x4x1,2048x1024x4x2 ;;
      bench1024) shapes=1024x512x4x1 ;;
      bench2048) shapes=2048x1024x4x2 ;;
      guide) shapes=4096x2048x1x8 ;;
    esac
    if [ "$PART" = guide ]; then
      recipes=(--head-dim 128 --recipes guide)
    else
      recipes=(--head-dim 64 --recipes current,delayed,block)
    fi
    "$py" bench/suite.py --stacks te-transformer,torch-transformer,torchao-transformer "${steps[@]}" \
      "${recipes[@]}" --shapes "$shapes" --json "$out/$PART.json" --plots "$out" "$@" 2>&1 |
      tee "$out/$PART.log"
    status=${PIPESTATUS[0]}
    files=("$out/$PART.json")
    # The small shapes again under CUDA graphs with the setting docs/training.md gives for them
    # (configure(graph_fp8=False): TE's kernels), beside plain bf16 in the same process (session
    # 52: the graph path's default is the slower one there). About 2 minutes.
    if [ "$PART" != guide ]; then
      "$py" bench/suite.py --stacks te-transformer,torch-transformer "${steps[@]}" --head-dim 64 \
        --recipes current-tekernels,delayed-tekernels --modes reduce-overhead --shapes "$shapes" \
        --json "$out/$PART-cudagraphs.json" --plots "$out/cudagraphs" 2>&1 |
        tee "$out/$PART-cudagraphs.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      files+=("$out/$PART-cudagraphs.json")
    fi
    "$py" bench/targets.py "${files[@]}" | tee -a "$out/$PART.log"
    exit "$status" ;;
  # Not tests: default mode with inductor's defaults, combo kernels, no output size asserts
  # (session 37's cProfile: 279-379 checks per step) and the C++ wrapper, TE
  # against torchao, in one process with the variants timed in alternating rounds (bench/ab.py;
  # separate processes drift more than these effects, session 36). Short kernel names, here
  # until session 37, gave no step-time gain in sessions 36 and 37. RECIPE=current and
  # SHAPE=1024x512x4x1 by default; session 37 on an H200, five variants: 2.5 minutes for
  # current scaling with --rounds 10 (caches warm), 4 for DelayedScaling with 12.
  # AB_VARIANTS="A B ..." replaces the variants (bench/ab.py's syntax), e.g. session 39's
  # grouped amaxes against one by one: "te-transformer/current
  # te-transformer/current%te_compile.graph_fp8.quantize._ONE_KERNEL_ROWS=0".
  ab)
    r=${RECIPE:-current}
    variants=(te-transformer/$r te-transformer/$r@combo_kernels=1 te-transformer/$r@size_asserts=0
              te-transformer/$r@cpp_wrapper=1 torchao-transformer torchao-transformer@cpp_wrapper=1)
    [ -n "${AB_VARIANTS:-}" ] && read -ra variants <<<"$AB_VARIANTS"
    "$py" bench/ab.py --shape "${SHAPE:-1024x512x4x1}" --mode "${MODE:-compile}" --head-dim 64 \
      "${variants[@]/#/--variant=}" --json "$out/ab-$r.json" "$@" 2>&1 |
      tee "$out/ab-$r.log"
    exit "${PIPESTATUS[0]}" ;;
  diag) "$py" bench/varying_length_parity.py "$@" 2>&1 | tee "$out/diag.log"
        exit "${PIPESTATUS[0]}" ;;
  # Session 48's open failure (DelayedScaling on TE's kernels under CUDA graphs): where the
  # stack's CUDA-graph steps part from default mode; bench/cudagraph_parity.py's flags bisect.
  cgparity) "$py" bench/cudagraph_parity.py "$@" 2>&1 | tee "$out/cgparity.log"
        exit "${PIPESTATUS[0]}" ;;
  all) files=(tests) ;;
  *) echo "gpu_suite.sh: no part named $PART" >&2; exit 2 ;;  # refused above already
esac
: >"$out/progress.txt"  # each test's start and end as they happen (tests/conftest.py)
TE_COMPILE_TEST_PROGRESS="$out/progress.txt" \
  "$py" -m pytest "${files[@]}" -m gpu -q -p no:cacheprovider -rfEs --junitxml="$out/gpu-tests.xml" \
  "$@" 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
for bench in $([ "${BENCH:-1}" = 1 ] && ls bench/*.py); do
  [ -f "$bench" ] || continue
  # diagnoses run on their own; ab.py, targets.py, profile_split.py and profile_ops.py need arguments (PART=ab,
  # the bench parts, profile_step.py's files)
  case "$bench" in
    bench/gpt_parity.py | bench/varying_length_parity.py | bench/fsdp2_delayed_probe.py) continue ;;
    bench/cudagraph_parity.py | bench/attention_probe.py | bench/issue_time_probe.py) continue ;;
    bench/ab.py | bench/targets.py | bench/profile_split.py | bench/profile_ops.py) continue ;;
  esac
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
