#!/usr/bin/env bash
# One call on a GPU machine: build for that GPU, run the GPU tests, optionally
# compute-sanitizer and the benchmarks; a short table last.  Full logs and the
# results JSON go to $OUT (or ./gpu_out).
#   bash benchmarks/gpu_check.sh [test] [test-ssmm] [test-all] [test-k: PYTEST_K=expr] [sanitize]
#                                [reliability: compute-sanitizer memcheck/racecheck/synccheck/initcheck on
#                                 benchmarks/sanitize_cases.py, then the fuzzer's GPU mode, FUZZ_SECONDS=120]
#                                [bench] [bench-quick] [bench-moe] [bench-moe-shared] [bench-sweep]
#                                [bench-breakdown] [bench-e2e] [bench-memory] [bench-decode] [accuracy]
#                                [bench-moe-models: MOE_MODELS=a,b MOE_TOKENS=1,16]
#                                [smoke-gpu] [demo] [stress: STRESS_ARGS="--model M --tokens T"]
#                                [bench-train] [bench-train-breakdown: TRAIN_MODELS=a,b TRAIN_TOKENS=4096]
#                                [dx-check: ssmm_dx's standalone check, dev/dx_check]
# test:  TEST_SHARD=K/N runs every N-th GPU test from the K-th on, TEST_JOBS=J with pytest-xdist;
#   the whole suite takes ~12 minutes with 8 jobs on an H200, over one call's limit: 1/2 then 2/2.
#   TEST_FILES="tests/a.py tests/b.py": those files' GPU tests only (default: all of tests/).
# Probes, profilers and A/B drivers live in dev/lab/ (run them directly).
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
    test) run test_gpu 25 $PY -m pytest ${TEST_FILES:-tests} -q -m gpu -p no:cacheprovider \
            ${TEST_SHARD:+--shard $TEST_SHARD} ${TEST_JOBS:+-n $TEST_JOBS} ;;
    test-ssmm) run test_ssmm 25 $PY -m pytest tests/test_ssmm.py -x -q -m gpu -p no:cacheprovider ;;
    test-all) run test_all 25 $PY -m pytest tests -q -p no:cacheprovider ;;
    test-k) run test_k 25 $PY -m pytest tests -x -q -m gpu -p no:cacheprovider -k "${PYTEST_K:?set PYTEST_K}" ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        SAMOYEDS_SANITIZE_TOOL=$tool timeout "${STEP_TIMEOUT:-0}" compute-sanitizer --tool $tool --error-exitcode 9 \
          $PY benchmarks/sanitize_cases.py > "$OUT/sanitize_$tool.log" 2>&1
        summary+=("compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)")
      done ;;
    reliability)
      # issue 44: every compute-sanitizer tool on the sanitizer cases (STEP_TIMEOUT bounds each),
      # then the fuzzer's GPU mode (CUDA kernels against the C reference; seed printed)
      for tool in ${RELIABILITY_TOOLS:-memcheck racecheck synccheck initcheck}; do
        # (no --leak-check: torch's caching allocator keeps its blocks to exit)
        SAMOYEDS_SANITIZE_TOOL=$tool timeout "${STEP_TIMEOUT:-0}" compute-sanitizer --tool $tool \
          --error-exitcode 9 $PY benchmarks/sanitize_cases.py $([ $tool = initcheck ] && echo ours) \
          > "$OUT/reliability_$tool.log" 2>&1
        summary+=("reliability $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
          "$OUT/reliability_$tool.log" | tail -1)")
      done
      # initcheck's control: cuBLAS output read by a torch kernel, no samoyeds code
      compute-sanitizer --tool initcheck $PY dev/sanitize/initcheck_control.py \
        > "$OUT/reliability_initcheck_control.log" 2>&1
      summary+=("initcheck control (no samoyeds code): $(grep -E 'ERROR SUMMARY' \
        "$OUT/reliability_initcheck_control.log" | tail -1)")
      run reliability_fuzz_gpu 14 $PY tests/fuzz/run.py --gpu --seconds "${FUZZ_SECONDS:-120}" \
        --seed "${FUZZ_SEED:-$RANDOM}" ;;
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
    bench-moe-models) run bench_moe_models 30 $PY benchmarks/bench_moe.py --models "${MOE_MODELS:?set MOE_MODELS}" \
      --tokens "${MOE_TOKENS:-1,16}" --out "$OUT" ;;
    stress) run stress_block 12 $PY dev/lab/stress_block.py ${STRESS_ARGS:-} ;;
    smoke-gpu)
      # every benchmark's --tiny mode on the GPU (toy shapes): the CUDA code paths in about a minute
      $PY benchmarks/run_all.py --tiny --device cuda --only kernel,sweep,moe,e2e,memory,breakdown \
        --out "$OUT/tiny" > "$OUT/smoke_gpu.log" 2>&1
      summary+=("smoke-gpu: rc=$? $(tail -8 "$OUT/smoke_gpu.log" | tr '\n' ';')") ;;
    demo) run demo 30 $PY -m samoyeds demo --device cuda --json "$OUT/demo.json" ;;
    bench-train) run bench_train 30 $PY benchmarks/bench_train.py --breakdown --out "$OUT" ;;
    bench-train-breakdown) run bench_train_breakdown 30 $PY benchmarks/bench_train.py --only-breakdown \
      --models "${TRAIN_MODELS:-mixtral-8x7b,olmoe}" --tokens "${TRAIN_TOKENS:-4096}" --out "$OUT" ;;
    dx-check)
      # ssmm_dx's standalone check and timing (dev/dx_check), built apart from the extension
      nvcc -O2 -std=c++17 --expt-relaxed-constexpr -DSAM_ARCHS='"90a"' -I cuda \
        -gencode=arch=compute_90a,code=sm_90a dev/dx_check/dx_check.cu cuda/ssmm_dx.cu cuda/device.cu \
        -o /tmp/dx_check > "$OUT/dx_check_build.log" 2>&1 && run dx_check 25 /tmp/dx_check \
        || summary+=("dx-check: build failed: $(tail -3 "$OUT/dx_check_build.log" | tr '\n' ';')") ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "==== summary ($(date +%s) - $t0 s) ===="
printf '%s\n' "${summary[@]}"
