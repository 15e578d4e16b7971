"""Several threads calling the ops at once (issue 44): the extension releases the GIL while
it computes, keeps no per-call state outside the call (module state is read-only during a
call; the reference's error message is thread-local), so every result equals the
single-threaded one and every thread's error names its own defect."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import samoyeds as sm
from samoyeds.moe import moe_forward

THREADS, ROUNDS = 6, 40


def _problems(seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for i, fmt in enumerate(["3:8:32", "samoyeds-1:2:64", "2:4", "1:4:64"]):
        E, I, H, T, K = 3, 8 * (i + 1), 64, 7 + i, 2
        gu = sm.pack(rng.standard_normal((E, 2 * I, H)).astype(np.float32), fmt, glu=True)
        dn = sm.pack(rng.standard_normal((E, H, I)).astype(np.float32), fmt)
        x = rng.standard_normal((T, H)).astype(np.float32)
        topk = rng.integers(-1, E + 1, (T, K)).astype(np.int64)
        tw = rng.random((T, K)).astype(np.float32)
        w = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
        out.append((fmt, gu, dn, x, topk, tw, w))
    return out


def _work(prob, which: int):
    fmt, gu, dn, x, topk, tw, w = prob
    if which == 0:
        return moe_forward(x, topk, tw, gu, dn)
    if which == 1:
        rt = sm.route(topk, gu.num_experts)
        return sm.ssmm(x, gu, rt.offsets, rt.token_ids, act="swiglu")[:rt.offsets[-1]]  # (rows past: unwritten)
    if which == 2:
        p = sm.pack(w, fmt, glu=True)
        return np.concatenate([p.values.reshape(-1).view(np.uint32), p.meta.reshape(-1)])
    if which == 3:
        return sm.unpack(dn)
    return sm.router(x, w[0, :5], 2)[0]


def test_concurrent_results_equal_single_threaded():
    probs = _problems(1)
    jobs = [(i % len(probs), i % 5) for i in range(THREADS * ROUNDS)]
    want = {(p, w): _work(probs[p], w) for p, w in set(jobs)}
    barrier = threading.Barrier(THREADS)

    def run(chunk):
        barrier.wait()
        return [(job, _work(probs[job[0]], job[1])) for job in chunk]

    chunks = [jobs[i::THREADS] for i in range(THREADS)]
    with ThreadPoolExecutor(THREADS) as ex:
        for results in ex.map(run, chunks):
            for job, got in results:
                np.testing.assert_array_equal(got, want[job], err_msg=str(job))


def test_concurrent_errors_name_their_own_defect():
    """The reference's last-error buffer is per thread: each thread's ValueError names the
    storage row it corrupted, never another thread's."""
    rng = np.random.default_rng(2)
    p = sm.pack(rng.standard_normal((1, 64, 64)).astype(np.float32), "3:8:32")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    off = np.array([0, 4], np.int32)
    bad = []
    for t in range(THREADS):
        idx = p.idx.copy()
        q = 3 * t   # the first slot of group t: its second slot is made equal to it
        idx[0, 0, q + 1] = idx[0, 0, q]
        bad.append(sm.PackedWeight(p.values, p.meta, idx, p.fmt, p.shape))
    barrier = threading.Barrier(THREADS)

    def run(t):
        barrier.wait()
        msgs = set()
        for i in range(ROUNDS):
            with pytest.raises(ValueError) as e:
                (sm.ssmm(x, bad[t], off) if i % 2 else sm.unpack(bad[t]))
            msgs.add(str(e.value).split(": ", 1)[1])
        return t, msgs

    with ThreadPoolExecutor(THREADS) as ex:
        for t, msgs in ex.map(run, range(THREADS)):
            assert msgs == {f"idx: expert 0, slice 0: storage rows {3 * t} and {3 * t + 1} pick rows "
                            f"{p.idx[0, 0, 3 * t]} and {p.idx[0, 0, 3 * t]} of their group; expected increasing"}
