#!/bin/bash
# One two-GPU call: build for sm_90a, then benchmarks/bench_ep.py as given in EP_ARGS (one
# invocation per ';'-separated item, each merged into $OUT/res/ep.json). Give each a --timeout
# (it then keeps the cells it finished): a full-depth static-cache cell takes minutes (docs/lab/ep.md).
#   EP_ARGS="--models mixtral-8x7b --ep 2 --cache static --dynamic-shapes --timeout 400; \
#            --models mixtral-8x7b --ep 1 --impls samoyeds no_moe --cache --timeout 100" bash dev/lab/ep_run.sh
set -uo pipefail
source "$(dirname "$0")/ep_setup.sh"
mkdir -p "$OUT/res"
IFS=';' read -ra RUNS <<< "${EP_ARGS:?}"
for a in "${RUNS[@]}"; do
  echo "== bench_ep.py $a  ($(( $(date +%s) - t0 )) s)"
  python3 benchmarks/bench_ep.py $a --merge --out "$OUT/res" 2>&1 | quiet | tee -a "$OUT/ep.log"
done
echo "done: $(( $(date +%s) - t0 )) s"
