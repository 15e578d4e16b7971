#!/bin/bash
# One two-GPU call: build for sm_90a, then dev/lab/ep_profile.py at EP = 1 and 2.
#   MODELS="mixtral-8x7b:8 qwen3-30b-a3b:12" STATIC="1" bash dev/lab/ep_profile.sh
set -uo pipefail
source "$(dirname "$0")/ep_setup.sh"
for spec in ${MODELS:-mixtral-8x7b:8}; do
  m=${spec%%:*}; L=${spec##*:}
  echo "== $m, $L layers, EP 1"
  timeout ${T1:-200} python3 dev/lab/ep_profile.py --model "$m" --layers "$L" --out "$OUT" 2>&1 | quiet
  echo "== $m, $L layers, EP 2"
  timeout ${T2:-400} python3 -m torch.distributed.run --standalone --nproc-per-node 2 dev/lab/ep_profile.py \
    --model "$m" --layers "$L" --out "$OUT" --static ${STATIC:-} 2>&1 | quiet
done
