#!/bin/bash
# One two-GPU call: build for sm_90a, then dev/lab/ep_profile.py at EP = 1 and 2.
#   MODELS="mixtral-8x7b:8 qwen3-30b-a3b:12" STATIC="1" bash dev/lab/ep_profile.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 SAMOYEDS_CUDA_ARCHS=90a SAMOYEDS_BUILD_JOBS=${SAMOYEDS_BUILD_JOBS:-32} NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
filter() { grep --line-buffered -v "Warning\|USDT\|output = func\|^\*\*\*\|OMP_NUM_THREADS\|^$"; }
for spec in ${MODELS:-mixtral-8x7b:8}; do
  m=${spec%%:*}; L=${spec##*:}
  echo "== $m, $L layers, EP 1"
  timeout ${T1:-200} python3 dev/lab/ep_profile.py --model "$m" --layers "$L" --out "$OUT" 2>&1 | filter
  echo "== $m, $L layers, EP 2"
  timeout ${T2:-400} python3 -m torch.distributed.run --standalone --nproc-per-node 2 dev/lab/ep_profile.py \
    --model "$m" --layers "$L" --out "$OUT" --static ${STATIC:-} 2>&1 | filter
done
