#!/usr/bin/env bash
# Two builds of the extension timed in turns on one GPU: the working tree built with the nvcc
# flags FLAGS_A and again with FLAGS_B (two copies, built side by side), then a benchmark run
# ROUNDS times with each build in turn (a, b, a, b, ...), each run writing under $OUT/ab/<build><round>.
# What differs between builds of one kernel (register allocation, a switch compiled in) is
# then timed against the machine's drift, not across calls.
#
#   FLAGS_A="" FLAGS_B="-DSAM_WS_STAGES_M2=6" ROUNDS=3 \
#     bash dev/lab/ab_builds.sh dev/lab/ssmm_kernels.py --S 32768 --fmt samoyeds-1:2:128 --kernels wgmma_ws
#
# AB_BASE_TAR (optional): build a from this tar of a commit instead of the working tree
# (`git archive -o .ab/base.tar REV`, .ab carried): before/after a source change in one call.
#
# AB_CHECK (optional): a command run in build b's copy before any timing (its tests, say,
# PYTHONPATH leading to that copy); if it fails nothing is timed.
#
# The command gets --out DIR appended.  The summary (dev/lab/ab_summary.py) compares every
# *_ms value of the runs' JSON rows: the median over rounds of each build, and b / a.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: FLAGS_A=... FLAGS_B=... [ROUNDS=3] bash dev/lab/ab_builds.sh SCRIPT [ARGS...]"; exit 2; }
OUT=${OUT:-$PWD/gpu_out}
ROUNDS=${ROUNDS:-3}
PY=${PY:-python3}
WORK=${AB_WORK:-/tmp/samoyeds_ab}
export PYTHONUNBUFFERED=1 SAMOYEDS_CUDA_ARCHS=${SAMOYEDS_CUDA_ARCHS:-90a}
ROOT=$PWD
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT/ab"
for b in a b; do
  mkdir -p "$WORK/$b"
  if [ $b = a ] && [ -n "${AB_BASE_TAR:-}" ]; then
    tar -C "$WORK/a" -xf "$AB_BASE_TAR"
  else
    tar -C "$ROOT" --exclude=./build --exclude=./gpu_out --exclude='./samoyeds/_C*.so' --exclude=./.git --exclude=./.ab \
      --exclude=./.whl -cf - . | tar -C "$WORK/$b" -xf -
  fi
done
jobs=$(( $(nproc) > 1 ? $(nproc) / 2 : 1 ))  # each build half the cores
t0=$(date +%s)
(cd "$WORK/a" && SAMOYEDS_BUILD_JOBS=$jobs SAMOYEDS_NVCC_FLAGS="${FLAGS_A:-}" $PY setup.py -q build_ext --inplace > "$OUT/ab/build_a.log" 2>&1) &
pa=$!
(cd "$WORK/b" && SAMOYEDS_BUILD_JOBS=$jobs SAMOYEDS_NVCC_FLAGS="${FLAGS_B:-}" $PY setup.py -q build_ext --inplace > "$OUT/ab/build_b.log" 2>&1) &
pb=$!
wait $pa || { tail -30 "$OUT/ab/build_a.log"; exit 1; }
wait $pb || { tail -30 "$OUT/ab/build_b.log"; exit 1; }
echo "builds: $(( $(date +%s) - t0 )) s (a: '${FLAGS_A:-}', b: '${FLAGS_B:-}')"
for b in a b; do  # each build imports as itself (the script's own folder, not the working tree, leads sys.path)
  (cd /tmp && PYTHONPATH="$WORK/$b" $PY -c "import samoyeds; assert samoyeds.__file__.startswith('$WORK/$b/'), samoyeds.__file__") \
    || { echo "build $b does not import from $WORK/$b"; exit 1; }
done
if [ -n "${AB_CHECK:-}" ]; then
  (cd "$WORK/b" && PYTHONPATH="$WORK/b${PYTHONPATH:+:$PYTHONPATH}" bash -c "$AB_CHECK") > "$OUT/ab/check_b.log" 2>&1
  rc=$?
  echo "check of build b (rc=$rc): $(tail -1 "$OUT/ab/check_b.log")"
  [ $rc -eq 0 ] || { tail -30 "$OUT/ab/check_b.log"; exit 1; }
fi
for r in $(seq 1 "$ROUNDS"); do
  for b in a b; do
    mkdir -p "$OUT/ab/$b$r"
    (cd "$ROOT" && PYTHONPATH="$WORK/$b${PYTHONPATH:+:$PYTHONPATH}" $PY "$@" --out "$OUT/ab/$b$r") > "$OUT/ab/$b$r.log" 2>&1 \
      || { echo "round $r build $b failed:"; tail -20 "$OUT/ab/$b$r.log"; exit 1; }
  done
done
$PY "$ROOT/dev/lab/ab_summary.py" "$OUT/ab" "$ROUNDS" --flags-a="${FLAGS_A:-}" --flags-b="${FLAGS_B:-}"
