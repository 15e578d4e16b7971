#!/usr/bin/env bash
# Builds samoyeds._C (the C reference, no CUDA) with AddressSanitizer and UBSan in a
# temporary copy of the tree, then runs the C-heavy tests and the fuzzer under it
# (issue 44).  Any sanitizer report aborts the process: the step fails.
#
#   bash dev/sanitize/run.sh                 # fuzzer 60 s (SAMOYEDS_FUZZ_SECONDS), random seed
#   SAMOYEDS_FUZZ_SECONDS=120 SAMOYEDS_FUZZ_SEED=7 bash dev/sanitize/run.sh
#   SANITIZE_TESTS="tests/test_ssmm.py" bash dev/sanitize/run.sh
#
# Python itself is not instrumented: libasan (and libubsan) are preloaded, leak detection is
# off (CPython's interned objects live to exit), and the extension is built with
# -fno-sanitize-recover so that the first report aborts.  Needs gcc (or CC) with libasan.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PY:-python3}
CC=${CC:-gcc}
FUZZ_SECONDS=${SAMOYEDS_FUZZ_SECONDS:-60}
FUZZ_SEED=${SAMOYEDS_FUZZ_SEED:-$RANDOM$RANDOM}
TESTS=${SANITIZE_TESTS:-"tests/test_c_safety.py tests/test_format.py tests/test_ssmm.py tests/test_moe_ops.py
  tests/test_moe.py tests/test_dlpack.py tests/test_errors.py tests/test_router.py tests/test_dense_decode.py
  tests/test_c_config.py tests/test_leaks.py tests/test_threads.py tests/test_train.py tests/test_glu_backward.py"}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/samoyeds-sanitize.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
# the working tree as git sees it (tracked and untracked, not ignored): no stale build outputs
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 tar -cf - --ignore-failed-read) | tar -xf - -C "$TMP"
cd "$TMP"

SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
t0=$(date +%s)
SAMOYEDS_SKIP_CUDA=1 CC=$CC CFLAGS="$SAN" LDFLAGS="-fsanitize=address,undefined" \
  $PY setup.py -q build_ext --inplace > build.log 2>&1 || { tail -30 build.log; exit 1; }
echo "sanitize: built with $SAN in $(( $(date +%s) - t0 )) s"

export PYTHONPATH="$TMP${PYTHONPATH:+:$PYTHONPATH}"   # the instrumented build, never an installed samoyeds
export LD_PRELOAD="$($CC -print-file-name=libasan.so):$($CC -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1
# the extension really is instrumented (else the run proves nothing)
$PY -c "import samoyeds._C as C, subprocess, sys; \
out = subprocess.run(['nm', '-D', C.__file__], capture_output=True, text=True).stdout; \
sys.exit(0 if '__asan_report' in out and '__ubsan_handle' in out else 'samoyeds._C is not instrumented')"

status=0
t0=$(date +%s)
set +e
# shellcheck disable=SC2086
$PY -m pytest $TESTS -q -p no:cacheprovider > tests.log 2>&1
rc_tests=$?
t1=$(date +%s)
$PY tests/fuzz/run.py --seconds "$FUZZ_SECONDS" --seed "$FUZZ_SEED" --trace > fuzz.log 2>&1
rc_fuzz=$?
set -e
tail -15 tests.log
echo "sanitize: tests rc=$rc_tests in $(( t1 - t0 )) s"
grep -v '^  ' fuzz.log | grep -E '^(category|[a-z]+ +[0-9]+ +[0-9]+|total|exceptions|seed|FAILURE)' | tail -20
[ "$rc_fuzz" = 0 ] || grep '^case ' fuzz.log | tail -1   # the case a crash stopped at
echo "sanitize: fuzzer (seed $FUZZ_SEED) rc=$rc_fuzz in $(( $(date +%s) - t1 )) s"
reports=$(cat tests.log fuzz.log | grep -cE 'ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer' || true)
echo "sanitize: sanitizer reports: $reports"
if [ "$reports" != 0 ]; then
  grep -E -A30 'ERROR: AddressSanitizer|runtime error:' tests.log fuzz.log | head -80
fi
[ "$rc_tests" = 0 ] && [ "$rc_fuzz" = 0 ] && [ "$reports" = 0 ] || status=1
exit $status
