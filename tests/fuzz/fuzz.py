"""A seeded random fuzzer over samoyeds' public API (issue 44).

Every case builds random arguments for one entry point -- shapes (zero, odd,
products past int64), dtypes, strides (non-contiguous, negative, overlapping),
format strings and (n, m, v), expert and token ids (negative, out of range),
corrupted packed arrays and metadata, hand-built DLPack capsules with tampered
fields, corrupted checkpoints (truncation, bit flips, header edits), the
backward's ops (ssmm_dw, ssmm_dx, glu_backward; on the GPU also the transposed packing's
build and refresh and moe_zero_unrouted) -- calls it, and judges the outcome with
one oracle:

* a clean result must equal the C reference on a sane copy of the same
  arguments (contiguous, aligned, valid), or, for packed weights that unpack
  accepts, ``x @ unpack(W).T`` in float64 within the fp32 tolerance (the
  backward's: ``dY^T X`` at the kept entries, the GLU's derivative);
* otherwise the call must raise one of the documented types: ValueError
  (CheckpointError is one), TypeError, BufferError or samoyeds.CudaError.

Any other exception type is a failure; a crash ends the process (the pytest
entry point runs the fuzzer in a subprocess and reports the case it was on,
printed before each call with ``--trace``).  Categories are picked round-robin
from one ``random.Random(seed)``, so a seed and a case number reproduce a case.

GPU mode (``gpu=True``): valid random cases of ssmm, moe_forward, unpack, route
and combine on CUDA tensors (bf16 / fp16) compared with the C reference on the
CPU copies, and corrupted packed arrays through unpack on both devices (the
same error).  ssmm on the GPU does not check the packed arrays (one host sync
per call): those come from pack or from from_pretrained, which check them.
"""
from __future__ import annotations

import io
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import samoyeds as sm
from samoyeds import _C, ops

HERE = os.path.dirname(os.path.abspath(__file__))
ALLOWED = (ValueError, TypeError, BufferError, sm.CudaError)
# (2 of 4 rows per slice needs its "samoyeds-" prefix: a bare "2:4:32" is ambiguous and refused, so
# every case that drew it used to end in that ValueError; case_format still draws the bare string)
FORMATS = ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "1:4:64", "2:8:32", "3:8:32", "1:8:32", "samoyeds-2:4:32"]
FLOAT_DT = [np.float32, np.float16]
ANY_DT = [np.float32, np.float16, np.float64, np.int8, np.int32, np.int64, np.uint8, np.uint32, np.bool_,
          np.complex64, np.uint16]


class Failure(Exception):
    """A wrong result or a wrong exception type."""


class Hang(BaseException):
    """A case ran past CASE_SECONDS (e.g. a config.json asking for 2**40 layers).  Not an
    Exception: no ``except Exception`` of the code under test may swallow it."""


CASE_SECONDS = 30


def _alarm(signum, frame):
    raise Hang(f"the case ran past {CASE_SECONDS} s")


class Stats:
    def __init__(self) -> None:
        self.cases: Dict[str, int] = {}
        self.failures: Dict[str, List[str]] = {}
        self.raised: Dict[str, int] = {}

    def add(self, cat: str, failure: Optional[str], exc: Optional[BaseException]) -> None:
        self.cases[cat] = self.cases.get(cat, 0) + 1
        self.failures.setdefault(cat, [])
        if failure:
            self.failures[cat].append(failure)
        if exc is not None:
            self.raised[type(exc).__name__] = self.raised.get(type(exc).__name__, 0) + 1

    def table(self) -> str:
        lines = [f"{'category':<12} {'cases':>7} {'failures':>9}"]
        for cat in sorted(self.cases):
            lines.append(f"{cat:<12} {self.cases[cat]:>7} {len(self.failures[cat]):>9}")
        lines.append(f"{'total':<12} {sum(self.cases.values()):>7} "
                     f"{sum(len(v) for v in self.failures.values()):>9}")
        lines.append("exceptions raised: " + ", ".join(f"{k} {v}" for k, v in sorted(self.raised.items())))
        return "\n".join(lines)


def _assert_close(got: np.ndarray, want: np.ndarray, scale: float, what: str) -> None:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise Failure(f"{what}: shape {got.shape} != {want.shape}")
    tol = 1e-4 * (1 + scale)
    bad = ~np.isclose(got, want, rtol=1e-3, atol=tol) & ~(np.isnan(got) & np.isnan(want))
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise Failure(f"{what}: differs at {i}: {got[i]} vs {want[i]}")


def _equal(a: Any, b: Any, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
        raise Failure(f"{what}: result differs from the C reference on a sane copy")


# ---- argument mutators ---------------------------------------------------------------------------

def _dim(r: random.Random) -> int:
    return r.choice([0, 1, 2, 3, 4, 5, 7, 8, 12, 16, 31, 32, 33, 64, 96, 128, 130])


def _odd_array(r: random.Random, a: np.ndarray) -> np.ndarray:
    """a with a random layout: as is, non-contiguous, negative strides, odd address, read-only,
    zero-stride (overlapping), Fortran order."""
    k = r.randrange(8)
    if k == 0 or a.ndim == 0:
        return a
    if k == 1:   # every other element of a larger array
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if k == 2:
        return a[::-1] if a.shape[0] else a
    if k == 3:
        buf = np.zeros(a.nbytes + 1, np.uint8)
        out = buf[1:].view(a.dtype).reshape(a.shape)
        out[...] = a
        return out
    if k == 4:
        b = a.copy()
        b.setflags(write=False)
        return b
    if k == 5 and a.size:
        return np.broadcast_to(a.reshape(-1)[:1].reshape((1,) * a.ndim), a.shape)
    if k == 6:
        return np.asfortranarray(a)
    return a.copy()


def _mutate(r: random.Random, a: Any) -> Any:
    """a, or a with another dtype, ndim or shape, or not an array at all."""
    if a is None:
        return r.choice([None, np.zeros(3, np.float32), 3])
    k = r.randrange(10)
    if k == 0:
        return a.astype(r.choice(ANY_DT))
    if k == 1:
        return a.reshape(a.shape + (1,))
    if k == 2:
        return a.reshape(-1)
    if k == 3 and a.ndim:
        return a[:max(0, a.shape[0] - 1)]
    if k == 4:
        return r.choice([None, [1, 2], "x", 3.5, object()])
    if k == 5:
        return np.zeros(tuple(_dim(r) for _ in range(a.ndim)), a.dtype)
    return _odd_array(r, a)


# ---- categories ------------------------------------------------------------------------------------

def _packed(r: random.Random, rng: np.random.Generator, fmt: str, E: int, R: int, C: int, dt, glu: bool):
    w = rng.standard_normal((E, R, C)).astype(dt)
    return w, sm.pack(w, fmt, glu=glu)


def _valid_problem(r: random.Random, rng: np.random.Generator):
    """A valid random ssmm problem: (x, p, routing, act, bias, scale)."""
    fmt = sm.SparseFormat.parse(r.choice(FORMATS))
    glu = r.random() < 0.5
    E = r.choice([1, 2, 3, 5])
    m = fmt.m
    half = m * r.choice([0, 1, 2, 3, 8])
    R = 2 * half if glu else half
    C = 4 * r.choice([0, 1, 3, 8, 17, 33])
    dt = r.choice(FLOAT_DT)
    w, p = _packed(r, rng, fmt.name, E, R, C, dt, glu)
    T, K = r.choice([0, 1, 3, 9]), r.choice([1, 2])
    x = rng.standard_normal((T, C)).astype(dt)
    topk = rng.integers(-1, E + 2, (T, K)).astype(r.choice([np.int32, np.int64]))
    rt = sm.route(topk, E)
    act = r.choice(["swiglu", "gptoss", "none"]) if glu else "none"
    bias = rng.standard_normal((E, R)).astype(dt) if r.random() < 0.3 else None
    scale = rng.random(T * K).astype(np.float32) if r.random() < 0.3 else None
    return x, w, p, rt, act, bias, scale, topk


def _fp32_may_overflow(x, p, rt, act, bias) -> np.ndarray:
    """[S, out_cols] bool: where a float32 sum of the products, in some order, can pass
    float32's largest value (sum of |products| over it): inf there is float32 arithmetic, not
    a wrong result (a corrupted value near 1e38 in a sum whose exact value is in range)."""
    with np.errstate(all="ignore"):
        q = sm.PackedWeight(np.abs(np.asarray(p.values, np.float64)).astype(np.float32), p.meta, p.idx, p.fmt,
                            p.shape, p.glu)
        W = np.asarray(sm.unpack(q), np.float64)
        E, R, _ = W.shape
        ax = np.abs(np.asarray(x, np.float64))
        ab = None if bias is None else np.abs(np.asarray(bias, np.float64))
        S = rt.token_ids.shape[0]
        big = np.zeros((S, R if act == "none" else R // 2), bool)
        lim = float(np.finfo(np.float32).max) / 4
        for e in range(E):
            for s in range(rt.offsets[e], rt.offsets[e + 1]):
                b = ax[rt.token_ids[s]] @ W[e].T + (0 if ab is None else ab[e])
                b = ~(b < lim)
                big[s] = b if act == "none" else b[:R // 2] | b[R // 2:]
    return big


def _ssmm_oracle(x, w, p, rt, act, bias, scale) -> np.ndarray:
    """float64 definition of ssmm over unpack(p)."""
    W = np.asarray(sm.unpack(p), np.float64)
    E, R, _ = W.shape
    S = rt.token_ids.shape[0]
    out_cols = R if act == "none" else R // 2
    out = np.zeros((S, out_cols))
    off = rt.offsets
    for e in range(E):
        for s in range(off[e], off[e + 1]):
            y = np.asarray(x[rt.token_ids[s]], np.float64) @ W[e].T
            if bias is not None:
                y = y + np.asarray(bias[e], np.float64)
            if act == "swiglu":
                g, u = y[:R // 2], y[R // 2:]
                y = g / (1 + np.exp(-g)) * u
            elif act == "gptoss":
                g, u = np.minimum(y[:R // 2], 7.0), np.clip(y[R // 2:], -7.0, 7.0)
                y = (u + 1) * g / (1 + np.exp(-1.702 * g))
            if scale is not None:
                y = y * scale[s]
            out[s] = y
    return out


def case_ssmm(r, rng):
    """A valid problem, then maybe one argument mutated; a clean result equals the sane one."""
    x, w, p, rt, act, bias, scale, _ = _valid_problem(r, rng)
    out0 = sm.ssmm(x, p, rt.offsets, rt.token_ids, act=act, bias=bias, scale=scale)
    off = int(rt.offsets[-1])
    want = _ssmm_oracle(x, w, p, rt, act, bias, scale)
    _assert_close(np.asarray(out0, np.float64)[:off], want[:off], float(np.abs(want).max(initial=0)),
                  "ssmm vs float64 oracle") if x.dtype == np.float32 else None
    args = {"x": x, "offsets": rt.offsets, "token_ids": rt.token_ids, "bias": bias, "scale": scale}
    name = r.choice(list(args))
    args[name] = _mutate(r, args[name])
    if r.random() < 0.2:   # ids: negative / out of range
        ids = np.array(rt.token_ids, np.int32)
        if ids.size:
            ids[r.randrange(ids.size)] = r.choice([-1, -2**31, x.shape[0], 2**31 - 1])
        args["token_ids"] = ids
    out = sm.ssmm(args["x"], p, args["offsets"], args["token_ids"], act=act, bias=args["bias"],
                  scale=args["scale"])
    sane = sm.ssmm(*(np.ascontiguousarray(args[k]) if isinstance(args[k], np.ndarray) else args[k]
                     for k in ("x",)), p,
                   *(np.ascontiguousarray(args[k]) if isinstance(args[k], np.ndarray) else args[k]
                     for k in ("offsets", "token_ids")),
                   act=act, bias=None if args["bias"] is None else np.ascontiguousarray(args["bias"]),
                   scale=None if args["scale"] is None else np.ascontiguousarray(args["scale"]))
    last = int(np.asarray(args["offsets"])[-1]) if np.asarray(args["offsets"]).size else 0
    _equal(np.asarray(out)[:last], np.asarray(sane)[:last], f"ssmm with {name} mutated")


def case_format(r, rng):
    """pack / unpack / mask with random formats (strings and n, m, v), shapes and dtypes."""
    k = r.randrange(4)
    if k == 0:
        s = r.choice(FORMATS + ["2:4:32", "", "1:2", "0:4", "5:4:32", "1:2:0", "1:2:-32", "1:9:32", "samoyeds-", "2:4:33",
                                "a:b:c", "1:2:128:4", " 2:4", "1:2:" + "9" * 30, "-1:-2:32", None, 3, (1, 2, 64),
                                (1, 2), (2, 4, 0)])
        try:
            fmt = sm.SparseFormat.parse(s)
        except ALLOWED:
            return
    else:
        fmt = sm.SparseFormat.parse(r.choice(FORMATS))
    E, R, C = r.choice([1, 2]), fmt.m * r.choice([0, 1, 2, 3]), 4 * r.choice([0, 1, 5, 16, 33])
    if r.random() < 0.3:
        R, C = _dim(r), _dim(r)
    dt = r.choice(FLOAT_DT + [np.float64, np.int32] if r.random() < 0.2 else FLOAT_DT)
    w = rng.standard_normal((E, R, C)).astype(dt)
    glu = r.random() < 0.3
    if r.random() < 0.4:
        w = _odd_array(r, w)
    mk = sm.mask(w, fmt)
    p = sm.pack(w, fmt, mask=mk, glu=glu)
    sane = sm.pack(np.ascontiguousarray(w), fmt, glu=glu)
    for a in ("values", "meta", "idx"):
        _equal(getattr(p, a), getattr(sane, a), f"pack {a}")
    _equal(sm.unpack(p), np.where(mk, w, 0).astype(w.dtype), "unpack(pack(w)) == where(mask, w, 0)")
    n, m, v = fmt.c_args()
    if r.random() < 0.5:  # the raw entry points with random ints
        n, m, v = (r.choice([n, 0, -1, 9, 2**31 - 1, -2**31, 64, 33]) for _ in range(3))
        out = np.zeros((E, R, C), w.dtype)
        _C.format_unpack(out, p.values, p.meta, p.idx, n, m, v, glu)


def _corrupt_packed(r: random.Random, p):
    idx = None if p.idx is None else np.array(p.idx)
    meta, values = np.array(p.meta), np.array(p.values)
    for _ in range(r.choice([1, 1, 2, 5])):
        k = r.randrange(4)
        if k == 0 and idx is not None and idx.size:
            idx.reshape(-1)[r.randrange(idx.size)] = r.randrange(256) if r.random() < 0.5 else r.randrange(p.fmt.m)
        elif k == 1 and idx is not None and idx.size >= 2:
            i = r.randrange(idx.size - 1)
            f = idx.reshape(-1)
            f[i], f[i + 1] = f[i + 1], f[i]
        elif k == 2 and meta.size:
            meta.reshape(-1)[r.randrange(meta.size)] ^= np.uint32(1 << r.randrange(32))
        elif values.size:
            values.view(np.uint8).reshape(-1)[r.randrange(values.nbytes)] ^= np.uint8(1 << r.randrange(8))
    return sm.PackedWeight(values, meta, idx, p.fmt, p.shape, p.glu)


def case_packed(r, rng):
    """Corrupted packed arrays: unpack refuses them or ssmm equals x @ unpack(W).T; ssmm and
    unpack accept the same arrays."""
    x, w, p, rt, act, bias, scale, _ = _valid_problem(r, rng)
    bad = _corrupt_packed(r, p)
    try:
        dense = sm.unpack(bad)
    except ValueError as e:
        try:
            sm.ssmm(x, bad, rt.offsets, rt.token_ids, act=act, bias=bias, scale=scale)
        except ValueError:
            return
        if int(rt.offsets[-1]) - int(rt.offsets[0]) > 0:
            raise Failure(f"ssmm accepted packed arrays that unpack refuses ({e})")
        return
    del dense
    out = sm.ssmm(x, bad, rt.offsets, rt.token_ids, act=act, bias=bias, scale=scale)
    if x.dtype == np.float32:
        want = _ssmm_oracle(x, None, bad, rt, act, bias, scale)
        off = int(rt.offsets[-1])
        got = np.array(out, np.float64)
        big = _fp32_may_overflow(x, bad, rt, act, bias)
        got[big], want[big] = 0.0, 0.0
        with np.errstate(all="ignore"):
            _assert_close(got[:off], want[:off], float(np.nanmax(np.abs(want), initial=0)),
                          "ssmm on corrupted-but-valid arrays vs x @ unpack(W).T")


def case_ids(r, rng):
    """route / gather_weights / combine with random ids (negative, past E, int32 extremes)."""
    T, K, E = r.choice([0, 1, 5, 17]), r.choice([1, 2, 3]), r.choice([1, 4, 9, 2**31 - 2, 0, -1])
    dt = r.choice([np.int32, np.int64, np.int16, np.float32])
    lo, hi = (-2**31, 2**31 - 1) if r.random() < 0.3 else (-2, 12)
    topk = rng.integers(lo, hi, (T, K), dtype=np.int64).astype(dt)
    if E > 2**20:
        return   # offsets [E+1]: legal but too large to allocate here
    rt = sm.route(_odd_array(r, topk) if r.random() < 0.3 else topk, E)
    sane = sm.route(np.ascontiguousarray(topk), E)
    for a in ("offsets", "token_ids", "perm", "pos"):
        _equal(getattr(rt, a), getattr(sane, a), f"route {a}")
    ids = np.asarray(topk).astype(np.int64)
    counts = [int(((ids == e)).sum()) for e in range(E)]
    if list(np.diff(rt.offsets)) != counts:
        raise Failure("route: offsets disagree with the ids' counts")
    tw = rng.random((T, K)).astype(np.float32)
    g = sm.gather_weights(_mutate(r, tw) if r.random() < 0.3 else tw, rt)
    y = rng.standard_normal((T * K, r.choice([1, 8, 13]))).astype(r.choice(FLOAT_DT))
    pos = np.array(rt.pos)
    if r.random() < 0.3 and pos.size:
        pos.reshape(-1)[r.randrange(pos.size)] = r.choice([-2, T * K, 2**31 - 1, -2**31])
    sm.combine(y, _mutate(r, pos) if r.random() < 0.3 else pos)
    del g


def case_ops(r, rng):
    """glu, dense_decode, router with random shapes, dtypes, layouts and arguments."""
    k = r.randrange(3)
    T, R, C = _dim(r), _dim(r), _dim(r)
    dt = r.choice(FLOAT_DT)
    if k == 0:
        g, u = rng.standard_normal((T, R)).astype(dt), rng.standard_normal((T, R)).astype(dt)
        act = r.choice(["swiglu", "gptoss", "none", "relu"])
        a, b = (_mutate(r, g), u) if r.random() < 0.5 else (g, u)
        out = sm.glu(a, b, act=act)
        _equal(out, sm.glu(np.ascontiguousarray(a), np.ascontiguousarray(b), act=act), "glu")
    elif k == 1:
        x = rng.standard_normal((T, C)).astype(dt)
        w = rng.standard_normal((R, C)).astype(dt)
        up = rng.standard_normal((R, C)).astype(dt) if r.random() < 0.5 else None
        act = r.choice(["swiglu", "none"] if up is not None else ["none", "gptoss"])
        args = [x, w, up]
        i = r.randrange(3)
        args[i] = _mutate(r, args[i])
        out = sm.dense_decode(*args, act=act)
        sane = sm.dense_decode(*(None if a is None else np.ascontiguousarray(a) for a in args), act=act)
        _equal(out, sane, "dense_decode")
    else:
        E = r.choice([1, 2, 8, 33])
        x = rng.standard_normal((T, C)).astype(dt)
        w = rng.standard_normal((E, C)).astype(dt)
        kk = r.choice([1, 2, E, E + 1, 0, -1])
        mode = r.choice(["softmax_topk", "topk_softmax", "sigmoid_topk", "bogus"])
        ng = r.choice([1, 2, 4, 0, 2**40, -2**70])
        out = sm.router(_mutate(r, x) if r.random() < 0.3 else x, w, kk, mode=mode, n_group=ng,
                        topk_group=r.choice([1, 2, ng]), renorm=r.random() < 0.5,
                        bias=rng.standard_normal(E).astype(np.float32) if r.random() < 0.3 else None)
        del out


def case_moe(r, rng):
    """moe_forward on random sizes, ids and layouts; equal to the steps it fuses."""
    fmt = sm.SparseFormat.parse(r.choice(FORMATS))
    E, H, I = r.choice([1, 2, 4]), 4 * fmt.m * r.choice([1, 2]), fmt.m * r.choice([1, 2, 3])
    T, K = r.choice([0, 1, 4, 9]), r.choice([1, 2])
    dt = r.choice(FLOAT_DT)
    gu = sm.pack(rng.standard_normal((E, 2 * I, H)).astype(dt), fmt, glu=True)
    dn = sm.pack(rng.standard_normal((E, H, I)).astype(dt), fmt)
    x = rng.standard_normal((T, H)).astype(dt)
    topk = rng.integers(-1, E + 1, (T, K)).astype(np.int64)
    tw = rng.random((T, K)).astype(np.float32)
    act = r.choice(["swiglu", "gptoss"])
    from samoyeds.moe import moe_forward
    want = moe_forward(x, topk, tw, gu, dn, act=act)
    rt = sm.route(topk, E)
    h = sm.ssmm(x, gu, rt.offsets, rt.token_ids, act=act)
    y = sm.ssmm(h, dn, rt.offsets, None, scale=sm.gather_weights(tw, rt))
    _assert_close(want, sm.combine(y, rt.pos, dtype=np.dtype(dt).name), 1.0, "moe_forward vs its steps") \
        if dt == np.float32 else None
    args = [x, topk, tw]
    i = r.randrange(3)
    args[i] = _mutate(r, args[i])
    if r.random() < 0.3:
        gu = _corrupt_packed(r, gu)
    out = moe_forward(*args, gu, dn, act=act)
    sane = moe_forward(*(np.ascontiguousarray(a) for a in args), gu, dn, act=act)
    _equal(out, sane, "moe_forward with an argument mutated")


def case_dlpack(r, rng):
    """Hand-built DLPack capsules (tests/test_dlpack.py's CapsuleProducer) with tampered fields:
    versions, devices, dtype codes and bits, flags, byte offsets, shapes that shrink or
    overflow, missing strides; and the taking alone (tensor_info) for claimed extents."""
    from test_dlpack import CapsuleProducer  # noqa: E402 (tests/ on sys.path)
    a = rng.standard_normal((r.choice([1, 3, 8]), r.choice([4, 8]))).astype(np.float32)
    kw: Dict[str, Any] = {}
    for _ in range(r.choice([1, 2, 3])):
        f = r.randrange(8)
        if f == 0:
            kw["version"] = r.choice([(0, 0), (1, 0), (1, 7), (2, 0), (255, 255)])
        elif f == 1:
            kw["device"] = r.choice([(1, 0), (2, 0), (1, 5), (13, 0), (0, 0), (1, -1)])
        elif f == 2:
            kw["code"] = r.choice([0, 1, 2, 3, 4, 5, 6, 255])
        elif f == 3:
            kw["bits"] = r.choice([0, 1, 8, 16, 32, 7, 255])   # never wider: the op would read past a
        elif f == 4:
            kw["flags"] = r.choice([0, 1, 2, 3, 0xFF])
        elif f == 5:
            kw["byte_offset"] = r.choice([0, 4, 16])
        elif f == 6:
            kw["strides"] = False
        else:
            kw["versioned"] = False
    shrink = r.random() < 0.3
    if shrink:   # never more elements than the array holds: the op may read them
        kw["shape"] = (a.shape[0], r.choice([0, 1, a.shape[1] // 2]))
    prod = CapsuleProducer(a, **kw)
    if r.random() < 0.5:
        _C.tensor_info(prod)
    else:   # the extension itself: samoyeds' Python wrappers take torch, numpy and cupy arrays
        cols = kw["shape"][1] if shrink else a.shape[1]
        y = np.full((a.shape[0], cols), np.nan, np.float32)
        _C.glu(y, prod, np.ascontiguousarray(a[:, :cols]), act=1)
        want = np.full_like(y, np.nan)
        _C.glu(want, np.ascontiguousarray(a[:, :cols]), np.ascontiguousarray(a[:, :cols]), act=1)
        if not ({"code", "bits", "strides", "device"} & set(kw)):   # else another (valid) description
            _equal(y, want, "glu of a hand-built capsule")
    # claimed extents on the taking alone (never read)
    if r.random() < 0.3:
        shape = tuple(r.choice([0, 1, 2**31, 2**40, 2**62, 2**63 - 1]) for _ in range(r.choice([1, 2, 3])))
        _C.tensor_info(CapsuleProducer(np.zeros((1,) * len(shape), np.float32), shape=shape))


class _Checkpoints:
    """One small saved checkpoint per format, corrupted into fresh copies."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="samoyeds-fuzz-")
        self.saved: Dict[str, str] = {}

    def get(self, family: str, fmt: str) -> str:
        key = f"{family}-{fmt}"
        if key not in self.saved:
            import torch
            from samoyeds.hf.families import Shape, build_model
            import transformers
            transformers.logging.set_verbosity_error()
            shape = Shape(vocab=64, hidden=64, layers=1, experts=4, top_k=2, intermediate=32, heads=2,
                          kv_heads=1, head_dim=32, init_std=0.1)
            model = build_model(family, shape, seed=1)
            with torch.no_grad():
                for n, prm in model.named_parameters():
                    if n.endswith("proj_bias"):
                        prm.copy_(0.1 * torch.randn(prm.shape))
            sm.patch_model(model, fmt, progress=False)
            d = os.path.join(self.root, key.replace(":", "_"))
            sm.save_pretrained(model, d)
            self.saved[key] = d
        return self.saved[key]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _rewrite_header(data: bytes, fn: Callable[[dict], None]) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8:8 + n])
    fn(head)
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


def _edit_tensor_entry(r: random.Random, head: dict) -> None:
    names = [k for k in head if k != "__metadata__"]
    if not names:
        return
    e = head[r.choice(names)]
    f = r.randrange(4)
    if f == 0:
        e["dtype"] = r.choice(["F32", "BF16", "F16", "U8", "U32", "I64", "F64", "BOOL", "X"])
    elif f == 1:
        e["shape"] = [r.choice([0, 1, 3, 2**31, -1]) for _ in e["shape"]] or [r.choice([0, 1])]
    elif f == 2:
        a, b = e["data_offsets"]
        e["data_offsets"] = r.choice([[b, a], [a, b + 8], [0, b - a], [a, a]])
    else:
        e["shape"] = e["shape"][1:] + [1]


def _edit_metadata(r: random.Random, head: dict) -> None:
    meta = head.setdefault("__metadata__", {})
    key = r.choice(["model_class", "format", "modules", "aliases", "samoyeds_layout_version",
                    "samoyeds_checkpoint_version"])
    if key == "modules" and key in meta and r.random() < 0.7:
        mods = json.loads(meta[key])
        if mods:
            m = r.choice(mods)
            field = r.choice(list(m))
            m[field] = r.choice([None, -1, 0, 2**40, "x", 1.5, True, [], {}, m[field]])
            meta[key] = json.dumps(mods)
            return
    meta[key] = r.choice(["", "{}", "[]", "null", "1", "Qwen3MoeForCausalLM", "os", "AutoModel",
                          "GenerationConfig", "3:8:32", "2:4", "samoyeds-1:2:64", '{"lm_head.weight": "x"}',
                          '[{"name": "model.layers.0.mlp.experts"}]', "\u00ff" * 3])


def case_checkpoint(r, rng, ck: _Checkpoints):
    """A saved checkpoint, corrupted: truncated, bit-flipped, header edited (tensor entries
    or samoyeds metadata), config.json edited, tensors swapped between the files."""
    from samoyeds.checkpoint import EXPERTS_FILE, MODEL_FILE, CheckpointError
    family = r.choice(["qwen3_moe", "gpt_oss", "mixtral"])
    src = ck.get(family, r.choice(["samoyeds-1:2:128", "3:8:32", "2:4"]))
    d = tempfile.mkdtemp(dir=ck.root)
    try:
        shutil.copytree(src, d, dirs_exist_ok=True)
        file = os.path.join(d, r.choice([EXPERTS_FILE, EXPERTS_FILE, MODEL_FILE, "config.json"]))
        data = open(file, "rb").read()
        k = r.randrange(5)
        if file.endswith("config.json"):
            cfg = json.loads(data)
            key = r.choice(list(cfg))
            cfg[key] = r.choice([None, -1, 0, "x", [], 2**40, cfg[key]])
            if r.random() < 0.3:
                cfg["model_type"] = r.choice(["bert", "llama", "nope", "qwen3_moe"])
            data = json.dumps(cfg).encode()
        elif k == 0:
            data = data[:r.randrange(len(data))]
        elif k == 1:
            for _ in range(r.choice([1, 4, 32])):
                i = r.randrange(len(data))
                data = data[:i] + bytes([data[i] ^ (1 << r.randrange(8))]) + data[i + 1:]
        elif k == 2:
            data = _rewrite_header(data, lambda h: _edit_tensor_entry(r, h))
        elif k == 3:
            data = _rewrite_header(data, lambda h: _edit_metadata(r, h))
        else:   # flips in the data of one packed array (indices and codes are checked)
            n = struct.unpack("<Q", data[:8])[0]
            head = json.loads(data[8:8 + n])
            names = [x for x in head if x != "__metadata__" and (x.endswith("_idx") or x.endswith("_meta"))]
            if names:
                a, b = head[r.choice(names)]["data_offsets"]
                if b > a:
                    i = 8 + n + a + r.randrange(b - a)
                    data = data[:i] + bytes([r.randrange(256)]) + data[i + 1:]
        open(file, "wb").write(data)
        try:
            model = sm.from_pretrained(d)
        except CheckpointError:
            return
        # it loaded: it must run (every tensor that reaches C was checked) -- unless config.json
        # was edited: transformers' own modules may then refuse at the forward (a top-k above the
        # expert count, ...), with their own error types; samoyeds' ops still raise only
        # documented ones, and nothing may crash
        import torch
        try:
            with torch.no_grad():
                model(torch.randint(1, 60, (1, 5)))
        except Exception as e:  # noqa: BLE001
            if not file.endswith("config.json") or isinstance(e, ALLOWED) or "samoyeds" in "".join(
                    traceback.format_tb(e.__traceback__)[-1:]):
                raise
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _kept_mask(p) -> np.ndarray:
    """[E, R, C] bool: the entries p keeps (unpack of the same arrays with every value 1)."""
    ones = np.ones(np.asarray(p.values).shape, np.asarray(p.values).dtype)
    return np.asarray(sm.unpack(sm.PackedWeight(ones, p.meta, p.idx, p.fmt, p.shape, p.glu))) != 0


def _glu_backward_oracle(dh, pre, act, scale, offsets, alpha=1.702, limit=7.0) -> np.ndarray:
    """float64 [dgate, dup] of h = act(gate, up); rows from offsets[E] on are 0."""
    dh, pre = np.asarray(dh, np.float64), np.asarray(pre, np.float64)
    I = dh.shape[1]
    g, u = pre[:, :I], pre[:, I:]
    if scale is not None:
        dh = dh * np.asarray(scale, np.float64)[:, None]
    with np.errstate(over="ignore"):
        if act == "swiglu":
            sg = 1 / (1 + np.exp(-g))
            out = np.concatenate([dh * u * sg * (1 + g * (1 - sg)), dh * g * sg], axis=1)
        else:
            gc, uc = np.minimum(g, limit), np.clip(u, -limit, limit)
            sg = 1 / (1 + np.exp(-alpha * gc))
            dg = np.where(g <= limit, dh * (uc + 1) * (sg + alpha * gc * sg * (1 - sg)), 0.0)
            du = np.where((u >= -limit) & (u <= limit), dh * gc * sg, 0.0)
            out = np.concatenate([dg, du], axis=1)
    if offsets is not None:
        out[int(np.asarray(offsets)[-1]):] = 0
    return out


def _moe_backward_case(r):
    import torch
    if os.path.dirname(HERE) not in sys.path:
        sys.path.insert(0, os.path.dirname(HERE))   # tests/: the training tests' oracle
    from test_train import make_case, oracle_grads, samoyeds_grads
    fmt = sm.SparseFormat.parse(r.choice(FORMATS))
    T, K, E = r.choice([0, 1, 4, 9]), r.choice([1, 2, 3]), r.choice([1, 2, 5])
    unit = fmt.m * 4 // np.gcd(fmt.m, 4)   # rows in whole groups of m, columns in 2:4 groups
    H, I = unit * r.choice([1, 2]), unit * r.choice([1, 2, 3])
    act, bias = r.choice(["swiglu", "gptoss"]), r.random() < 0.5
    alpha, limit = (1.3, 0.8) if act == "gptoss" and r.random() < 0.5 else (1.702, 7.0)  # clamps that cut
    case = make_case(T, K, E, H, I, fmt.name, torch.float32, bias, seed=r.getrandbits(31))
    go = torch.randn(T, H, generator=torch.Generator().manual_seed(r.getrandbits(31)))
    out, got = samoyeds_grads(*case, act, go, alpha, limit, via=r.choice(["moe_forward", "op"]))
    ids = case[1]
    if not bool(((ids >= 0) & (ids < E)).any()):   # nothing routed: the oracle has no graph
        for name, g in got.items():
            if g is None or bool(g.any()):
                raise Failure(f"moe_forward's backward with nothing routed: d{name} is not zero")
        if bool(out.any()):
            raise Failure("moe_forward with nothing routed: the output is not zero")
        return
    ref, want = oracle_grads(*case, act, go, alpha, limit)
    ref = ref.detach()
    _assert_close(out.detach().numpy(), ref.numpy(), float(ref.abs().max()) if T else 0.0,
                  f"moe_forward {fmt.name} {act}")
    if set(got) != set(want):
        raise Failure(f"moe_forward's backward: gradients {sorted(got)}, the oracle's {sorted(want)}")
    for name in want:
        g, wt = got[name], want[name]
        if g is None or tuple(g.shape) != tuple(wt.shape):
            raise Failure(f"moe_forward's backward: d{name} is {None if g is None else tuple(g.shape)}")
        _assert_close(g.double().numpy(), wt.double().numpy(), float(wt.abs().max()) if wt.numel() else 0.0,
                      f"moe_forward's backward {fmt.name} {act} bias={bias}: d{name}")


def _ssmm_dx_case(r, rng):
    """ssmm_dx (dX from the forward's packing) against float64 dy[token] @ unpack(W), rows
    past offsets[E] zero, every row written; then one argument mutated."""
    x, w, p, rt, _, _, scale, _ = _valid_problem(r, rng)
    E, R, C = p.shape3
    S = rt.token_ids.shape[0]
    dy = rng.standard_normal((x.shape[0], R)).astype(x.dtype)
    out = np.full((S, C), np.nan, x.dtype)
    ops.ssmm_dx(dy, p, rt.offsets, rt.token_ids, scale, out=out)
    if not np.isfinite(out).all():
        raise Failure("ssmm_dx left rows of out unwritten (NaN poison)")
    if x.dtype == np.float32:
        W = np.asarray(sm.unpack(p), np.float64)
        off = np.asarray(rt.offsets)
        want = np.zeros((S, C))
        for e in range(E):
            for s in range(off[e], off[e + 1]):
                want[s] = np.asarray(dy[rt.token_ids[s]], np.float64) @ W[e] * (1.0 if scale is None else scale[s])
        _assert_close(out, want, float(np.abs(want).max(initial=0)), "ssmm_dx vs float64 dy @ unpack(W)")
    args = {"dy": dy, "offsets": rt.offsets, "token_ids": rt.token_ids, "scale": scale}
    name = r.choice(list(args))
    args[name] = _mutate(r, args[name])
    sane_args = [np.ascontiguousarray(args[k]) if isinstance(args[k], np.ndarray) else args[k]
                 for k in ("dy", "offsets", "token_ids", "scale")]
    got = ops.ssmm_dx(args["dy"], p, args["offsets"], args["token_ids"], args["scale"])
    _equal(got, ops.ssmm_dx(sane_args[0], p, *sane_args[1:]), f"ssmm_dx with {name} mutated")


def _dy_t_np(dy: np.ndarray, offsets) -> np.ndarray:
    """dy's transposed copy by expert segment (samoyeds.ops.dy_t_shape; samoyeds_layout.h's
    sam_dyt_segment), built in numpy from the definition."""
    off = [int(v) for v in np.asarray(offsets)]
    S, R = dy.shape
    t = np.zeros(ops.dy_t_shape(R, S, len(off) - 1), dy.dtype)
    for e in range(len(off) - 1):
        c0 = (max(off[e], 0) + 64 * e + 63) // 64 * 64
        t[:R, c0:c0 + off[e + 1] - off[e]] = dy[off[e]:off[e + 1]].T
    return t


def _ssmm_dw_dy_forms(r, rng, dy, x, p, rt, scale) -> None:
    """ssmm_dw's other forms of dy: by token id (dy_token_ids, dy with a row per token) and
    already transposed (dy_t, without a scale: it holds dy * scale rounded): the bits of the
    call on dy's sorted rows; a mutated dy_token_ids a clean refusal or the sane result."""
    S, R = dy.shape
    T = x.shape[0]
    ids = np.asarray(rt.token_ids, np.int32)
    src = rng.standard_normal((T + r.choice([0, 2]), R)).astype(dy.dtype)
    rows = np.ascontiguousarray(src[ids]) if S else np.zeros((0, R), dy.dtype)
    want = ops.ssmm_dw(rows, x, p, rt.offsets, rt.token_ids, scale)
    _equal(ops.ssmm_dw(src, x, p, rt.offsets, rt.token_ids, scale, dy_token_ids=ids), want,
           "ssmm_dw reading dy by token id")
    if scale is None:
        _equal(ops.ssmm_dw(rows, x, p, rt.offsets, rt.token_ids, dy_t=_dy_t_np(rows, rt.offsets)), want,
               "ssmm_dw reading dy_t")
    bad = _mutate(r, ids)
    got = ops.ssmm_dw(src, x, p, rt.offsets, rt.token_ids, scale, dy_token_ids=bad)
    _equal(got, ops.ssmm_dw(src, x, p, rt.offsets, rt.token_ids, scale, dy_token_ids=np.ascontiguousarray(bad)),
           "ssmm_dw with dy_token_ids mutated")


def case_train(r, rng):
    """The backward's ops: ssmm_dw (dW at the kept entries, in the packed layout, every entry
    written) and glu_backward against float64 oracles; then one argument mutated: a clean
    result equals the sane one.  And moe_forward's backward (every gradient) against float64
    autograd on the masked dense model: random formats, sizes, ids (placeholders), biases."""
    k = r.random()
    if k < 0.1:   # (some 100 times the time of the others: a tenth, to leave the others their share)
        return _moe_backward_case(r)
    if k < 0.4:
        return _ssmm_dx_case(r, rng)
    if k < 0.7:
        x, w, p, rt, _, _, scale, _ = _valid_problem(r, rng)
        E, R, C = p.shape3
        S = rt.token_ids.shape[0]
        dy = rng.standard_normal((S, R)).astype(x.dtype)
        out = np.full(np.asarray(p.values).shape, np.nan, x.dtype)
        ops.ssmm_dw(dy, x, p, rt.offsets, rt.token_ids, scale, out=out)
        if not np.isfinite(out).all():
            raise Failure("ssmm_dw left entries of out unwritten (NaN poison)")
        if x.dtype == np.float32:
            off = np.asarray(rt.offsets)
            want = np.zeros((E, R, C))
            dys = np.asarray(dy, np.float64) * (1.0 if scale is None else np.asarray(scale, np.float64)[:, None])
            for e in range(E):
                ids = np.asarray(rt.token_ids[off[e]:off[e + 1]], np.int64)
                want[e] = dys[off[e]:off[e + 1]].T @ np.asarray(x, np.float64)[ids]
            want *= _kept_mask(p)
            got = sm.unpack(sm.PackedWeight(out, p.meta, p.idx, p.fmt, p.shape, p.glu))
            _assert_close(got, want, float(np.abs(want).max(initial=0)),
                          "ssmm_dw vs float64 dY^T X at the kept entries")
        if r.random() < 0.5:
            _ssmm_dw_dy_forms(r, rng, dy, x, p, rt, scale)
        args = {"dy": dy, "x": x, "offsets": rt.offsets, "token_ids": rt.token_ids, "scale": scale}
        name = r.choice(list(args))
        args[name] = _mutate(r, args[name])
        got = ops.ssmm_dw(args["dy"], args["x"], p, args["offsets"], args["token_ids"], args["scale"])
        sane = ops.ssmm_dw(*(np.ascontiguousarray(args[k]) if isinstance(args[k], np.ndarray) else args[k]
                            for k in ("dy", "x")), p,
                          *(np.ascontiguousarray(args[k]) if isinstance(args[k], np.ndarray) else args[k]
                            for k in ("offsets", "token_ids", "scale")))
        _equal(got, sane, f"ssmm_dw with {name} mutated")
        return
    S, I = _dim(r), _dim(r)
    dt = r.choice(FLOAT_DT)
    act = r.choice(["swiglu", "gptoss"])
    pre = (4 * rng.standard_normal((S, 2 * I))).astype(dt)
    dh = rng.standard_normal((S, I)).astype(r.choice([dt, np.float32]))
    scale = rng.random(S).astype(np.float32) if r.random() < 0.5 else None
    offsets = None
    if r.random() < 0.5:
        cut = sorted(r.randrange(S + 1) for _ in range(r.choice([1, 2, 4])))
        offsets = np.array([0] + cut, np.int32)
    out = np.full((S, 2 * I), np.nan, np.float32)
    out_t = None
    if offsets is not None and r.random() < 0.5:   # also the transposed copy by expert segment
        out_t = np.full(ops.dy_t_shape(2 * I, S, len(offsets) - 1), np.nan, dt)
    ops.glu_backward(dh, pre, out, scale=scale, offsets=offsets, act=act, out_t=out_t)
    _assert_close(out, _glu_backward_oracle(dh, pre, act, scale, offsets), 1.0, f"glu_backward {act}")
    if out_t is not None:
        _equal(out_t, _dy_t_np(out.astype(dt), offsets), "glu_backward's out_t against its layout built from out")
    args = {"dh": dh, "preact": pre, "scale": scale, "offsets": offsets}
    name = r.choice(list(args))
    args[name] = _mutate(r, args[name])
    got = ops.glu_backward(args["dh"], args["preact"], scale=args["scale"], offsets=args["offsets"], act=act)
    sane = ops.glu_backward(*(np.ascontiguousarray(args[k]) if isinstance(args[k], np.ndarray) else args[k]
                             for k in ("dh", "preact")),
                           scale=None if args["scale"] is None else np.ascontiguousarray(args["scale"]),
                           offsets=None if args["offsets"] is None else np.ascontiguousarray(args["offsets"]),
                           act=act)
    _equal(got, sane, f"glu_backward with {name} mutated")


CATEGORIES = {"ssmm": case_ssmm, "format": case_format, "packed": case_packed, "ids": case_ids,
              "ops": case_ops, "moe": case_moe, "dlpack": case_dlpack, "checkpoint": case_checkpoint,
              "train": case_train}


# ---- GPU mode ------------------------------------------------------------------------------------

def _gpu_close(what, got, want, bound, eps):
    """got (GPU) within 4 eps of want (the C reference) relative to |want| + bound, where
    bound is the sum of |products| (fp32 sums in another order, one rounding each), plus one
    subnormal step of got's dtype: two sums a hair apart may round to neighbouring subnormals."""
    import torch
    fi = torch.finfo(got.dtype)
    g, wnt, bnd = got.double().cpu(), want.double(), bound.double()
    bad = ((g - wnt).abs() > 4 * eps * (wnt.abs() + bnd) + fi.smallest_normal * fi.eps) | torch.isnan(g)
    if bool(bad.any()):
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise Failure(f"{what} on the GPU: {list(i)} = {float(g[i])}, the C reference {float(wnt[i])}")


def _gpu_backward_ops(r, w, fmt, glu, p_cpu, p_gpu, x, rc, rg):
    """ssmm_dw, ssmm_dx and glu_backward on the GPU against the C reference on CPU copies
    (outputs poisoned with NaN: every entry must be written)."""
    import torch
    dt = x.dtype
    eps = 2.0**-8 if dt == torch.bfloat16 else 2.0**-11
    S, (E, R, C) = rc.token_ids.shape[0], p_cpu.shape3
    p_abs = sm.pack(w.abs(), fmt, mask=sm.unpack(p_cpu) != 0, glu=glu)
    sc = torch.rand(S) if r.random() < 0.5 else None
    k = r.randrange(5)
    try:
        if k == 3:
            # the transposed packing, built then refreshed after the values change in place (an
            # optimizer step): data movement, so bit-equal to the C reference
            if not p_cpu.transposable:
                return
            # (copies of the values: the case's later checks read p_cpu / p_gpu as packed from w)
            qc, qg = (sm.PackedWeight(q.values.clone(), q.meta, q.idx, q.fmt, q.shape, q.glu) for q in (p_cpu, p_gpu))
            for step in range(2):
                if step:
                    bump = torch.randn(qc.values.shape).to(dt)
                    qc.values.add_(bump)
                    qg.values.add_(bump.cuda())
                tc, tg = qc.transposed(), qg.transposed()
                for a in ("values", "meta"):
                    if not torch.equal(getattr(tg, a).cpu(), getattr(tc, a)):
                        when = "refreshed" if step else "built"
                        raise Failure(f"transposed {fmt.name} {str(dt)[6:]} on the GPU ({when}): {a} differs from "
                                      "the C reference")
            return
        if k == 4:
            # the rows no routed pair owns, zeroed on the device; every other byte kept
            cols = r.choice([1, 3, 8, 33])
            base = torch.randn(S, cols + r.choice([0, 5])).to(dt)
            want, got = base.clone(), base.cuda()
            sm._C.moe_zero_unrouted(want[:, :cols], rc.offsets)
            sm._C.moe_zero_unrouted(got[:, :cols], rg.offsets)
            if not torch.equal(got.cpu(), want):
                raise Failure(f"moe_zero_unrouted on the GPU differs from the C reference ({S} x {cols})")
            return
        if k == 0:
            dy = torch.randn(S, R).to(dt)
            want = ops.ssmm_dw(dy, x, p_cpu, rc.offsets, rc.token_ids, sc)
            out = torch.full(tuple(p_gpu.values.shape), float("nan"), dtype=dt, device="cuda")
            got = ops.ssmm_dw(dy.cuda(), x.cuda(), p_gpu, rg.offsets, rg.token_ids,
                              None if sc is None else sc.cuda(), out=out)
            bound = ops.ssmm_dw(dy.abs(), x.abs(), p_abs, rc.offsets, rc.token_ids, sc)
            _gpu_close(f"ssmm_dw {fmt.name} {str(dt)[6:]}", got, want, bound, eps)
            # dy by token id (a row per token, some rows no sorted row reads): the same kernel's
            # bits as on the gathered rows
            if S and R % 8 == 0:
                src = torch.randn(x.shape[0] + 2, R).to(dt)
                ids = (rc.token_ids.long() + 2).to(torch.int32)
                kw = dict(out=torch.full_like(out, float("nan")))
                by_id = ops.ssmm_dw(src.cuda(), x.cuda(), p_gpu, rg.offsets, rg.token_ids,
                                    None if sc is None else sc.cuda(), dy_token_ids=ids.cuda(), **kw)
                rows = ops.ssmm_dw(src[ids.long()].cuda(), x.cuda(), p_gpu, rg.offsets, rg.token_ids,
                                   None if sc is None else sc.cuda())
                if not torch.equal(by_id, rows):
                    raise Failure(f"ssmm_dw {fmt.name} {str(dt)[6:]} on the GPU: dy by token id differs from the "
                                  "gathered rows")
        elif k == 1:
            dy = torch.randn(x.shape[0], R).to(dt)
            want = ops.ssmm_dx(dy, p_cpu, rc.offsets, rc.token_ids, sc)
            out = torch.full((S, C), float("nan"), dtype=dt, device="cuda")
            got = ops.ssmm_dx(dy.cuda(), p_gpu, rg.offsets, rg.token_ids, None if sc is None else sc.cuda(),
                              out=out)
            bound = ops.ssmm_dx(dy.abs(), p_abs, rc.offsets, rc.token_ids, sc)
            _gpu_close(f"ssmm_dx {fmt.name} {str(dt)[6:]}", got, want, bound, eps)
        else:
            I = max(1, R // 2)
            act = r.choice(["swiglu", "gptoss"])
            pre, dh = (4 * torch.randn(S, 2 * I)).to(dt), torch.randn(S, I).to(dt)
            want = ops.glu_backward(dh, pre, scale=sc, offsets=rc.offsets, act=act, dtype="float32")
            out = torch.full((S, 2 * I), float("nan"), device="cuda")
            got = ops.glu_backward(dh.cuda(), pre.cuda(), out, scale=None if sc is None else sc.cuda(),
                                   offsets=rg.offsets, act=act)
            # the same fp32 arithmetic but for a differently rounded exp: a few ulps of the tensor
            _gpu_close(f"glu_backward {act} {str(dt)[6:]}", got, want,
                       want.abs().max() if want.numel() else torch.zeros(()), 1e-6)
            # with out_t (the fused kernel): out the same bits, out_t that out's layout
            out_t = torch.full(ops.dy_t_shape(2 * I, S, E), float("nan"), dtype=dt, device="cuda")
            again = ops.glu_backward(dh.cuda(), pre.cuda(), torch.full_like(out, float("nan")),
                                     scale=None if sc is None else sc.cuda(), offsets=rg.offsets, act=act, out_t=out_t)
            if not torch.equal(again, got):
                raise Failure(f"glu_backward {act} {str(dt)[6:]} on the GPU: out differs with out_t")
            if not torch.equal(out_t.cpu(), torch.from_numpy(_dy_t_np(got.to(dt).float().cpu().numpy(),
                                                                       rc.offsets)).to(dt)):
                raise Failure(f"glu_backward {act} {str(dt)[6:]} on the GPU: out_t is not out's layout")
    except NotImplementedError as exc:   # a format or shape the GPU kernel does not take (documented)
        if "GPU kernel" not in str(exc):
            raise


def gpu_case(r, rng):
    """A valid random problem on the GPU (bf16 / fp16) against the C reference on CPU copies."""
    import torch
    fmt = sm.SparseFormat.parse(r.choice(FORMATS))
    glu = r.random() < 0.5
    E, T, K = r.choice([1, 3, 8]), r.choice([0, 1, 7, 40, 300]), r.choice([1, 2])
    half = fmt.m * r.choice([1, 2, 16, 40])
    R, C = (2 * half if glu else half), 8 * r.choice([1, 5, 16, 33])
    dt = r.choice([torch.bfloat16, torch.float16])
    w = torch.randn(E, R, C).to(dt)
    p_cpu = sm.pack(w, fmt, glu=glu)
    p_gpu = sm.pack(w.cuda(), fmt, glu=glu)
    for a in ("values", "meta", "idx"):
        if getattr(p_cpu, a) is not None and not torch.equal(getattr(p_gpu, a).cpu(), getattr(p_cpu, a)):
            raise Failure(f"pack on the GPU: {a} differs from the C reference")
    if not torch.equal(sm.unpack(p_gpu).cpu(), sm.unpack(p_cpu)):
        raise Failure("unpack on the GPU differs from the C reference")
    x = torch.randn(T, C).to(dt)
    topk = torch.randint(-1, E + 1, (T, K))
    rc, rg = sm.route(topk, E), sm.route(topk.cuda(), E)
    for a in ("offsets", "token_ids", "pos"):
        if not torch.equal(getattr(rc, a), getattr(rg, a).cpu()):
            raise Failure(f"route on the GPU: {a} differs")
    _gpu_backward_ops(r, w, fmt, glu, p_cpu, p_gpu, x, rc, rg)
    act = r.choice(["swiglu", "gptoss", "none"]) if glu else "none"
    impl = r.choice(["auto", "mma_sp", "decode"] + (["wgmma_sp"] if torch.cuda.get_device_capability() == (9, 0)
                                                    and (fmt.n == fmt.m or (fmt.n, fmt.m) == (1, 2)) else []))
    want = sm.ssmm(x, p_cpu, rc.offsets, rc.token_ids, act=act).float()
    try:
        got = sm.ssmm(x.cuda(), p_gpu, rg.offsets, rg.token_ids, act=act, impl=impl).float().cpu()
    except ValueError:
        return   # an impl that does not take this format or shape (documented)
    except NotImplementedError as exc:  # documented refusals: a format no GPU kernel runs (n > 1,
        # v % 64), a glu weight without a gated activation, wgmma.sp forced where it cannot run
        if "GPU kernel" not in str(exc) and "wgmma.sp kernel needs" not in str(exc):
            raise
        return
    off = int(rc.offsets[-1])
    # both round once to dt from fp32 sums taken in another order: a few units in the last place
    # of dt, relative to the row's magnitude
    eps = 2.0**-8 if dt == torch.bfloat16 else 2.0**-11
    g, wnt = got[:off].double(), want[:off].double()
    scale = wnt.abs().amax(dim=1, keepdim=True).clamp_min(1e-3) if off else wnt
    tol = 4 * eps * (wnt.abs() + scale)
    if off:  # a sum that cancels: its error scales with the sum of |products|
        p_abs = sm.pack(w.abs(), fmt, mask=sm.unpack(p_cpu) != 0, glu=glu)
        bnd = sm.ssmm(x.abs(), p_abs, rc.offsets, rc.token_ids).double()[:off]
        if act == "none":
            tol = torch.maximum(tol, 4 * eps * (wnt.abs() + bnd))
        else:   # act(gate) * up': each factor's error times the other (|d/dg g sigmoid(a g)| < 1.1)
            pre = sm.ssmm(x, p_cpu, rc.offsets, rc.token_ids).double()[:off]
            I = pre.shape[1] // 2
            gate, up = pre[:, :I], pre[:, I:]
            if act == "gptoss":
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0) + 1
                a = gate * torch.sigmoid(1.702 * gate)
            else:
                a = gate * torch.sigmoid(gate)
            tol = tol + 4 * eps * (a.abs() * bnd[:, I:] + 1.1 * up.abs() * bnd[:, :I])
    bad = (g - wnt).abs() > tol
    if off and bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise Failure(f"ssmm {impl} {fmt.name} {str(dt)[6:]} on the GPU: [{i}, {j}] = {float(g[i, j])}, "
                      f"the C reference {float(wnt[i, j])}")
    # corrupted arrays: unpack refuses the same on both devices
    bad = _corrupt_packed(r, sm.PackedWeight(*(None if t is None else t.numpy() if t.dtype != torch.bfloat16
                                               else t for t in (p_cpu.values, p_cpu.meta, p_cpu.idx)),
                                             p_cpu.fmt, p_cpu.shape, p_cpu.glu)) if dt != torch.bfloat16 else None
    if bad is not None:
        tc = [None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in (bad.values, bad.meta, bad.idx)]
        errs = []
        for dev in ("cpu", "cuda"):
            try:
                sm.unpack(sm.PackedWeight(*(None if t is None else t.to(dev) for t in tc), bad.fmt, bad.shape,
                                          bad.glu))
                errs.append(None)
            except ValueError as e:
                errs.append(str(e).split(":")[1].strip())
        if (errs[0] is None) != (errs[1] is None):
            raise Failure(f"unpack of corrupted arrays: CPU {errs[0]!r}, GPU {errs[1]!r}")


# ---- driver ---------------------------------------------------------------------------------------

def _case_rngs(case_seed: int):
    """A case's random sources, all from its seed: Python's, numpy's, and torch's global
    generator (the cases draw their tensors from it), so that --replay remakes the case."""
    try:
        import torch
    except ImportError:   # (the numpy-only cases)
        pass
    else:
        torch.manual_seed(case_seed)
    return random.Random(case_seed), np.random.default_rng(case_seed)


def run(seconds: float, seed: int, only: Optional[List[str]] = None, gpu: bool = False, trace: bool = False,
        max_cases: Optional[int] = None, out=sys.stdout) -> Stats:
    r = random.Random(seed)
    stats = Stats()
    ck = _Checkpoints()
    cats = ["gpu"] if gpu else [c for c in CATEGORIES if not only or c in only]
    t_end = time.monotonic() + seconds
    i = 0
    import signal
    old = signal.signal(signal.SIGALRM, _alarm) if hasattr(signal, "SIGALRM") else None
    try:
        while time.monotonic() < t_end and (max_cases is None or i < max_cases):
            cat = cats[i % len(cats)]
            case_seed = r.getrandbits(32)
            if trace:
                print(f"case {i} {cat} seed {case_seed}", file=out, flush=True)
            cr, rng = _case_rngs(case_seed)
            failure, exc = None, None
            if old is not None:
                signal.alarm(CASE_SECONDS)
            try:
                if cat == "gpu":
                    gpu_case(cr, rng)
                elif cat == "checkpoint":
                    case_checkpoint(cr, rng, ck)
                else:
                    CATEGORIES[cat](cr, rng)
            except (Failure, Hang) as e:
                failure = f"case {i} ({cat}, case seed {case_seed}): {type(e).__name__}: {e}"
            except ALLOWED as e:
                exc = e
            except Exception as e:  # noqa: BLE001 - the point: any other type is a failure
                exc = e
                buf = io.StringIO()
                traceback.print_exc(file=buf)
                failure = (f"case {i} ({cat}, case seed {case_seed}): {type(e).__name__}: {e}\n"
                           + buf.getvalue()[-1500:])
            finally:
                if old is not None:
                    signal.alarm(0)
            stats.add(cat, failure, exc)
            if failure:
                print("FAILURE " + failure, file=out, flush=True)
            i += 1
    finally:
        if old is not None:
            signal.signal(signal.SIGALRM, old)
        ck.close()
    return stats


def replay(cat: str, case_seed: int) -> None:
    """Runs one case again (its category and case seed from a FAILURE line), raising."""
    cr, rng = _case_rngs(case_seed)
    if cat == "gpu":
        return gpu_case(cr, rng)
    if cat == "checkpoint":
        ck = _Checkpoints()
        try:
            return case_checkpoint(cr, rng, ck)
        finally:
            ck.close()
    return CATEGORIES[cat](cr, rng)
