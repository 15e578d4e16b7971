"""The fuzzer's command line (tests/fuzz/fuzz.py):

    python tests/fuzz/run.py --seconds 120 --seed 7 [--only ssmm,packed] [--gpu] [--trace]
    python -m tests.fuzz --seconds 120
    python tests/fuzz/run.py --replay packed:123456      # one case again, with its traceback

Prints the seed first and a table category / cases / failures last; exit status 1
when any case failed (a crash kills the process: rerun with --trace to see the case).
"""
from __future__ import annotations

import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))   # test_dlpack's capsule producer; this package
try:   # the installed samoyeds, or else the source tree built in place
    import samoyeds  # noqa: F401
except ImportError:
    sys.path.insert(1, ROOT)

from fuzz import fuzz  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SAMOYEDS_FUZZ_SECONDS", 10)))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--only", default="", help="comma-separated categories: " + ",".join(fuzz.CATEGORIES))
    ap.add_argument("--gpu", action="store_true", help="GPU mode: CUDA kernels against the C reference")
    ap.add_argument("--max-cases", type=int, default=None)
    ap.add_argument("--trace", action="store_true", help="print every case before running it")
    ap.add_argument("--replay", default=None, help="CATEGORY:CASE_SEED of a FAILURE line")
    a = ap.parse_args(argv)
    if a.replay:
        cat, seed = a.replay.split(":")
        fuzz.replay(cat, int(seed))
        print("no failure")
        return 0
    seed = a.seed if a.seed is not None else int(os.environ.get("SAMOYEDS_FUZZ_SEED", random.randrange(2**31)))
    print(f"samoyeds fuzz: seed {seed}, {a.seconds:g} s{' (gpu)' if a.gpu else ''}", flush=True)
    stats = fuzz.run(a.seconds, seed, [c for c in a.only.split(",") if c] or None, gpu=a.gpu, trace=a.trace,
                     max_cases=a.max_cases)
    print(stats.table(), flush=True)
    failed = sum(len(v) for v in stats.failures.values())
    print(f"seed {seed}: {sum(stats.cases.values())} cases, {failed} failures", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
