"""The fuzzer (tests/fuzz/fuzz.py) as a test: it runs in a subprocess so that a crash is a
failure with the case it was on, not the end of pytest.

SAMOYEDS_FUZZ_SECONDS: how long (default 6 s in the normal suite; CI runs 120);
SAMOYEDS_FUZZ_SEED: the seed (default random, printed: rerun with it to reproduce).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

import samoyeds as sm
from conftest import GPU

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _fuzz(*args: str, seconds: float) -> None:
    seed = int(os.environ.get("SAMOYEDS_FUZZ_SEED", random.randrange(2**31)))
    print(f"fuzz seed {seed}")
    cmd = [sys.executable, os.path.join(HERE, "run.py"), "--seconds", str(seconds), "--seed", str(seed),
           "--trace", *args]
    # the samoyeds this test imports (installed, or the source tree built in place), not another
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(sm.__file__)))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=seconds * 3 + 300)
    lines = r.stdout.splitlines()
    cases = [ln for ln in lines if ln.startswith("case ")]
    summary = "\n".join(ln for ln in lines if not ln.startswith("case "))
    if r.returncode < 0 or r.returncode > 1:   # killed by a signal (a crash) or a sanitizer report
        raise AssertionError(f"the fuzzer crashed (rc {r.returncode}) on {cases[-1] if cases else '?'} "
                             f"(seed {seed}; replay: python tests/fuzz/run.py --replay CAT:CASE_SEED)\n"
                             f"{r.stderr[-4000:]}")
    assert r.returncode == 0, f"seed {seed}:\n{summary[-6000:]}\n{r.stderr[-2000:]}"
    print(summary)


def test_fuzz_cpu():
    _fuzz(seconds=float(os.environ.get("SAMOYEDS_FUZZ_SECONDS", 6)))


@pytest.mark.gpu
def test_fuzz_gpu():
    """The CUDA kernels against the C reference on random valid problems (the lead's GPU run)."""
    assert GPU
    _fuzz("--gpu", seconds=float(os.environ.get("SAMOYEDS_FUZZ_SECONDS", 60)))
