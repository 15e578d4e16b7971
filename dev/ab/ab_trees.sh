#!/usr/bin/env bash
# Two source trees built side by side and one benchmark timed in turns (a, b, a, b, ...),
# so that a restructure is compared against the machine's drift, not across calls.
#   A=path/to/old/tree B=. ROUNDS=2 A_ARGS="..." B_ARGS="..." bash dev/ab/ab_trees.sh benchmarks/bench_moe.py
# Each tree runs its own copy of the script (the path is relative to the tree).  Builds are
# kept in $WORK between calls on a warm machine.  The JSON of each run goes to $OUT/ab/<tree><round>/;
# dev/ab/ab_compare.py prints b / a per row for every *_ms field.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: A=DIR B=DIR bash dev/ab/ab_trees.sh SCRIPT [ARGS...]"; exit 2; }
OUT=${OUT:-$PWD/gpu_out}; ROUNDS=${ROUNDS:-2}; PY=${PY:-python3}; WORK=${AB_WORK:-/tmp/samoyeds_ab}
export PYTHONUNBUFFERED=1 SAMOYEDS_CUDA_ARCHS=${SAMOYEDS_CUDA_ARCHS:-90a}
ROOT=$PWD; TAG=${AB_TAG:-$(basename "$1" .py)}
mkdir -p "$WORK" "$OUT/ab"
jobs=$(( $(nproc) > 1 ? $(nproc) / 2 : 1 ))
for t in a b; do
  src=$([ $t = a ] && echo "${A:?set A}" || echo "${B:?set B}")
  if [ ! -f "$WORK/$t/.built" ]; then
    rm -rf "$WORK/$t" && mkdir -p "$WORK/$t"
    tar -C "$src" --exclude=./build --exclude=./.ab --exclude=./.gpu --exclude=./.git --exclude='./samoyeds/_C*.so' -cf - . \
      | tar -C "$WORK/$t" -xf -
    (cd "$WORK/$t" && SAMOYEDS_BUILD_JOBS=$jobs $PY setup.py -q build_ext --inplace > "$OUT/ab/build_$t.log" 2>&1 \
      && touch .built) &
  fi
done
wait
for t in a b; do [ -f "$WORK/$t/.built" ] || { echo "build $t failed"; tail -30 "$OUT/ab/build_$t.log"; exit 1; }; done
for r in $(seq 1 "$ROUNDS"); do
  for t in a b; do
    args=$([ $t = a ] && echo "${A_ARGS:-}" || echo "${B_ARGS:-}")
    d="$OUT/ab/$TAG/$t$r"; mkdir -p "$d"
    (cd "$WORK/$t" && PYTHONPATH="$WORK/$t" $PY "$@" $args --out "$d") > "$d.log" 2>&1 \
      || { echo "round $r tree $t failed:"; tail -20 "$d.log"; exit 1; }
    echo "round $r tree $t: done"
  done
done
$PY "$ROOT/dev/ab/ab_compare.py" "$OUT/ab/$TAG" | tee "$OUT/ab/$TAG.txt"
