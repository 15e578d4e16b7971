#!/bin/bash
# One two-GPU call: build for sm_90a, then benchmarks/bench_ep.py as given in EP_ARGS (one
# invocation per ';'-separated item, each merged into $OUT/res/ep.json).
#   EP_ARGS="--models mixtral-8x7b --ep 2 --cache static --dynamic-shapes; --models mixtral-8x7b --ep 1 --cache" \
#     bash dev/lab/ep_run.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 SAMOYEDS_CUDA_ARCHS=90a SAMOYEDS_BUILD_JOBS=${SAMOYEDS_BUILD_JOBS:-32} NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/res"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
IFS=';' read -ra RUNS <<< "${EP_ARGS:?}"
for a in "${RUNS[@]}"; do
  echo "== bench_ep.py $a  ($(( $(date +%s) - t0 )) s)"
  python3 benchmarks/bench_ep.py $a --merge --out "$OUT/res" 2>&1 \
    | grep --line-buffered -v "Warning\|warn(\|_warn_once\|USDT\|output = func\|^\*\*\*\|OMP_NUM_THREADS\|^$\|match nothing" | tee -a "$OUT/ep.log"
done
echo "done: $(( $(date +%s) - t0 )) s"
