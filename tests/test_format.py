"""The format: SparseFormat validation, mask selection, pack/unpack round trip
(hypothesis over shapes, formats, dtypes), the byte layout, and GPU parity."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import samoyeds as sm
from samoyeds import _C
from samoyeds.format import SparseFormat

DT = [torch.float32, torch.bfloat16, torch.float16]


def test_presets_and_parse():
    assert SparseFormat.parse("2:4").density == 0.5
    f = SparseFormat.parse("samoyeds-1:2:128")
    assert (f.n, f.m, f.v) == (1, 2, 128) and f.density == 0.25 and f.name == "samoyeds-1:2:128"
    assert SparseFormat.parse("1:4:64").density == 0.125
    assert SparseFormat(2, 2, 64) == SparseFormat.parse("2:4")  # n == m is plain 2:4
    for name in sm.PRESETS:
        assert SparseFormat.parse(name).name == name


@pytest.mark.parametrize("args,match", [((0, 2, 128), "^n: .*, got 0"), ((3, 2, 128), "^n: .*, got 3"),
                                        ((1, 9, 128), "^m: .*, got 9"), ((1, 2, 100), "^v: .*, got 100"),
                                        ((1, 2, None), "^v: .*, got None")])
def test_invalid_formats(args, match):
    with pytest.raises(ValueError, match=match):
        SparseFormat(*args)


def test_parse_unknown():
    with pytest.raises(ValueError, match="^fmt: expected one of"):
        SparseFormat.parse("3-4")


# Every spelling a user may try: accepted ones give the named format, refused ones a
# message that names the spelling and says what to write instead.
SPELLINGS = [
    ("2:4", "2:4"), (" 2:4 ", "2:4"), ("1:1:64", "2:4"), ((1, 1, None), "2:4"),
    ("samoyeds-1:2:128", "samoyeds-1:2:128"), ("1:2:128", "samoyeds-1:2:128"), ("SAMOYEDS-1:2:128", "samoyeds-1:2:128"),
    ((1, 2, 128), "samoyeds-1:2:128"), ("1:4:64", "samoyeds-1:4:64"), ("samoyeds-2:4:128", "samoyeds-2:4:128"),
    ((2, 4, 128), "samoyeds-2:4:128"),
    ("1:4", r"^fmt: expected '2:4' or a format with row selection, 'samoyeds-n:m:v' .*'samoyeds-1:4:128'\), "
            r"got '1:4'$"),
    ("1:2", r"'samoyeds-1:2:128'\), got '1:2'$"),
    ("samoyeds-1:2", r"'samoyeds-1:2:128'\), got 'samoyeds-1:2'$"),
    ("4:4", r"e\.g\. 'samoyeds-1:4:128'\), got '4:4'$"),
    ("2:4:128", r"^fmt: expected '2:4' \(plain 2:4 has no slice length\) or 'samoyeds-2:4:128' \(2 of every 4 rows "
                r"kept per 128-column slice, then 2:4 inside them\), got the ambiguous '2:4:128'$"),
    ("2:4:64", r"'samoyeds-2:4:64'.*got the ambiguous '2:4:64'$"),
    ((2, 4), r"^fmt: expected a tuple \(n, m, v\) \(v None for plain 2:4\), got \(2, 4\)$"),
    ("1:2:x", r"^fmt: expected one of \[.*\] or 'samoyeds-n:m:v' .*, got '1:2:x'$"),
    ("1:2:100", r"^v: expected a positive multiple of 32"),
]


@pytest.mark.parametrize("spec,want", SPELLINGS, ids=[repr(s) for s, _ in SPELLINGS])
def test_format_spellings(spec, want):
    if not want.startswith(("^", "'")) and "got" not in want:
        f = SparseFormat.parse(spec)
        assert f.name == want and SparseFormat.parse(f.name) == f  # the name reads back
    else:
        with pytest.raises(ValueError, match=want):
            SparseFormat.parse(spec)


def _brute_mask(w: np.ndarray, f: SparseFormat) -> np.ndarray:
    """Python transcription of the mask rule (the spec, slow)."""
    E, R, C = w.shape
    s = np.abs(w.astype(np.float64))
    out = np.zeros(w.shape, bool)
    V = f.v if f.selects_rows else C
    for e in range(E):
        for g0 in range(0, R, f.m):
            for c0 in range(0, C, V):
                c1 = min(c0 + V, C)
                sal, picks = [], []
                for r in range(f.m):
                    tot, pk = 0.0, []
                    for c in range(c0, c1, 4):
                        grp = s[e, g0 + r, c:c + 4]
                        a = int(np.argmax(grp))
                        rest = [i for i in range(4) if i != a]
                        b = max(rest, key=lambda i: (grp[i], -i))
                        tot += grp[a] + grp[b]
                        pk.append((c + a, c + b))
                    sal.append(tot)
                    picks.append(pk)
                order = sorted(range(f.m), key=lambda r: (-sal[r], r))[: f.n]
                for r in order:
                    for a, b in picks[r]:
                        out[e, g0 + r, a] = out[e, g0 + r, b] = True
    return out


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "1:4:32", "samoyeds-2:4:64", "3:4:32"]),
       E=st.integers(1, 3), groups=st.integers(1, 5), C4=st.integers(1, 70), seed=st.integers(0, 2**31 - 1))
def test_mask_matches_spec(fmt, E, groups, C4, seed):
    f = SparseFormat.parse(fmt)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((E, groups * f.m, 4 * C4)).astype(np.float32)
    m = sm.mask(w, f)
    assert m.dtype == np.bool_
    np.testing.assert_array_equal(m, _brute_mask(w, f))
    assert m.mean() == pytest.approx(f.density)


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "1:4:32", "samoyeds-2:4:64", "3:8:96"]),
       dtype=st.sampled_from(DT), E=st.integers(1, 3), groups=st.integers(1, 6), C4=st.integers(1, 80),
       glu=st.booleans(), seed=st.integers(0, 2**31 - 1), sparse_mask=st.booleans())
def test_roundtrip_exact(fmt, dtype, E, groups, C4, glu, seed, sparse_mask):
    f = SparseFormat.parse(fmt)
    gen = torch.Generator().manual_seed(seed)
    R = groups * f.m * (2 if glu else 1)
    w = torch.randn(E, R, 4 * C4, generator=gen).to(dtype)
    m = sm.mask(w, f)
    if sparse_mask:  # a mask that keeps less than the format allows is packed too
        m &= torch.rand(m.shape, generator=gen) < 0.5
    p = sm.pack(w, f, mask=m, glu=glu)
    assert torch.equal(sm.unpack(p), torch.where(m, w, torch.zeros_like(w)))
    # every stored 2:4 code is valid
    pos = _C.decode_meta(p.meta.numpy())
    assert (pos[..., 0] < pos[..., 1]).all()
    if p.idx is not None:
        assert int(p.idx.max()) < f.m


def test_single_matrix_and_numpy():
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float16)
    p = sm.pack(w, "samoyeds-1:2:128")
    assert p.shape == (64, 256) and p.values.shape == (1, 64, 128)
    d = sm.unpack(p)
    assert d.shape == (64, 256) and d.dtype == np.float16
    np.testing.assert_array_equal(d, np.where(sm.mask(w, "samoyeds-1:2:128"), w, 0))


def test_nbytes_ratio():
    w = torch.randn(4, 512, 1024, dtype=torch.bfloat16)
    p = sm.pack(w, "samoyeds-1:2:128")
    # values 25 % + metadata 1/16 of values' bits + indices 1 byte per 128-column slice
    assert 0.28 < p.nbytes / p.dense_nbytes < 0.29


def test_layout_worked_example():
    """The example of docs/FORMAT.md: one 4 x 8 weight, format 1:2:128."""
    w = torch.tensor([[0, 5, 0, 1, 9, 0, 0, 2],
                      [3, 0, 0, 4, 0, 0, 6, 7],
                      [1, 1, 0, 0, 0, 0, 8, 0],
                      [0, 0, 2, 2, 5, 5, 0, 0]], dtype=torch.float32)
    p = sm.pack(w, "samoyeds-1:2:128")
    # group (0,1): row 0 saliency 5+1+9+2 = 17 < row 1: 3+4+6+7 = 20 -> row 1; group (2,3): row 3 (14 > 10)
    assert p.idx[0, 0, :2].tolist() == [1, 1]
    assert p.values[0, 0, :4].tolist() == [3, 4, 6, 7]
    assert p.values[0, 1, :4].tolist() == [2, 2, 5, 5]
    word0 = int(p.meta[0, 0, 0, 0])  # storage row 0 (low half) and row 8 (padding, high half)
    assert word0 & 0xff == (0 | 3 << 2) | ((2 | 3 << 2) << 4)
    assert word0 >> 16 == 0x4444


def test_pack_rejects_bad_mask():
    w = torch.randn(4, 64)
    m = torch.zeros(4, 64, dtype=torch.bool)
    m[0, :3] = True
    with pytest.raises(ValueError, match="keep more than 2 of 4"):
        sm.pack(w, "2:4", mask=m)
    m = torch.zeros(4, 64, dtype=torch.bool)
    m[0, 0] = m[1, 0] = True
    with pytest.raises(ValueError, match="keep more than 1 of 2 rows"):
        sm.pack(w, "samoyeds-1:2:64", mask=m)


def test_unpack_rejects_corrupt_data():
    p = sm.pack(torch.randn(2, 64, 128), "samoyeds-1:2:64")
    p.meta[0, 0, 0, 0] = 0x5  # positions (1, 1)
    with pytest.raises(ValueError, match="invalid 2:4 code"):
        sm.unpack(p)
    p = sm.pack(torch.randn(2, 64, 128), "samoyeds-1:2:64")
    p.idx[1, 0, 3] = 7
    with pytest.raises(ValueError, match="idx"):
        sm.unpack(p)


@pytest.mark.parametrize("fmt,R", [("samoyeds-1:2:128", 63), ("2:4", 10)])
def test_shape_rules(fmt, R):
    w = torch.randn(R, 128)
    if R % SparseFormat.parse(fmt).m:
        with pytest.raises(ValueError, match="multiple of m"):
            sm.pack(w, fmt)
    else:
        sm.pack(w, fmt)
    with pytest.raises(ValueError, match="multiple of 4"):
        sm.pack(torch.randn(8, 130), fmt)


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "1:4:64", "samoyeds-2:4:64"])
@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("glu", [False, True])
def test_gpu_pack_matches_cpu(fmt, dtype, glu):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    f = SparseFormat.parse(fmt)
    E, R, C = 3, 2 * f.m * 37, 4 * 53
    w = torch.randn(E, R, C, generator=gen).to(dtype)
    m_cpu = sm.mask(w, f)
    m_gpu = sm.mask(w.cuda(), f)
    assert torch.equal(m_gpu.cpu(), m_cpu)
    p_cpu = sm.pack(w, f, glu=glu)
    p_gpu = sm.pack(w.cuda(), f, glu=glu)
    for name, t in p_cpu.tensors().items():
        assert torch.equal(getattr(p_gpu, name).cpu(), t), name
    assert torch.equal(sm.unpack(p_gpu).cpu(), torch.where(m_cpu, w, torch.zeros_like(w)))


@pytest.mark.gpu
def test_gpu_pack_errors():
    w = torch.randn(4, 64, device="cuda")
    m = torch.zeros(4, 64, dtype=torch.bool, device="cuda")
    m[2, 4:7] = True
    with pytest.raises(ValueError, match="row 2, columns 4..7"):
        sm.pack(w, "2:4", mask=m)
    p = sm.pack(torch.randn(2, 64, 128, device="cuda"), "samoyeds-1:2:64")
    p.meta[1, 0, 0, 0] = 0xF
    with pytest.raises(ValueError, match="invalid 2:4 code"):
        sm.unpack(p)


@pytest.mark.gpu
def test_gpu_pack_mixtral_layer_fast():
    import time
    w = torch.randn(8, 28672, 4096, dtype=torch.bfloat16, device="cuda")
    sm.pack(w[:1, :1024], "samoyeds-1:2:128", glu=True)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    p = sm.pack(w, "samoyeds-1:2:128", glu=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"pack of 8 x 28672 x 4096 bf16: {dt * 1e3:.1f} ms")
    assert p.values.shape == (8, 14336, 2048)
    assert dt < 1.0
