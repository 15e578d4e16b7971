"""No entry point of the extension leaks (issue 44): resident memory and CPython's count of
allocated blocks stay flat over 10,000 calls of each, on success and on the error paths
(every tensor taken through DLPack is released, every exception's message freed).

Under AddressSanitizer (dev/sanitize/run.sh) freed memory waits in its quarantine, so RSS
says nothing there: only the block count is checked.

Tolerance: a warm-up of 1,000 calls first (allocator pools, caches); then at most 4 MiB of
RSS growth (allocator noise; a leak of one 512-byte buffer per call is 5 MiB) and at most
0.05 new Python blocks per call (one leaked object per call is 1.0).
"""
from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest

import samoyeds as sm
from samoyeds import _C
from samoyeds.moe import moe_forward
from samoyeds.ops import ssmm_dw, ssmm_dx

CALLS, WARMUP = 10_000, 1_000
RSS_TOL = 4 << 20
ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
BLOCKS_PER_CALL = 0.2


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _entry_points():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 16, 64)).astype(np.float32)
    p = sm.pack(w, "3:8:32")
    gu = sm.pack(rng.standard_normal((2, 32, 64)).astype(np.float32), "3:8:32", glu=True)
    dn = sm.pack(rng.standard_normal((2, 64, 16)).astype(np.float32), "3:8:32")
    x = rng.standard_normal((3, 64)).astype(np.float32)
    topk = np.array([[0, 1], [1, 5], [0, -1]], np.int64)
    rt = sm.route(topk, 2)
    tw = rng.random((3, 2)).astype(np.float32)
    y = rng.standard_normal((6, 16)).astype(np.float32)
    g = rng.standard_normal((3, 16)).astype(np.float32)
    dw = rng.standard_normal((8, 64)).astype(np.float32)
    dy = rng.standard_normal((6, 16)).astype(np.float32)
    bad_idx = p.idx.copy()
    bad_idx[0, 0, [0, 1]] = bad_idx[0, 0, [1, 0]]
    bad = sm.PackedWeight(p.values, p.meta, bad_idx, p.fmt, p.shape)

    def raises(fn, exc=(ValueError, TypeError, BufferError)):
        def call():
            try:
                fn()
            except exc:
                return
            raise AssertionError("no error")
        return call

    return {
        "mask": lambda: sm.mask(w, "3:8:32"),
        "pack": lambda: sm.pack(w, "3:8:32"),
        "unpack": lambda: sm.unpack(p),
        "ssmm": lambda: sm.ssmm(x, p, rt.offsets, rt.token_ids),
        "ssmm_dw": lambda: ssmm_dw(dy, x, p, rt.offsets, rt.token_ids),
        "ssmm_dx": lambda: ssmm_dx(g, p, rt.offsets, rt.token_ids),
        "route": lambda: sm.route(topk, 2),
        "gather_weights": lambda: sm.gather_weights(tw, rt),
        "combine": lambda: sm.combine(y, rt.pos),
        "glu": lambda: sm.glu(g, g),
        "dense_decode": lambda: sm.dense_decode(x, dw),
        "router": lambda: sm.router(x, dw, 2),
        "moe_forward": lambda: moe_forward(x, topk, tw, gu, dn),
        "tensor_info": lambda: _C.tensor_info(x),
        "decode_meta": lambda: _C.decode_meta(p.meta[0, 0]),
        "unpack_bad_idx": raises(lambda: sm.unpack(bad)),
        "ssmm_bad_idx": raises(lambda: sm.ssmm(x, bad, rt.offsets, rt.token_ids)),
        "ssmm_dw_bad_idx": raises(lambda: ssmm_dw(dy, x, bad, rt.offsets, rt.token_ids)),
        "ssmm_dw_bad_dtype": raises(lambda: ssmm_dw(dy.astype(np.float16), x, p, rt.offsets, rt.token_ids)),
        "ssmm_dx_bad_idx": raises(lambda: ssmm_dx(g, bad, rt.offsets, rt.token_ids)),
        "ssmm_dx_bad_dtype": raises(lambda: ssmm_dx(g.astype(np.float16), p, rt.offsets, rt.token_ids)),
        "ssmm_bad_dtype": raises(lambda: sm.ssmm(x.astype(np.float16), p, rt.offsets, rt.token_ids)),
        "ssmm_bad_shape": raises(lambda: _C.ssmm(np.zeros((6, 16), np.float32), x, p.values, p.meta, p.idx,
                                                 rt.offsets[:-1], rt.token_ids, 16, 64, 3, 8, 32, False)),
        "moe_bad_ids": raises(lambda: moe_forward(x, topk.astype(np.float32), tw, gu, dn)),
        "tensor_info_not_array": raises(lambda: _C.tensor_info(object())),
    }


ENTRY = _entry_points()


def _torch_entry_points():
    torch = pytest.importorskip("torch")
    t = torch.randn(3, 64)
    w = torch.randn(8, 64)
    return {"dense_decode_torch": lambda: sm.dense_decode(t, w), "tensor_info_torch": lambda: _C.tensor_info(t)}


@pytest.mark.parametrize("name", sorted(ENTRY) + ["dense_decode_torch", "tensor_info_torch"])
def test_flat_over_10000_calls(name):
    fn = ENTRY[name] if name in ENTRY else _torch_entry_points()[name]
    for _ in range(WARMUP):
        fn()
    gc.collect()
    rss0, blocks0 = _rss(), sys.getallocatedblocks()
    for _ in range(CALLS):
        fn()
    gc.collect()
    rss1, blocks1 = _rss(), sys.getallocatedblocks()
    assert ASAN or rss1 - rss0 <= RSS_TOL, f"{name}: RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {CALLS} calls"
    assert blocks1 - blocks0 <= BLOCKS_PER_CALL * CALLS, \
        f"{name}: {blocks1 - blocks0} more Python blocks after {CALLS} calls"
