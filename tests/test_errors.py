"""Bad input to every public function and every raw op: the right exception
type (TypeError for types and dtypes, ValueError for shapes and values,
BufferError for DLPack protocol problems), a message naming the argument, no
crash, and outputs left untouched when the inputs are refused.  NaN is data,
not an error: it must propagate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import samoyeds as sm
from samoyeds import _C
from samoyeds.format import SparseFormat
from samoyeds.moe import moe_forward
from test_dlpack import CapsuleProducer

NAN = float("nan")


def _randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class _Case:
    """A small valid ssmm problem (numpy, float32): 2 experts, R = 64, C = 128."""

    def __init__(self, rng, fmt="samoyeds-1:2:64", T=10, E=2, R=64, C=128):
        self.fmt = SparseFormat.parse(fmt)
        self.w = _randn(rng, E, R, C)
        self.p = sm.pack(self.w, self.fmt)
        self.x = _randn(rng, T, C)
        self.T, self.E, self.R, self.C = T, E, R, C
        cut = int(rng.integers(1, T))
        self.offsets = np.array([0, cut, T], np.int32)
        self.token_ids = rng.integers(0, T, T).astype(np.int32)

    def out(self, rows=None, cols=None):
        return np.full((rows or self.T, cols or self.R), NAN, np.float32)

    def raw(self, **kw):
        """The keyword arguments of _C.ssmm, overridden by kw."""
        n, m, v = self.fmt.c_args()
        args = dict(out=self.out(), x=self.x, values=self.p.values, meta=self.p.meta, idx=self.p.idx,
                    offsets=self.offsets, token_ids=self.token_ids, rows=self.R, cols=self.C, n=n, m=m, v=v,
                    glu=False)
        args.update(kw)
        return args


@pytest.fixture
def case(rng):
    return _Case(rng)


class TestBadInput:
    # ---- SparseFormat ------------------------------------------------------------------------

    @pytest.mark.parametrize("args,exc,match", [
        ((1, 9, 128), ValueError, r"^m: expected 1 <= m <= 8, got 9"),
        ((1, 0, 128), ValueError, r"^m: expected 1 <= m <= 8, got 0"),
        ((0, 2, 128), ValueError, r"^n: expected 1 <= n <= m = 2, got 0"),
        ((3, 2, 128), ValueError, r"^n: expected 1 <= n <= m = 2, got 3"),
        ((1, 2, 33), ValueError, r"^v: expected a positive multiple of 32 .*, got 33"),
        ((1, 2, -64), ValueError, r"^v: expected a positive multiple of 32 .*, got -64"),
        ((1, 2, None), ValueError, r"^v: expected a positive multiple of 32 .*, got None"),
        ((1, 2, 128.0), TypeError, r"^v: expected an int .*, got 128\.0"),
        ((1, 2, "128"), TypeError, r"^v: expected an int .*, got '128'"),
        (("1", 2, 128), TypeError, r"^n, m: expected ints, got n='1', m=2"),
        ((1, 2.0, 128), TypeError, r"^n, m: expected ints, got n=1, m=2\.0"),
    ])
    def test_sparse_format(self, args, exc, match):
        with pytest.raises(exc, match=match):
            SparseFormat(*args)

    def test_sparse_format_parse(self):
        with pytest.raises(ValueError, match=r"^fmt: expected '2:4' or a format with row selection, .*"
                                             r"e\.g\. 'samoyeds-3:4:128'\), got '3:4'"):
            SparseFormat.parse("3:4")
        with pytest.raises(ValueError, match=r"^fmt: expected one of \['2:4', .*\] or 'samoyeds-n:m:v' .*, got 'x'"):
            SparseFormat.parse("x")
        with pytest.raises(ValueError, match=r"^m: expected 1 <= m <= 8, got 9"):
            SparseFormat.parse("1:9:128")
        with pytest.raises(TypeError, match=r"^fmt: expected a format name, tuple or SparseFormat, got NoneType"):
            SparseFormat.parse(None)
        with pytest.raises(TypeError, match=r"got float"):
            SparseFormat.parse(0.5)

    # ---- mask --------------------------------------------------------------------------------

    def test_mask(self, rng):
        w = _randn(rng, 64, 128)
        with pytest.raises(TypeError, match=r"^w: expected a tensor supporting DLPack .* got list"):
            sm.mask(w.tolist(), "2:4")
        with pytest.raises(TypeError, match=r"^w: expected a tensor supporting DLPack .* got NoneType"):
            sm.mask(None, "2:4")
        with pytest.raises(TypeError, match=r"^w: expected dtype float32, float16, bfloat16 or float64, "
                                            r"got int32"):
            sm.mask(w.astype(np.int32), "2:4")
        with pytest.raises(ValueError, match=r"^w: expected a 3-d tensor, got 1-d with shape \(128,\)"):
            sm.mask(w[0], "2:4")
        with pytest.raises(ValueError, match=r"^w: expected a 3-d tensor, got 4-d"):
            sm.mask(w[None, None], "2:4")
        with pytest.raises(ValueError, match=r"^w: expected a C-contiguous tensor"):
            sm.mask(w[:, ::2], "2:4")
        with pytest.raises(ValueError, match=r"^w: expected a column count that is a multiple of 4 \(2:4 sparsity\), got 126"):
            sm.mask(w[:, :126].copy(), "2:4")
        with pytest.raises(ValueError, match=r"^w: expected a row count that is a multiple of m = 2, got 63"):
            sm.mask(w[:63].copy(), "samoyeds-1:2:64")
        with pytest.raises(ValueError, match=r"^m: expected 1 <= m <= 8, got 9"):
            sm.mask(w, (1, 9, 128))
        with pytest.raises(TypeError, match=r"^scores: expected a tensor supporting DLPack"):
            sm.mask(w, "2:4", scores=[1.0])
        with pytest.raises(ValueError, match=r"^scores: expected shape \(1, 64, 128\), got \(1, 64, 64\)"):
            sm.mask(w, "2:4", scores=w[:, :64].copy())
        with pytest.raises(TypeError, match=r"^scores: expected dtype"):
            sm.mask(w, "2:4", scores=w.astype(np.int64))
        with pytest.raises(TypeError, match=r"^fmt: expected a format name, tuple or SparseFormat, got int"):
            sm.mask(w, 24)

    def test_raw_mask_output(self, rng):
        w = _randn(rng, 1, 16, 64)
        mask = np.full(w.shape, 5, np.uint8)
        with pytest.raises(ValueError, match=r"^n, m: expected 1 <= n <= m <= 8, got n:m = 1:9"):
            _C.format_mask(mask, w, None, 1, 9, 64)
        with pytest.raises(ValueError, match=r"^v: expected a positive multiple of 32 .*, got 48"):
            _C.format_mask(mask, w, None, 1, 2, 48)
        with pytest.raises(TypeError, match=r"^mask: expected dtype uint8 or bool, got int32"):
            _C.format_mask(mask.astype(np.int32), w, None, 1, 2, 64)
        with pytest.raises(ValueError, match=r"^mask: expected shape \(1, 16, 64\), got \(1, 16, 32\)"):
            _C.format_mask(mask[:, :, :32].copy(), w, None, 1, 2, 64)
        ro = _readonly(mask.copy())
        with pytest.raises(ValueError, match=r"^mask: expected a writable tensor \(an output\), got a read-only one"):
            _C.format_mask(ro, w, None, 1, 2, 64)
        alias = w.view(np.uint8).reshape(-1)[: w.size].reshape(w.shape)  # the mask written over w's bytes
        before = w.copy()
        with pytest.raises(ValueError, match=r"^mask: expected an output that shares no memory with w, got overlapping memory"):
            _C.format_mask(alias, w, None, 1, 2, 64)
        np.testing.assert_array_equal(w, before)
        assert (mask == 5).all()

    def test_mask_nan(self, rng):
        """NaN scores are data: the mask still has exactly the format's density."""
        w = _randn(rng, 3, 32, 128)
        w[1, 4, :40] = np.nan
        w[2, :, 64:] = np.nan
        f = SparseFormat.parse("samoyeds-1:2:64")
        m = sm.mask(w, f)
        assert m.mean() == pytest.approx(f.density)
        np.testing.assert_array_equal(m[0], sm.mask(w[0], f))  # the clean expert is unaffected

    # ---- pack / unpack -----------------------------------------------------------------------

    def test_pack(self, rng):
        w = _randn(rng, 64, 128)
        with pytest.raises(TypeError, match=r"^w: expected a tensor supporting DLPack .* got list"):
            sm.pack(w.tolist(), "2:4")
        with pytest.raises(TypeError, match=r"^w: expected dtype float32, float16 or bfloat16, got float64"):
            sm.pack(w.astype(np.float64), "2:4", mask=sm.mask(w, "2:4"))
        with pytest.raises(TypeError, match=r"^w: expected dtype .* got int32"):
            sm.pack(w.astype(np.int32), "2:4", mask=np.zeros(w.shape, bool))
        with pytest.raises(TypeError, match=r"^mask: expected a tensor supporting DLPack .* got list"):
            sm.pack(w, "2:4", mask=[True])
        with pytest.raises(TypeError, match=r"^mask: expected dtype uint8 or bool, got float32"):
            sm.pack(w, "2:4", mask=w)
        with pytest.raises(ValueError, match=r"^mask: expected shape \(1, 64, 128\), got \(1, 64, 64\)"):
            sm.pack(w, "2:4", mask=np.zeros((64, 64), bool))
        with pytest.raises(ValueError, match=r"^w: expected a C-contiguous tensor"):
            sm.pack(_randn(rng, 128, 64).T, "2:4", mask=np.zeros((64, 128), bool))
        with pytest.raises(ValueError, match=r"^w: expected a row count that is a multiple of m = 2 per gate/up half, got 3"):
            sm.pack(_randn(rng, 6, 64), "1:2:32", glu=True)
        with pytest.raises(ValueError, match=r"^w: expected an even row count \(gate rows, then up rows\), got 5"):
            sm.pack(_randn(rng, 5, 64), "2:4", glu=True)
        bad = np.zeros(w.shape, bool)
        bad[3, 8:11] = True
        with pytest.raises(ValueError, match=r"mask: expert 0, row 3, columns 8..11 keep more than 2 of 4"):
            sm.pack(w, "2:4", mask=bad)

    def test_raw_pack_outputs(self, rng):
        w = _randn(rng, 1, 64, 128)
        mask = sm.mask(w, "samoyeds-1:2:64")
        p = sm.pack(w, "samoyeds-1:2:64", mask=mask)

        def outs():
            return (np.full(p.values.shape, NAN, np.float32), np.full(p.meta.shape, 7, np.uint32),
                    np.full(p.idx.shape, 9, np.uint8))

        values, meta, idx = outs()
        with pytest.raises(TypeError, match=r"^meta: expected dtype uint32, got int32"):
            _C.format_pack(values, meta.astype(np.int32), idx, w, mask, 1, 2, 64, False)
        with pytest.raises(ValueError, match=r"^values: expected shape \(1, 64, 64\), got \(1, 64, 32\)"):
            _C.format_pack(values[:, :, :32].copy(), meta, idx, w, mask, 1, 2, 64, False)
        with pytest.raises(TypeError, match=r"^idx: expected a tensor \(the format selects rows: n < m\), got None"):
            _C.format_pack(values, meta, None, w, mask, 1, 2, 64, False)
        with pytest.raises(TypeError, match=r"^values: expected dtype float32 \(that of w\), "
                                            r"got float16"):
            _C.format_pack(values.astype(np.float16), meta, idx, w, mask, 1, 2, 64, False)
        with pytest.raises(ValueError, match=r"^meta: expected a writable tensor \(an output\), got a read-only one"):
            _C.format_pack(values, _readonly(meta.copy()), idx, w, mask, 1, 2, 64, False)
        with pytest.raises(ValueError, match=r"^n, m: expected 1 <= n <= m <= 8, got n:m = 1:9"):
            _C.format_pack(values, meta, idx, w, mask, 1, 9, 64, False)
        # values overlapping w: w sits inside a buffer the values view covers
        buf = np.zeros(2 * w.size, np.float32)
        wb = buf[: w.size].reshape(w.shape)
        wb[...] = w
        vb = buf[w.size // 2: w.size // 2 + values.size].reshape(values.shape)
        with pytest.raises(ValueError, match=r"^values: expected an output that shares no memory with w, got overlapping memory"):
            _C.format_pack(vb, meta, idx, wb, mask, 1, 2, 64, False)
        np.testing.assert_array_equal(wb, w)
        # outputs overlapping each other
        meta_in_values = values.view(np.uint32).reshape(-1)[: meta.size].reshape(meta.shape)
        with pytest.raises(ValueError, match=r"^values: expected an output that shares no memory with meta"):
            _C.format_pack(values, meta_in_values, idx, w, mask, 1, 2, 64, False)
        idx_in_meta = meta.view(np.uint8).reshape(-1)[: idx.size].reshape(idx.shape)
        with pytest.raises(ValueError, match=r"^meta: expected an output that shares no memory with idx"):
            _C.format_pack(values, meta, idx_in_meta, w, mask, 1, 2, 64, False)
        assert np.isnan(values).all() and (meta == 7).all() and (idx == 9).all()

    def test_pack_nan_propagates(self, rng):
        w = _randn(rng, 2, 64, 128)
        mask = sm.mask(w, "samoyeds-1:2:64")
        w[mask & (rng.random(w.shape) < 0.05)] = np.nan
        assert np.isnan(w[mask]).any()
        p = sm.pack(w, "samoyeds-1:2:64", mask=mask)
        np.testing.assert_array_equal(sm.unpack(p), np.where(mask, w, 0))  # NaN == NaN here

    def test_unpack(self, rng):
        with pytest.raises(TypeError, match=r"^packed: expected a PackedWeight, got list"):
            sm.unpack([1])
        with pytest.raises(TypeError, match=r"^packed: expected a PackedWeight, got NoneType"):
            sm.unpack(None)
        p = sm.pack(_randn(rng, 2, 64, 128), "samoyeds-1:2:64")
        with pytest.raises(ValueError, match=r"^values: expected shape \(2, 64, 64\) for a samoyeds-1:2:64 weight"):
            sm.PackedWeight(p.values[:, :32], p.meta, p.idx, p.fmt, p.shape)
        with pytest.raises(ValueError, match=r"^idx: expected None for plain 2:4"):
            sm.PackedWeight(p.values, p.meta, p.idx, SparseFormat.parse("2:4"), p.shape)
        n, m, v, glu = p.c_args()
        out = np.full((2, 64, 128), NAN, np.float32)
        with pytest.raises(ValueError, match=r"^out: expected a writable tensor \(an output\), got a read-only one"):
            _C.format_unpack(_readonly(out.copy()), p.values, p.meta, p.idx, n, m, v, glu)
        with pytest.raises(ValueError, match=r"^out: expected a 3-d tensor, got 2-d"):
            _C.format_unpack(out[0], p.values, p.meta, p.idx, n, m, v, glu)
        with pytest.raises(TypeError, match=r"^out: expected dtype float32 \(that of values\), "
                                            r"got float16"):
            _C.format_unpack(out.astype(np.float16), p.values, p.meta, p.idx, n, m, v, glu)
        with pytest.raises(ValueError, match=r"^idx: expected shape \(2, 2, 64\), got \(2, 1, 64\)"):
            _C.format_unpack(out, p.values, p.meta, p.idx[:, :1].copy(), n, m, v, glu)
        big = np.zeros(2 * out.size, np.float32)
        big[: p.values.size] = p.values.reshape(-1)
        vals_in_out = big[: p.values.size].reshape(p.values.shape)
        with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with values"):
            _C.format_unpack(big[: out.size].reshape(out.shape), vals_in_out, p.meta, p.idx, n, m, v, glu)
        assert np.isnan(out).all()
        p.idx[1, 1, 5] = 2
        with pytest.raises(ValueError, match=r"format_unpack: idx: expert 1, slice 1, storage row 5 holds 2; "
                                             r"expected a value below 2"):
            _C.format_unpack(out, p.values, p.meta, p.idx, n, m, v, glu)

    # ---- ssmm --------------------------------------------------------------------------------

    def test_ssmm_types_and_dtypes(self, case):
        c = case
        with pytest.raises(TypeError, match=r"^w: expected a PackedWeight, got ndarray"):
            sm.ssmm(c.x, c.w, c.offsets, c.token_ids)
        with pytest.raises(TypeError, match=r"^x: expected a tensor supporting DLPack .* got list"):
            sm.ssmm(c.x.tolist(), c.p, c.offsets, c.token_ids)
        with pytest.raises(TypeError, match=r"^x: expected a tensor supporting DLPack .* got NoneType"):
            sm.ssmm(None, c.p, c.offsets, c.token_ids)
        with pytest.raises(TypeError, match=r"^offsets: expected a tensor supporting DLPack .* got list"):
            sm.ssmm(c.x, c.p, c.offsets.tolist(), c.token_ids)
        with pytest.raises(TypeError, match=r"^token_ids: expected a tensor supporting DLPack .* got list"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids.tolist())
        with pytest.raises(TypeError, match=r"^x: expected dtype float32 \(that of values\), got int32"):
            sm.ssmm(c.x.astype(np.int32), c.p, c.offsets, c.token_ids)
        with pytest.raises(TypeError, match=r"^x: expected dtype float32 \(that of values\), "
                                            r"got float16"):
            sm.ssmm(c.x.astype(np.float16), c.p, c.offsets, c.token_ids)
        with pytest.raises(TypeError, match=r"^offsets: expected dtype int32, got int64"):
            sm.ssmm(c.x, c.p, c.offsets.astype(np.int64), c.token_ids)
        with pytest.raises(TypeError, match=r"^token_ids: expected dtype int32, got int64"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids.astype(np.int64))
        with pytest.raises(TypeError, match=r"^scale: expected dtype float32, got float64"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, scale=np.ones(c.T))
        with pytest.raises(TypeError, match=r"^bias: expected a tensor supporting DLPack"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, bias=[0.0])
        with pytest.raises(TypeError, match=r"^out: expected dtype float32 \(that of x\), got float16"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, out=c.out().astype(np.float16))
        with pytest.raises(TypeError, match=r"^stream: expected None or an int"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, stream="default")
        with pytest.raises(ValueError, match=r"^act: expected one of .* got 'relu'"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, act="relu")
        with pytest.raises(ValueError, match=r"^impl: expected one of .* got 'fast'"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, impl="fast")
        with pytest.raises(ValueError, match=r"^act: expected 0 \(none\) for weights packed with glu=False .*, got 1"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, act="swiglu")

    def test_ssmm_shapes(self, case):
        c = case
        out = c.out()
        with pytest.raises(ValueError, match=r"^x: expected a 2-d tensor, got 1-d with shape \(128,\)"):
            sm.ssmm(c.x[0], c.p, c.offsets, c.token_ids, out=out)
        with pytest.raises(ValueError, match=r"^x: expected shape \(10, 128\), got \(10, 64\)"):
            sm.ssmm(c.x[:, :64], c.p, c.offsets, c.token_ids, out=out)
        xt = np.ascontiguousarray(c.x.T).T
        with pytest.raises(ValueError, match=r"^x: expected rows of unit column stride that do not overlap, got shape \(10, 128\) with strides \(1, 10\) \(call \.contiguous\(\) first\)"):
            sm.ssmm(xt, c.p, c.offsets, c.token_ids, out=out)
        with pytest.raises(ValueError, match=r"^offsets: expected shape \(3,\), got \(2,\)"):
            sm.ssmm(c.x, c.p, c.offsets[:2], c.token_ids, out=out)
        with pytest.raises(ValueError, match=r"^token_ids: expected shape \(10,\), got \(9,\)"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids[:9], out=out)
        with pytest.raises(ValueError, match=r"^bias: expected a 2-d tensor, got 1-d with shape \(64,\)"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, bias=np.zeros(64, np.float32), out=out)
        with pytest.raises(ValueError, match=r"^scale: expected shape \(10,\), got \(5,\)"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, scale=np.ones(5, np.float32), out=out)
        with pytest.raises(ValueError, match=r"^out: expected shape \(10, 64\), got \(10, 32\)"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, out=c.out(cols=32))
        with pytest.raises(ValueError, match=r"^out: expected rows of unit column stride that do not overlap"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, out=np.full((64, c.T), NAN, np.float32).T)
        with pytest.raises(ValueError, match=r"^out: expected a writable tensor \(an output\), got a read-only one"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, out=_readonly(c.out()))
        assert np.isnan(out).all()

    def test_ssmm_aliasing(self, case):
        c = case
        buf = np.zeros(c.T * (c.C + c.R), np.float32)
        x = buf[: c.T * c.C].reshape(c.T, c.C)
        x[...] = c.x
        out_over_x = buf[c.T * c.C // 2: c.T * c.C // 2 + c.T * c.R].reshape(c.T, c.R)
        with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with x, got overlapping memory"):
            sm.ssmm(x, c.p, c.offsets, c.token_ids, out=out_over_x)
        np.testing.assert_array_equal(x, c.x)
        scale = np.ones(c.T * c.R, np.float32)
        with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with scale"):
            sm.ssmm(c.x, c.p, c.offsets, c.token_ids, scale=scale[: c.T], out=scale.reshape(c.T, c.R))

    @pytest.mark.parametrize("kw,exc,match", [
        (dict(rows=2**40), ValueError, r"^rows: expected 0 <= rows < 2\*\*31, got 1099511627776"),
        (dict(cols=2**40), ValueError, r"^cols: expected 0 <= cols < 2\*\*31, got 1099511627776"),
        (dict(rows=-64), ValueError, r"^rows: expected 0 <= rows < 2\*\*31, got -64"),
        (dict(rows=2**31), ValueError, r"^rows: .*, got 2147483648"),
        (dict(rows=63), ValueError, r"^rows: expected a row count that is a multiple of m = 2, got 63"),
        (dict(cols=126), ValueError, r"^cols: expected a column count that is a multiple of 4 \(2:4 sparsity\), got 126"),
        (dict(rows=256), ValueError, r"^values: expected shape \(2, 128, 64\), got \(2, 64, 64\)"),
        (dict(m=9), ValueError, r"^n, m: expected 1 <= n <= m <= 8, got n:m = 1:9"),
        (dict(n=0), ValueError, r"^n, m: .*, got n:m = 0:2"),
        (dict(n=3), ValueError, r"^n, m: .*, got n:m = 3:2"),
        (dict(v=33), ValueError, r"^v: expected a positive multiple of 32 .*, got 33"),
        (dict(v=0), ValueError, r"^v: expected a positive multiple of 32 .*, got 0"),
        (dict(v=2**31 - 32), ValueError, r"^idx: expected shape \(2, 1, 64\), got \(2, 2, 64\)"),
        (dict(act=3), ValueError, r"^act: expected .*, got 3"),
        (dict(impl=-1), ValueError, r"^impl: expected .*, got -1"),
        (dict(impl=4), ValueError, r"^impl: expected 0 \(auto\), 1 \(mma.sp\), 2 \(wgmma.sp\) or 3 "
                                   r"\(decode\), got 4"),
    ])
    def test_raw_ssmm_sizes(self, case, kw, exc, match):
        args = case.raw(**kw)
        with pytest.raises(exc, match=match):
            _C.ssmm(**args)
        assert np.isnan(args["out"]).all()

    def test_raw_ssmm_idx_for_plain(self, rng):
        c = _Case(rng, fmt="2:4")
        with pytest.raises(ValueError, match=r"^idx: expected None or an empty tensor \(plain 2:4 selects no rows\), got 128 entries"):
            _C.ssmm(**c.raw(idx=np.zeros((2, 1, 64), np.uint8)))
        with pytest.raises(TypeError, match=r"^idx: expected a tensor \(the format selects rows: n < m\), got None"):
            _C.ssmm(**_Case(rng).raw(idx=None))

    @pytest.mark.parametrize("bad,match", [
        ("descending", r"ssmm: offsets: offsets\[1\] = \d+ is below offsets\[0\] = \d+; expected non-decreasing"),
        ("negative", r"ssmm: offsets: offsets\[0\] is -\d+; expected >= 0"),
        ("past_out", r"ssmm: offsets: offsets\[E\] = \d+ exceeds the 10 rows of out"),
        ("token_high", r"ssmm: token_ids: token_ids\[\d+\] = \d+ is outside x's 10 rows"),
        ("token_negative", r"ssmm: token_ids: token_ids\[\d+\] = -\d+ is outside x's 10 rows"),
        ("identity_past_x", r"ssmm: token_ids: token_ids\[6\] = 6 is outside x's 6 rows"),
    ])
    def test_ssmm_invalid_routing_leaves_out_untouched(self, case, bad, match, rng):
        c = case
        offsets, token_ids, x = c.offsets.copy(), c.token_ids.copy(), c.x
        if bad == "descending":
            offsets[:2] = [int(rng.integers(3, 10)), int(rng.integers(0, 3))]
        elif bad == "negative":
            offsets[0] = -int(rng.integers(1, 100))
        elif bad == "past_out":
            offsets[2] = c.T + int(rng.integers(1, 100))
        elif bad == "token_high":
            token_ids[int(rng.integers(0, c.T))] = c.T + int(rng.integers(0, 2**30))
        elif bad == "token_negative":
            token_ids[int(rng.integers(0, c.T))] = -int(rng.integers(1, 2**30))
        else:  # no token_ids: sorted row s reads x[s], and x has fewer rows than out
            token_ids, x = None, c.x[:6]
        out = c.out()
        with pytest.raises(ValueError, match=match):
            sm.ssmm(x, c.p, offsets, token_ids, out=out)
        assert np.isnan(out).all()

    def test_ssmm_nan_propagates(self, case, rng):
        """out[s, r] is NaN exactly where a NaN of x[token_ids[s]] meets a kept
        weight of row r (the magnitude mask of random data is exactly what is
        stored); every other value is what it is without the NaNs."""
        c = case
        x = c.x.copy()
        bad_rows = rng.choice(c.T, 2, replace=False)
        x[bad_rows[0]] = np.nan
        x[bad_rows[1], rng.choice(c.C, 3, replace=False)] = np.nan
        out = sm.ssmm(x, c.p, c.offsets, c.token_ids)
        kept = sm.mask(c.w, c.fmt)
        expert = np.searchsorted(c.offsets, np.arange(c.T), side="right") - 1
        expect_nan = np.stack([(kept[expert[s]] & np.isnan(x[c.token_ids[s]])).any(axis=1) for s in range(c.T)])
        hit = np.isin(c.token_ids, bad_rows)
        assert expect_nan[hit].any(axis=1).all() and not expect_nan[~hit].any()
        np.testing.assert_array_equal(np.isnan(out), expect_nan)
        clean = sm.ssmm(c.x, c.p, c.offsets, c.token_ids)
        np.testing.assert_array_equal(out[~expect_nan], clean[~expect_nan])

    # ---- route / gather_weights / combine ------------------------------------------------------

    def test_route(self, rng):
        topk = rng.integers(0, 4, (7, 2))
        with pytest.raises(TypeError, match=r"^top_k_index: expected a tensor supporting DLPack .* got list"):
            sm.route(topk.tolist(), 4)
        with pytest.raises(TypeError, match=r"^top_k_index: expected dtype int32 or int64, got float32"):
            sm.route(topk.astype(np.float32), 4)
        with pytest.raises(TypeError, match=r"^top_k_index: expected dtype int32 or int64, got an unsupported one "
                                            r"\(int16\)$"):
            sm.route(topk.astype(np.int16), 4)
        with pytest.raises(ValueError, match=r"^top_k_index: expected a 2-d tensor, got 1-d with shape \(14,\)"):
            sm.route(topk.reshape(-1), 4)
        with pytest.raises(ValueError, match=r"^top_k_index: expected a C-contiguous tensor"):
            sm.route(topk.T, 4)
        for bad in (0, -3, 2**31, 2**40):
            with pytest.raises(ValueError, match=rf"^num_experts: expected 1 <= num_experts < 2\*\*31 - 1 .* "
                                                 rf"got {bad}"):
                sm.route(topk, bad)
        for bad in ("4", 2.5, None, True):
            with pytest.raises(TypeError, match=r"^num_experts: expected an int"):
                sm.route(topk, bad)
        assert list(sm.route(topk, np.int64(4)).offsets)[-1] == 14

    def test_raw_route_outputs(self, rng):
        T, K, E = 6, 2, 3
        topk = rng.integers(0, E, (T, K))

        def outs():
            return (np.full(E + 1, -7, np.int32), np.full(T * K, -7, np.int32), np.full(T * K, -7, np.int32),
                    np.full((T, K), -7, np.int32))

        off, tok, perm, pos = outs()
        with pytest.raises(ValueError, match=r"^offsets: expected a writable tensor \(an output\), got a read-only one"):
            _C.moe_route(_readonly(off.copy()), tok, perm, pos, topk)
        with pytest.raises(ValueError, match=r"^pos: expected a writable tensor \(an output\), got a read-only one"):
            _C.moe_route(off, tok, perm, _readonly(pos.copy()), topk)
        with pytest.raises(ValueError, match=r"^token_ids: expected an output that shares no memory with perm"):
            _C.moe_route(off, tok, tok, pos, topk)
        with pytest.raises(ValueError, match=r"^pos: expected an output that shares no memory with top_k_index"):
            t32 = topk.astype(np.int32)
            _C.moe_route(off, tok, perm, t32, t32)
        with pytest.raises(ValueError, match=r"^offsets: expected 1 <= E < 2\*\*31 - 1 experts \(E \+ 1 int32 offsets\), got E = 0"):
            _C.moe_route(off[:1], tok, perm, pos, topk)
        with pytest.raises(ValueError, match=r"^perm: expected shape \(12,\), got \(11,\)"):
            _C.moe_route(off, tok, perm[:11], pos, topk)
        with pytest.raises(TypeError, match=r"^pos: expected dtype int32, got int64"):
            _C.moe_route(off, tok, perm, pos.astype(np.int64), topk)
        with pytest.raises(ValueError, match=r"^offsets: expected a 1-d tensor, got 2-d"):
            _C.moe_route(off[None], tok, perm, pos, topk)
        for a in (off, tok, perm, pos):
            assert (a == -7).all()

    def test_gather_weights(self, rng):
        T, K, E = 6, 2, 3
        r = sm.route(rng.integers(0, E, (T, K)), E)
        w = rng.random((T, K)).astype(np.float32)
        with pytest.raises(TypeError, match=r"^routing: expected a Routing \(from route\(\)\), got NoneType"):
            sm.gather_weights(w, None)
        with pytest.raises(TypeError, match=r"^top_k_weights: expected a tensor supporting DLPack .* got list"):
            sm.gather_weights(w.tolist(), r)
        with pytest.raises(ValueError, match=r"^top_k_weights: expected 12 entries \(the routing's \[T, K\]\), "
                                             r"got shape \(6, 3\)"):
            sm.gather_weights(rng.random((T, 3)).astype(np.float32), r)
        with pytest.raises(TypeError, match=r"^w: expected dtype float32, float16 or bfloat16, got int32"):
            sm.gather_weights(w.astype(np.int32), r)
        with pytest.raises(ValueError, match=r"^w: expected a C-contiguous tensor"):
            sm.gather_weights(np.ascontiguousarray(w.T).T, r)
        out = np.full(T * K, NAN, np.float32)
        with pytest.raises(ValueError, match=r"^perm: expected entries below 12 \(w's entries\), got perm\[3\] = 12"):
            perm = r.perm.copy()
            perm[3] = 12
            _C.moe_gather_weights(out, w, perm, r.offsets)
        with pytest.raises(ValueError, match=r"^out: expected a writable tensor \(an output\), got a read-only one"):
            _C.moe_gather_weights(_readonly(out.copy()), w, r.perm, r.offsets)
        with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with w"):
            _C.moe_gather_weights(w.reshape(-1), w, r.perm, r.offsets)
        with pytest.raises(ValueError, match=r"^offsets: expected 1 <= E < 2\*\*31 - 1 experts"):
            _C.moe_gather_weights(out, w, r.perm, r.offsets[:1])
        assert np.isnan(out).all()

    def test_combine(self, rng):
        T, K, H = 8, 2, 6
        r = sm.route(rng.integers(0, 3, (T, K)), 3)
        y = _randn(rng, T * K, H)
        with pytest.raises(TypeError, match=r"^y: expected a tensor supporting DLPack .* got list"):
            sm.combine(y.tolist(), r.pos)
        with pytest.raises(TypeError, match=r"^pos: expected a tensor supporting DLPack .* got list"):
            sm.combine(y, r.pos.tolist())
        with pytest.raises(TypeError, match=r"^pos: expected dtype int32, got int64"):
            sm.combine(y, r.pos.astype(np.int64))
        with pytest.raises(TypeError, match=r"^y: expected dtype float32, float16 or bfloat16, got int32"):
            sm.combine(y.astype(np.int32), r.pos, dtype="float32")
        with pytest.raises(TypeError, match=r"^dtype: expected 'float32', 'float16' or 'bfloat16', got 'int32'"):
            sm.combine(y, r.pos, dtype="int32")
        with pytest.raises(TypeError, match=r"^dtype: expected .* got 'nope'"):
            sm.combine(y, r.pos, dtype="nope")
        with pytest.raises(ValueError, match=r"^pos: expected a 2-d tensor, got 1-d"):
            sm.combine(y, r.pos.reshape(-1), out=np.empty((T * K, H), np.float32))
        out = np.full((T, H), NAN, np.float32)
        with pytest.raises(ValueError, match=r"^pos: expected shape \(8, 2\), got \(4, 2\)"):
            sm.combine(y, r.pos[:4], out=out)
        with pytest.raises(ValueError, match=r"^y: expected shape \(16, 6\), got \(16, 4\)"):
            sm.combine(y[:, :4], r.pos, out=out)
        with pytest.raises(ValueError, match=r"^y: expected rows of unit column stride that do not overlap"):
            sm.combine(np.ascontiguousarray(y.T).T, r.pos, out=out)
        with pytest.raises(ValueError, match=r"^out: expected a writable tensor \(an output\), got a read-only one"):
            sm.combine(y, r.pos, out=_readonly(out.copy()))
        with pytest.raises(ValueError, match=r"^out: expected a 2-d tensor"):
            sm.combine(y, r.pos, out=out.reshape(-1))
        assert np.isnan(out).all()

    def test_combine_aliasing(self, rng):
        T, H = 9, 5
        y = _randn(rng, T, H)
        pos = rng.permutation(T).astype(np.int32).reshape(T, 1)
        before = y.copy()
        with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with y, got overlapping memory"):
            sm.combine(y, pos, out=y)
        with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with y"):
            sm.combine(y[1:], pos[:8], out=y[:8])
        np.testing.assert_array_equal(y, before)
        buf = np.zeros(T + T * H, np.int32)
        pos_b = buf[:T].reshape(T, 1)
        pos_b[...] = pos
        with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with pos"):
            _C.moe_combine(buf[T - 3: T - 3 + T * H].view(np.float32).reshape(T, H), y, pos_b)

    def test_combine_nan_propagates(self, rng):
        T, K, H = 12, 3, 8
        topk = rng.integers(0, 4, (T, K))
        r = sm.route(topk, 4)
        y = _randn(rng, T * K, H)
        s_bad = int(rng.integers(0, T * K))
        y[s_bad, 2] = np.nan
        out = sm.combine(y, r.pos)
        users = (r.pos == s_bad).any(axis=1)
        assert users.sum() == 1
        assert np.isnan(out[users][:, 2]).all()
        assert np.isfinite(np.delete(out[users], 2, axis=1)).all()
        assert np.isfinite(out[~users]).all()

    # ---- moe_forward -------------------------------------------------------------------------

    def _moe(self, rng, E=3, H=64, I=64, fmt="samoyeds-1:2:64"):
        gate_up = sm.pack(_randn(rng, E, 2 * I, H) * H ** -0.5, fmt, glu=True)
        down = sm.pack(_randn(rng, E, H, I) * I ** -0.5, fmt)
        return gate_up, down

    def test_moe_forward(self, rng):
        gate_up, down = self._moe(rng)
        T, K = 7, 2
        x = _randn(rng, T, 64)
        topk = rng.integers(0, 3, (T, K))
        tw = rng.random((T, K)).astype(np.float32)
        with pytest.raises(TypeError, match=r"^gate_up: expected a PackedWeight, got NoneType"):
            moe_forward(x, topk, tw, None, down)
        with pytest.raises(TypeError, match=r"^down: expected a PackedWeight, got ndarray"):
            moe_forward(x, topk, tw, gate_up, np.zeros(3))
        with pytest.raises(ValueError, match=r"^gate_up: expected a weight packed with glu=True"):
            moe_forward(x, topk, tw, down, down)
        other_gu, other_down = self._moe(rng, E=2)
        with pytest.raises(ValueError, match=r"^down: expected shape \(3, 64, 64\) .*, got \(2, 64, 64\)"):
            moe_forward(x, topk, tw, gate_up, other_down)
        _, wide_down = self._moe(rng, H=128)
        with pytest.raises(ValueError, match=r"^down: expected shape \(3, 64, 64\) .*, got \(3, 128, 64\)"):
            moe_forward(x, topk, tw, gate_up, wide_down)
        with pytest.raises(TypeError, match=r"^top_k_index: expected a tensor supporting DLPack"):
            moe_forward(x, topk.tolist(), tw, gate_up, down)
        with pytest.raises(TypeError, match=r"^top_k_weights: expected a tensor supporting DLPack"):
            moe_forward(x, topk, tw.tolist(), gate_up, down)
        with pytest.raises(TypeError, match=r"^x: expected a tensor supporting DLPack"):
            moe_forward(x.tolist(), topk, tw, gate_up, down)
        with pytest.raises(TypeError, match=r"^x: expected dtype float32 \(that of gate_up_values\), got float16"):
            moe_forward(x.astype(np.float16), topk, tw, gate_up, down)
        with pytest.raises(ValueError, match=r"^x: expected shape \(7, 64\), got \(7, 32\)"):
            moe_forward(x[:, :32], topk, tw, gate_up, down)
        with pytest.raises(ValueError, match=r"^act: expected one of"):
            moe_forward(x, topk, tw, gate_up, down, act="gelu")

    def test_moe_forward_raw_op(self, rng):
        """The extension's one-call MoE forward checks every argument before it writes anything."""
        gate_up, down = self._moe(rng)
        T, K, E, H, I = 7, 2, 3, 64, 64
        x = _randn(rng, T, H)
        topk = rng.integers(0, E, (T, K))
        tw = rng.random((T, K)).astype(np.float32)
        n, m, v = gate_up.fmt.c_args()
        nbytes = _C.moe_workspace_bytes(T, K, E, H, I, 4)
        assert nbytes >= 4 * (E + 1 + 4 * T * K) + 4 * T * K * (I + H)
        ws = np.zeros(nbytes, np.uint8)

        def call(out=None, workspace=ws, x=x, topk=topk, tw=tw, inter=I, **kw):
            out = np.full((T, H), NAN, np.float32) if out is None else out
            args = dict(gate_up_values=gate_up.values, gate_up_meta=gate_up.meta, gate_up_idx=gate_up.idx,
                        down_values=down.values, down_meta=down.meta, down_idx=down.idx)
            args.update({k: kw.pop(k) for k in list(kw) if k in args})
            _C.moe_forward(out, workspace, x, topk, tw, args["gate_up_values"], args["gate_up_meta"],
                           args["gate_up_idx"], args["down_values"], args["down_meta"], args["down_idx"],
                           inter, n, m, v, **kw)
            return out

        np.testing.assert_array_equal(call(), moe_forward(x, topk, tw, gate_up, down))
        poisoned = np.full((T, H), NAN, np.float32)
        with pytest.raises(ValueError, match=r"^workspace: expected at least \d+ bytes "
                                             r"\(moe_workspace_bytes\(7, 2, 3, 64, 64, 4\)\), got \d+"):
            call(out=poisoned, workspace=ws[:nbytes - 1])
        with pytest.raises(TypeError, match=r"^workspace: expected dtype uint8"):
            call(out=poisoned, workspace=ws.view(np.int32))
        with pytest.raises(ValueError, match=r"^act: expected 1 \(swiglu\) or 2 \(gptoss\), got 0"):
            call(out=poisoned, act=0)
        with pytest.raises(ValueError, match=r"^impl: expected .*, got 7"):
            call(out=poisoned, impl=7)
        with pytest.raises(ValueError, match=r"^top_k_index: expected shape \(7, 2\), got \(6, 2\)"):
            call(out=poisoned, topk=topk[:6])
        with pytest.raises(ValueError, match=r"^top_k_weights: expected 14 entries"):
            call(out=poisoned, tw=tw[:, :1].copy())
        with pytest.raises(ValueError, match=r"^gate_up_values: expected shape"):
            call(out=poisoned, inter=256)
        with pytest.raises(ValueError, match=r"^down_values: expected shape \(3, 64, 64\), got \(2, 64, 64\)"):
            call(out=poisoned, down_values=down.values[:2], down_meta=down.meta[:2], down_idx=down.idx[:2])
        with pytest.raises(TypeError, match=r"^x: expected dtype float32 \(that of gate_up_values\), got float16"):
            call(out=poisoned, x=x.astype(np.float16))
        with pytest.raises(ValueError, match=r"^gate_up_bias: expected shape \(3, 128\)"):
            call(out=poisoned, gate_up_bias=np.zeros((3, 64), np.float32))
        with pytest.raises(ValueError, match=r"^out: expected shape \(7, 64\)"):
            call(out=np.full((7, 32), NAN, np.float32))
        with pytest.raises(ValueError, match=r"^workspace: expected an output that shares no memory with x"):
            buf = np.zeros(T * H + nbytes // 4, np.float32)
            buf[:T * H] = x.reshape(-1)
            call(out=poisoned, x=buf[:T * H].reshape(T, H), workspace=buf.view(np.uint8))
        with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with workspace"):
            call(out=ws[:T * H * 4].view(np.float32).reshape(T, H))
        with pytest.raises(ValueError, match=r"^intermediate: expected 0 <= intermediate < 2\*\*30, got -1"):
            call(out=poisoned, inter=-1)
        with pytest.raises(ValueError, match=r"^itemsize: expected 2 or 4, got 3"):
            _C.moe_workspace_bytes(T, K, E, H, I, 3)
        with pytest.raises(ValueError, match=r"^T, K: expected T\*K below 2\*\*31 \(int32 sorted rows\), got T = 4294967296, K = 1"):
            _C.moe_workspace_bytes(2**32, 1, E, H, I, 2)
        assert np.isnan(poisoned).all()

    def test_moe_forward_nan_propagates(self, rng):
        gate_up, down = self._moe(rng, fmt="2:4")  # every row kept: a NaN token poisons all its outputs
        T, K = 9, 2
        x = _randn(rng, T, 64)
        topk = rng.integers(0, 3, (T, K))
        topk[:, 1] = (topk[:, 0] + 1) % 3  # two distinct experts per token
        tw = rng.random((T, K)).astype(np.float32)
        t_bad = int(rng.integers(0, T))
        x[t_bad] = np.nan
        out = moe_forward(x, topk, tw, gate_up, down)
        assert np.isnan(out[t_bad]).all()
        assert np.isfinite(np.delete(out, t_bad, axis=0)).all()

    # ---- decode_meta ---------------------------------------------------------------------------

    def test_decode_meta(self, rng):
        meta = rng.integers(0, 2**32, (2, 3), dtype=np.uint32)
        pos = _C.decode_meta(meta)
        assert pos.shape == (2, 3, 8, 2)
        assert int(pos[1, 2, 5, 1]) == (int(meta[1, 2]) >> 22) & 3
        with pytest.raises(TypeError, match=r"Cannot cast array data from dtype\('float64'\)"):
            _C.decode_meta(rng.random(4))
        assert _C.decode_meta(np.zeros((1,) * 62, np.uint32)).shape == (1,) * 62 + (8, 2)
        for nd in (63, 64):
            with pytest.raises(ValueError, match=rf"^meta: expected at most 62 dimensions, got {nd}"):
                _C.decode_meta(np.zeros((1,) * nd, np.uint32))

    # ---- DLPack protocol problems and devices --------------------------------------------------

    def test_protocol_problems_are_buffer_errors(self, rng):
        y = _randn(rng, 4, 3)
        out = np.full((4, 3), NAN, np.float32)
        pos = np.zeros((4, 1), np.int32)
        with pytest.raises(BufferError, match=r"^y: DLPack version 2\.1 is not supported"):
            _C.moe_combine(out, CapsuleProducer(y, version=(2, 1)), pos)
        with pytest.raises(BufferError, match=r"^pos: producer reported a negative extent"):
            _C.moe_combine(out, y, CapsuleProducer(pos, shape=(-4, 1)))
        with pytest.raises(BufferError, match=r"^out: __dlpack_device__ did not return \(type, id\)"):
            _C.moe_combine(CapsuleProducer(out, reported_device=(1,)), y, pos)
        assert np.isnan(out).all()

    def test_mismatched_devices_without_a_gpu(self, rng):
        """A producer describing a CUDA tensor: refused next to CPU tensors
        before any memory is touched."""
        y = _randn(rng, 4, 3)
        out = np.full((4, 3), NAN, np.float32)
        pos = np.zeros((4, 1), np.int32)
        with pytest.raises(ValueError, match=r"^y: expected a tensor on cpu \(where out is\), got one on cuda:1"):
            _C.moe_combine(out, CapsuleProducer(y, device=(2, 1)), pos)
        with pytest.raises(ValueError, match=r"^pos: expected a tensor on cuda:0 \(where out is\), got one on cpu"):
            _C.moe_combine(CapsuleProducer(out, device=(2, 0)), CapsuleProducer(y, device=(2, 0)), pos)
        with pytest.raises(ValueError, match=r"^y: expected a tensor on cuda:0 \(where out is\), got one on cuda:1"):
            _C.moe_combine(CapsuleProducer(out, device=(2, 0)), CapsuleProducer(y, device=(2, 1)), pos)
        assert np.isnan(out).all()

    @pytest.mark.gpu
    def test_mismatched_devices(self, rng):
        y = _t(_randn(rng, 6, 4)).cuda()
        pos = _t(rng.permutation(6).astype(np.int32).reshape(6, 1))
        with pytest.raises(ValueError, match=r"^pos: expected a tensor on cuda:0 \(where out is\), got one on cpu"):
            sm.combine(y, pos)
        c = _Case(rng)
        p = sm.PackedWeight(_t(c.p.values), _t(c.p.meta), _t(c.p.idx), c.p.fmt, c.p.shape).to("cuda")
        with pytest.raises(ValueError, match=r"^x: expected a tensor on cuda:0 \(where values is\), got one on cpu"):
            sm.ssmm(_t(c.x), p, _t(c.offsets).cuda(), _t(c.token_ids).cuda(),
                    out=torch.empty(c.T, c.R, device="cuda"))


def test_empty_numpy_rows_with_zero_strides_are_taken():
    """NumPy gives a [0, n] array the strides (0, 0); with no element there is no layout to
    get wrong, so every row-strided argument takes it (T = 0 from NumPy)."""
    x = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (0, 8), (0, 0))   # as NumPy makes them
    assert x.strides == (0, 0)
    p = sm.pack(np.random.default_rng(0).standard_normal((2, 8, 8)).astype(np.float32), "2:4")
    gu = sm.pack(np.random.default_rng(1).standard_normal((2, 16, 8)).astype(np.float32), "2:4", glu=True)
    rt = sm.route(np.zeros((0, 1), np.int64), 2)
    assert sm.ssmm(x, p, rt.offsets, rt.token_ids).shape == (0, 8)
    dw = sm.ops.ssmm_dw(np.zeros((0, 8), np.float32), x, p, rt.offsets, rt.token_ids)
    assert dw.shape == tuple(p.values.shape) and not np.asarray(dw).any()
    assert sm.ops.glu_backward(np.zeros((0, 3), np.float32), np.zeros((0, 6), np.float32)).shape == (0, 6)
    assert sm.glu(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)).shape == (0, 3)
    assert sm.dense_decode(x, np.zeros((4, 8), np.float32)).shape == (0, 4)
    y = moe_forward(x, np.zeros((0, 2), np.int64), np.zeros((0, 2), np.float32), gu, p)
    assert y.shape == (0, 8)
    with pytest.raises(ValueError, match=r"^x: expected rows of unit column stride"):
        sm.ssmm(np.zeros((8, 3), np.float32).T, p, rt.offsets, rt.token_ids)   # (non-empty: still checked)


@pytest.mark.parametrize("call", [
    lambda: sm.patch_model(3), lambda: sm.unpatch_model(3), lambda: sm.is_patched(3),
    lambda: sm.freeze_experts(3), lambda: sm.save_pretrained(3, "unused"),
    lambda: sm.sparsify_model(3, calibration=[]), lambda: sm.finetune(3, []),
])
def test_model_functions_name_a_model_that_is_not_a_module(call):
    """Not an AttributeError from deep inside: a TypeError naming the argument."""
    with pytest.raises(TypeError, match=r"^model: expected a torch.nn.Module \(a transformers model\), got int"):
        call()
