"""The C extension's safety on hostile sizes, module copies and odd addresses (issue 44,
items 1, 2 and 5): each case crashed or was undefined behaviour before its fix, so the
crashing ones run in a subprocess and report back.

- Sizes whose workspace products leave int64 are a ValueError naming the arguments,
  never a wrapped workspace size (the reproducer: T = 1, K = 2**31 - 1,
  H = 2**31 - 4, I = 0, E = 2147483520, float32 activations).
- A second copy of ``samoyeds._C`` (importlib) has its own state; freeing it leaves
  the first one working (no process-wide state pointer).
- The C reference reads and writes arrays at odd addresses (numpy exports them
  through DLPack) only through memcpy, and never passes NULL to memset: checked by
  building tests/c/ref_alignment.c with UBSan, and on the extension by comparing
  odd-address arrays with aligned copies.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import samoyeds as sm
from samoyeds import _C
from samoyeds.ops import Routing
from helpers import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code: str) -> subprocess.CompletedProcess:
    return run_python(["-c", textwrap.dedent(code)], timeout=300)


# ---- item 1: checked size arithmetic ---------------------------------------------------------

OVERFLOW = """
import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided
from samoyeds import _C
from samoyeds.ops import Routing
from samoyeds.moe import forward_arrays

T, K, H, I, E = 1, 2**31 - 1, 2**31 - 4, 0, 2147483520

def claimed(shape, dtype):
    # a C-order view of `shape` over one element: never read, the call must refuse it first
    base = np.zeros(1, dtype)
    strides, step = [], base.itemsize
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return as_strided(base, shape=shape, strides=strides)

x, out = claimed((T, H), np.float32), claimed((T, H), np.float32)
topk, tkw = claimed((T, K), np.int32), claimed((T, K), np.float32)
# plain 2:4, every packed array empty: gate_up [E, 0, H] and down [E, H, 0] (numpy refuses
# such shapes; torch makes them)
gv, gm = torch.empty((E, 0, 2**30)), torch.empty((E, 0, 2**26, 16), dtype=torch.uint32)
dv, dm = torch.empty((E, 2**31, 0)), torch.empty((E, 2**27, 0, 16), dtype=torch.uint32)

def refused(fn, *names):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        assert msg.startswith(names), msg
        assert "2**63" in msg, msg
        return
    raise AssertionError("no ValueError")

refused(lambda: _C.moe_workspace_bytes(T, K, E, H, I, 4), "T, K, E, H, I:")
refused(lambda: forward_arrays(x, topk, tkw, gv, gm, None, dv, dm, None, I, 1, 1, 0, 1), "T, K, E, H, I:")
refused(lambda: _C.moe_forward(out, np.zeros(0, np.uint8), x, topk, tkw, gv, gm, None, dv, dm, None, I, 1, 1, 0),
        "x, top_k_index:")
print("ok")
"""


def test_workspace_size_overflow_is_a_value_error():
    r = _run_python(OVERFLOW)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout, r.stderr[-3000:])


@pytest.mark.parametrize("shape,match", [
    ((2**31, 2**31, 0), None),
    ((2**40, 2**40, 0), None),
    ((2**62, 4), r"^t: expected a tensor of fewer than 2\*\*63 bytes"),
])
def test_claimed_extents_are_checked(shape, match):
    """A producer's shape cannot make the element count or byte range wrap."""
    from test_dlpack import CapsuleProducer
    p = CapsuleProducer(np.zeros((1,) * len(shape), np.float32), shape=shape)
    if match is None:
        assert _C.tensor_info(p)["shape"] == shape
    else:
        with pytest.raises(ValueError, match=match):
            _C.tensor_info(p)


def test_workspace_bytes_of_ordinary_sizes_unchanged():
    """The checked layout gives the bytes the unchecked one gave (256-byte aligned parts)."""
    def layout(T, K, E, H, I, elem):
        up = lambda n: (n + 255) // 256 * 256  # noqa: E731
        S = T * K
        at = up(4 * (E + 1))
        for _ in range(4):
            at = up(at + 4 * S)
        return up(up(at + elem * S * I) + elem * S * H)
    for args in [(7, 2, 3, 64, 64, 4), (1, 1, 1, 0, 0, 2), (4096, 8, 128, 7168, 2048, 2), (0, 4, 8, 16, 32, 4)]:
        assert _C.moe_workspace_bytes(*args) == layout(*args)


# ---- item 2: the module's own state ------------------------------------------------------------

MODULE_COPY = """
import gc, importlib.util
import samoyeds._C as C

spec = importlib.util.find_spec("samoyeds._C")
copy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(copy)
assert copy is not C
assert copy.set_fast_dlpack(False) is True      # the copy's own setting
assert C.set_fast_dlpack(True) is True          # the first module's is untouched
copy.set_config(7, 3, 2, 1, False)
assert C.get_config()["decode_max_rows"] == -1
del copy, spec
gc.collect()
assert C.set_fast_dlpack(False) is True
assert C.set_fast_dlpack(True) is False
import numpy as np
assert C.tensor_info(np.zeros(3, np.float32))["shape"] == (3,)
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    assert C.tensor_info(torch.zeros(3))["path"] in ("exchange_api", "versioned", "legacy")
print("ok")
"""


def test_second_module_copy_has_its_own_state():
    r = _run_python(MODULE_COPY)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout, r.stderr[-3000:])


# ---- item 5: odd addresses and empty arrays ------------------------------------------------------

def _compiler():
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


@pytest.mark.parametrize("what", ["odd", "empty"])
def test_reference_under_ubsan(tmp_path, what):
    """tests/c/ref_alignment.c with UBSan: no misaligned load or store, no memset(NULL, 0, 0)."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "ref_alignment"
    refs = [os.path.join(ROOT, "csrc", f) for f in sorted(os.listdir(os.path.join(ROOT, "csrc")))
            if f.endswith("_ref.c")]
    build = subprocess.run(
        [cc, "-std=c11", "-O1", "-g", "-fsanitize=alignment,nonnull-attribute,undefined",
         "-fno-sanitize-recover=all", "-I", os.path.join(ROOT, "cuda"), "-I", os.path.join(ROOT, "csrc"),
         os.path.join(ROOT, "tests", "c", "ref_alignment.c"), *refs, "-lm", "-o", str(exe)],
        capture_output=True, text=True)
    if build.returncode != 0:
        if "sanitize" in build.stderr or "ubsan" in build.stderr:
            pytest.skip(f"{cc} cannot build with UBSan: {build.stderr[-300:]}")
        raise AssertionError(build.stderr)
    r = subprocess.run([str(exe), what], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def _odd(a: np.ndarray) -> np.ndarray:
    """a copy of a that starts at an odd address (numpy exports it through DLPack as is)."""
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = buf[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 2 == 1
    return out


def test_odd_addresses_give_the_same_results(rng):
    E, R, C, T, K = 3, 64, 128, 9, 2
    w = rng.standard_normal((E, R, C)).astype(np.float32)
    fmt = "samoyeds-1:2:64"
    p = sm.pack(w, fmt)
    po = sm.pack(_odd(w), fmt)
    for name in ("values", "meta", "idx"):
        np.testing.assert_array_equal(getattr(po, name), getattr(p, name))
    p_odd = sm.PackedWeight(_odd(p.values), _odd(p.meta), _odd(p.idx), p.fmt, p.shape)
    np.testing.assert_array_equal(sm.unpack(p_odd), sm.unpack(p))
    x = rng.standard_normal((T, C)).astype(np.float32)
    topk = rng.integers(-1, E, (T, K)).astype(np.int32)
    r, ro = sm.route(topk, E), sm.route(_odd(topk), E)
    for name in ("offsets", "token_ids", "perm", "pos"):
        np.testing.assert_array_equal(getattr(ro, name), getattr(r, name))
    tw = rng.random((T, K)).astype(np.float32)
    s = sm.gather_weights(tw, r)
    r_odd = Routing(*(_odd(a) for a in (r.offsets, r.token_ids, r.perm, r.pos)))
    np.testing.assert_array_equal(sm.gather_weights(_odd(tw), r_odd), s)
    y = sm.ssmm(x, p, r.offsets, r.token_ids, scale=s, out=np.zeros((T * K, R), np.float32))
    y_odd = sm.ssmm(_odd(x), p_odd, _odd(r.offsets), _odd(r.token_ids), scale=_odd(s),
                    out=_odd(np.zeros((T * K, R), np.float32)))
    np.testing.assert_array_equal(y_odd, y)
    np.testing.assert_array_equal(sm.combine(_odd(y), _odd(r.pos)), sm.combine(y, r.pos))
    meta = p.meta[0, 0]
    np.testing.assert_array_equal(_C.decode_meta(_odd(meta)), _C.decode_meta(meta))


# ---- item 4 (the C side): ssmm takes the packed arrays as unpack does ----------------------------

def _corrupt(p, what):
    """A copy of packed weight p with one defect unpack refuses: row indices out of order
    (two slots of a group swapped), equal, or out of range, or an invalid 2:4 code."""
    idx, meta = (None if p.idx is None else p.idx.copy()), p.meta.copy()
    if what == "unordered":
        idx[0, 0, [0, 1]] = idx[0, 0, [1, 0]]
    elif what == "equal":
        idx[0, 0, 1] = idx[0, 0, 0]
    elif what == "range":
        idx[0, 0, 2] = p.fmt.m
    else:
        meta[0, 0, 0, 0] = (meta[0, 0, 0, 0] & ~np.uint32(0xF)) | np.uint32(0xF)
    return sm.PackedWeight(p.values, meta, idx, p.fmt, p.shape, p.glu)


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("what", ["unordered", "equal", "range", "code"])
def test_ssmm_refuses_what_unpack_refuses(rng, what, glu):
    """3:8:32 keeps 3 rows per group: ssmm once read unordered indices (and clamped indices
    >= m to 0) where unpack refused them.  Both now give the same ValueError, and the
    fused moe_forward too; nothing is written."""
    from samoyeds.moe import moe_forward
    E, R, C, T = 2, 48, 64, 5
    w = rng.standard_normal((E, 2 * R if glu else R, C)).astype(np.float32)
    p = sm.pack(w, "3:8:32", glu=glu)
    bad = _corrupt(p, what)
    x = rng.standard_normal((T, C)).astype(np.float32)
    off = np.array([0, 3, T], np.int32)
    sm.ssmm(x, p, off, act="swiglu" if glu else "none")
    with pytest.raises(ValueError) as unpacked:
        sm.unpack(bad)
    msg = str(unpacked.value).split(": ", 1)[1]
    assert msg.startswith(("idx: expert 0", "meta: expert 0")), msg
    out = np.full((T, R), 7.0, np.float32)
    with pytest.raises(ValueError) as e:
        sm.ssmm(x, bad, off, out=out, act="swiglu" if glu else "none")
    assert str(e.value) == "ssmm: " + msg
    assert (out == 7.0).all(), "ssmm wrote before refusing"
    if glu:
        down = sm.pack(rng.standard_normal((E, C, R)).astype(np.float32), "3:8:32")
        topk = rng.integers(0, E, (T, 2)).astype(np.int32)
        with pytest.raises(ValueError, match="idx: expert 0|meta: expert 0"):
            moe_forward(x, topk, rng.random((T, 2)).astype(np.float32), bad, down)


@pytest.mark.parametrize("kw", [{"n_group": 2**40}, {"n_group": 2**70}, {"topk_group": -2**65}])
def test_router_ints_past_int32_are_value_errors(kw):
    """PyArg's "i" raised OverflowError (not a documented type) for router's ints past int32
    (found by tests/fuzz): now a ValueError naming the argument."""
    x, w = np.zeros((2, 64), np.float32), np.zeros((8, 64), np.float32)
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"^{name}: expected a 32-bit int, got {kw[name]}$"):
        sm.router(x, w, 2, **kw)
    with pytest.raises(ValueError, match=r"^k: expected a 32-bit int"):
        _C.router(np.zeros((2, 8), np.float32), np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int64), x, w,
                  2**80)
