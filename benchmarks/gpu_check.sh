#!/usr/bin/env bash
# One call on a GPU machine: build for that GPU, run the GPU tests, optionally
# compute-sanitizer and the benchmarks; a short table last.  Full logs and the
# results JSON go to $OUT (or ./gpu_out).
#   bash benchmarks/gpu_check.sh [test] [sanitize] [bench] [bench-moe] [bench-sweep] [bench-breakdown]
#                                [bench-e2e] [bench-memory] [bench-decode] [ssmm-kernels] [test-ssmm] [accuracy]
#                                [smoke-gpu] [demo] ...
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
for step in $steps; do
  case $step in
    test)
      $PY -m pytest tests -x -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/test_gpu.log" | tail -25
      summary+=("gpu tests: $(tail -1 "$OUT/test_gpu.log")") ;;
    test-ssmm)
      $PY -m pytest tests/test_ssmm.py -x -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/test_ssmm.log" | tail -25
      summary+=("ssmm gpu tests: $(tail -1 "$OUT/test_ssmm.log")") ;;
    test-all)
      $PY -m pytest tests -q -p no:cacheprovider 2>&1 | tee "$OUT/test_all.log" | tail -25
      summary+=("all tests: $(tail -1 "$OUT/test_all.log")") ;;
    sanitize)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 $PY benchmarks/sanitize_cases.py > "$OUT/sanitize_$tool.log" 2>&1
        summary+=("compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)")
      done ;;
    bench)
      $PY benchmarks/bench_kernel.py --out "$OUT" 2>&1 | tee "$OUT/bench_kernel.log" | tail -60
      summary+=("bench_kernel: see table above") ;;
    bench-quick)
      $PY benchmarks/bench_kernel.py --quick --out "$OUT" 2>&1 | tee "$OUT/bench_kernel.log" | tail -60 ;;
    bench-moe)
      $PY benchmarks/bench_moe.py --out "$OUT" 2>&1 | tee "$OUT/bench_moe.log" | tail -30
      summary+=("bench_moe: see table above") ;;
    bench-sweep)
      $PY benchmarks/bench_sweep.py --out "$OUT" 2>&1 | tee "$OUT/bench_sweep.log" | tail -8
      summary+=("bench_sweep: rc=${PIPESTATUS[0]}") ;;
    bench-breakdown)
      $PY benchmarks/bench_breakdown.py --out "$OUT" 2>&1 | tee "$OUT/bench_breakdown.log" | tail -22
      summary+=("bench_breakdown: rc=${PIPESTATUS[0]}") ;;
    bench-e2e)
      $PY benchmarks/bench_e2e.py --out "$OUT" 2>&1 | tee "$OUT/bench_e2e.log" | tail -22
      summary+=("bench_e2e: rc=${PIPESTATUS[0]}") ;;
    bench-memory)
      $PY benchmarks/bench_memory.py --out "$OUT" 2>&1 | tee "$OUT/bench_memory.log" | tail -12
      summary+=("bench_memory: rc=${PIPESTATUS[0]}") ;;
    accuracy)
      $PY benchmarks/accuracy.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/accuracy.log" | tail -25
      summary+=("accuracy: rc=${PIPESTATUS[0]}") ;;
    bench-decode)
      $PY benchmarks/bench_decode.py --out "$OUT" 2>&1 | tee "$OUT/bench_decode.log" | tail -25
      summary+=("bench_decode: rc=${PIPESTATUS[0]}") ;;
    ssmm-kernels)
      $PY benchmarks/ssmm_kernels.py --out "$OUT" 2>&1 | tee "$OUT/ssmm_kernels.log" | tail -12
      summary+=("ssmm_kernels: rc=${PIPESTATUS[0]}") ;;
    smoke-gpu)
      # every benchmark's --tiny mode on the GPU (toy shapes): the CUDA code paths in about a minute
      $PY benchmarks/run_all.py --tiny --device cuda --only kernel,sweep,moe,e2e,memory,breakdown \
        --out "$OUT/tiny" > "$OUT/smoke_gpu.log" 2>&1
      summary+=("smoke-gpu: rc=$? $(tail -8 "$OUT/smoke_gpu.log" | tr '\n' ';')") ;;
    demo)
      $PY -m samoyeds demo --device cuda --json "$OUT/demo.json" 2>&1 | tee "$OUT/demo.log" | tail -30
      summary+=("demo: rc=$?") ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "==== summary ($(date +%s) - $t0 s) ===="
printf '%s\n' "${summary[@]}"
