#!/usr/bin/env bash
# Compiles the CUDA kernels for sm_80, sm_86, sm_89 and sm_90a and builds the
# package as one binary for all four (no GPU needed); writes
# benchmarks/results/portability.json.  Arguments go to portability.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PY:-python3}" dev/lab/portability.py "$@"
