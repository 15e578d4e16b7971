#!/usr/bin/env bash
# One call on a GPU machine: build for that GPU, run the GPU tests, optionally
# compute-sanitizer and the benchmarks; a short table last.  Full logs and the
# results JSON go to $OUT (or ./gpu_out).
#   bash benchmarks/gpu_check.sh [test] [sanitize] [bench] [bench-moe] [bench-sweep] [bench-breakdown]
#                                [bench-e2e] [bench-memory] [bench-decode] [ssmm-kernels] [token-stream] [gather-locality] [probe-epilogue] [tc-forms] [fill] [layer-trace] [test-ssmm] [accuracy]
#                                [smoke-gpu] [demo] [profile] [profile-tokens] [bench-moe-shared] [bench-dense] [bench-router] [bench-shared-mlp] [profile-router]
#                                [probe-shared-stream: PROBE_ARGS=...]
#                                [bench-moe-models: MOE_MODELS=a,b MOE_TOKENS=1,16]
#                                [ssmm-kernels: SSMM_KERNELS_ARGS="--fmt F --kernels a,b"]
#                                [gather-locality: GATHER_ARGS="--model M --T N --gm 4,16"]
#                                [test-k: PYTEST_K=expr] [stress: STRESS_ARGS="--model M --tokens T"] ...
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
steps=${*:-test bench}
export PYTHONUNBUFFERED=1 SAMOYEDS_CUDA_ARCHS=${SAMOYEDS_CUDA_ARCHS:-90a} SAMOYEDS_BUILD_JOBS=${SAMOYEDS_BUILD_JOBS:-16}
PY=${PY:-python3}
export SAMOYEDS_COMMIT=${SAMOYEDS_COMMIT:-unknown}

if ! $PY -c "import pytest, hypothesis" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
$PY -m pip install -q --no-build-isolation -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
$PY -c "import samoyeds, json; print(json.dumps(samoyeds.build_info()))"

summary=()
# run LOG LINES CMD...: CMD's output into $OUT/LOG.log, its last LINES lines shown, and
# its exit status with the log's last line in the summary; STEP_TIMEOUT (s) bounds each step
run() {
  local log=$1 lines=$2
  shift 2
  timeout "${STEP_TIMEOUT:-0}" "$@" 2>&1 | tee "$OUT/$log.log" | tail -"$lines"
  summary+=("$log: rc=${PIPESTATUS[0]} $(tail -1 "$OUT/$log.log")")
}
for step in $steps; do
  case $step in
    test) run test_gpu 25 $PY -m pytest tests -x -q -m gpu -p no:cacheprovider ;;
    test-ssmm) run test_ssmm 25 $PY -m pytest tests/test_ssmm.py -x -q -m gpu -p no:cacheprovider ;;
    test-all) run test_all 25 $PY -m pytest tests -q -p no:cacheprovider ;;
    test-k) run test_k 25 $PY -m pytest tests -x -q -m gpu -p no:cacheprovider -k "${PYTEST_K:?set PYTEST_K}" ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        SAMOYEDS_SANITIZE_TOOL=$tool timeout "${STEP_TIMEOUT:-0}" compute-sanitizer --tool $tool --error-exitcode 9 \
          $PY benchmarks/sanitize_cases.py > "$OUT/sanitize_$tool.log" 2>&1
        summary+=("compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)")
      done ;;
    bench) run bench_kernel 60 $PY benchmarks/bench_kernel.py --out "$OUT" ;;
    bench-quick) run bench_kernel 60 $PY benchmarks/bench_kernel.py --quick --out "$OUT" ;;
    bench-moe) run bench_moe 30 $PY benchmarks/bench_moe.py --out "$OUT" ;;
    bench-moe-shared) run bench_moe_shared 12 $PY benchmarks/bench_moe.py --models deepseek-v2-lite --shared-experts --out "$OUT" ;;
    bench-sweep) run bench_sweep 8 $PY benchmarks/bench_sweep.py --out "$OUT" ;;
    bench-breakdown) run bench_breakdown 22 $PY benchmarks/bench_breakdown.py --out "$OUT" ;;
    bench-e2e) run bench_e2e 22 $PY benchmarks/bench_e2e.py --out "$OUT" ;;
    bench-memory) run bench_memory 12 $PY benchmarks/bench_memory.py --out "$OUT" ;;
    accuracy) run accuracy 25 $PY benchmarks/accuracy.py --device cuda --out "$OUT" ;;
    bench-decode) run bench_decode 25 $PY benchmarks/bench_decode.py --out "$OUT" ${DECODE_ARGS:-} ;;
    bench-dense) run bench_dense_decode 30 $PY benchmarks/bench_dense_decode.py --out "$OUT" ;;
    bench-router) run bench_router 12 $PY benchmarks/bench_router.py --out "$OUT" ;;
    bench-shared-mlp) run bench_shared_mlp 12 $PY benchmarks/bench_shared_mlp.py --out "$OUT" ;;
    probe-shared-stream) run probe_shared_stream 12 $PY benchmarks/probe_shared_stream.py --out "$OUT" ${PROBE_ARGS:-} ;;
    bench-moe-models) run bench_moe_models 30 $PY benchmarks/bench_moe.py --models "${MOE_MODELS:?set MOE_MODELS}" \
      --tokens "${MOE_TOKENS:-1,16}" --out "$OUT" ;;
    ssmm-kernels) run ssmm_kernels 12 $PY benchmarks/ssmm_kernels.py --out "$OUT" ${SSMM_KERNELS_ARGS:-} ;;
    stress) run stress_block 12 $PY benchmarks/stress_block.py ${STRESS_ARGS:-} ;;
    token-stream) run token_stream 8 $PY benchmarks/token_stream.py --out "$OUT" ;;
    gather-locality) run gather_locality 12 $PY benchmarks/gather_locality.py --out "$OUT" ${GATHER_ARGS:-} ;;
    probe-epilogue) run probe_epilogue 40 $PY benchmarks/probe_epilogue.py --out "$OUT" ${PROBE_EPI_ARGS:-} ;;
    tc-forms) run tc_forms 12 $PY benchmarks/tc_forms.py --out "$OUT" ;;
    fill) run fill_rate 20 $PY benchmarks/fill_rate.py --out "$OUT" ${FILL_ARGS:-} ;;
    layer-trace) run layer_trace 60 $PY benchmarks/layer_trace.py --out "$OUT" ${LAYER_TRACE_ARGS:-} ;;
    smoke-gpu)
      # every benchmark's --tiny mode on the GPU (toy shapes): the CUDA code paths in about a minute
      $PY benchmarks/run_all.py --tiny --device cuda --only kernel,sweep,moe,e2e,memory,breakdown \
        --out "$OUT/tiny" > "$OUT/smoke_gpu.log" 2>&1
      summary+=("smoke-gpu: rc=$? $(tail -8 "$OUT/smoke_gpu.log" | tr '\n' ';')") ;;
    demo) run demo 30 $PY -m samoyeds demo --device cuda --json "$OUT/demo.json" ;;
    profile)
      # ncu (clocks as they are) on one launch of the default kernel per format, Mixtral-8x7B
      # gate_up at 8192 tokens: the details page and the top warp-stall sites per SASS line
      # (PROFILE_FMTS: the formats; PROFILE_TAG: a suffix of the files, for a second run with
      # other switches in the environment, e.g. SAMOYEDS_WS_DROP)
      for fmt in ${PROFILE_FMTS:-samoyeds-1:2:128 2:4}; do
        tag=${fmt//:/_}${PROFILE_TAG:-}
        timeout "${STEP_TIMEOUT:-0}" ncu --clock-control none -k regex:ssmm --launch-skip 3 --launch-count 1 \
          --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
          --section SchedulerStats -f -o "$OUT/profile_$tag" $PY benchmarks/profile_ssmm.py --fmt $fmt --T 8192 \
          > "$OUT/profile_$tag.log" 2>&1
        ncu -i "$OUT/profile_$tag.ncu-rep" --page details > "$OUT/profile_${tag}_details.txt" 2>&1
        ncu -i "$OUT/profile_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/profile_${tag}_src.csv" 2>&1
        $PY benchmarks/ncu_top.py "$OUT/profile_${tag}_src.csv" --top 40 --by-opcode > "$OUT/profile_${tag}_top.txt" 2>&1
        rm -f "$OUT/profile_$tag.ncu-rep"
        [ -n "${PROFILE_KEEP_SRC:-}" ] || rm -f "$OUT/profile_${tag}_src.csv"
        summary+=("profile $fmt: $(head -2 "$OUT/profile_${tag}_top.txt" | tail -1 | cut -c1-160)")
      done ;;
    profile-router)
      # ncu (clocks as they are) on the router's two kernels, DeepSeek-V2-Lite's router at 16384 tokens
      timeout "${STEP_TIMEOUT:-0}" ncu --clock-control none -k regex:router --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
        --section MemoryWorkloadAnalysis -f -o "$OUT/profile_router" $PY benchmarks/profile_router.py \
        ${PROFILE_ROUTER_ARGS:-} > "$OUT/profile_router.log" 2>&1
      ncu -i "$OUT/profile_router.ncu-rep" --page details > "$OUT/profile_router_details.txt" 2>&1
      rm -f "$OUT/profile_router.ncu-rep"
      summary+=("profile-router: $(grep -E '^  [a-z_]+.*router|Duration' "$OUT/profile_router_details.txt" | tr -s ' ' | cut -c1-90 | tr '\n' ';')") ;;
    profile-tokens)
      # ncu (clocks as they are, every section) on Mixtral-8x7B's down projection at 8192 tokens,
      # 1:2:128, its token rows once as TMA boxes and once by the cp.async gather (same rows):
      # what the gather costs inside the kernel
      for tma in 1 0; do
        SAMOYEDS_WGMMA_TOKENS_TMA=$tma timeout "${STEP_TIMEOUT:-0}" ncu --clock-control none -k regex:ssmm \
          --launch-skip 3 --launch-count 1 --set full -f -o "$OUT/profile_tokens_$tma" \
          $PY benchmarks/profile_ssmm.py --proj down --T 8192 > "$OUT/profile_tokens_$tma.log" 2>&1
        ncu -i "$OUT/profile_tokens_$tma.ncu-rep" --page details > "$OUT/profile_tokens_${tma}_details.txt" 2>&1
        ncu -i "$OUT/profile_tokens_$tma.ncu-rep" --page raw --csv > "$OUT/profile_tokens_${tma}_raw.csv" 2>&1
        rm -f "$OUT/profile_tokens_$tma.ncu-rep"
        summary+=("profile-tokens TOKENS_TMA=$tma: $(grep -m1 'Duration' "$OUT/profile_tokens_${tma}_details.txt")")
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "==== summary ($(date +%s) - $t0 s) ===="
printf '%s\n' "${summary[@]}"
