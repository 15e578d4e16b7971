"""_C.format_transpose_values (csrc/format_ref.c, cuda/format.cu): the values of W^T's plain
2:4 packing, under its metadata, from the packed W -- the refresh of PackedWeight.transposed()
after an optimizer step.  The C reference against pack() of the transposed masked dense weight;
the kernel against the reference on fresh random weights of odd shapes (every format whose
transpose is 2:4, GLU or not, slices narrower and wider than a tile, every dtype), outputs
poisoned; malformed metadata stays inside the arrays; bad arguments name themselves."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import samoyeds as sm
from samoyeds import _C

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CASES = [  # fmt, glu, E, R, C
    ("samoyeds-1:2:128", True, 3, 40, 200),
    ("samoyeds-1:2:128", False, 2, 132, 260),
    ("samoyeds-1:4:64", False, 3, 12, 136),
    ("samoyeds-2:4:64", False, 2, 8, 96),
    ("samoyeds-1:8:32", True, 2, 16, 64),
    ("samoyeds-1:2:32", True, 2, 264, 100),
    ("samoyeds-1:2:128", True, 1, 4, 4),
    ("samoyeds-1:2:128", True, 0, 8, 64),
]


def _weight(fmt, glu, E, R, C, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    pw = sm.pack(torch.randn(E, R, C, generator=gen).to(dtype), fmt, glu=glu)
    if device != "cpu":
        pw = sm.PackedWeight(pw.values.to(device), pw.meta.to(device),
                             None if pw.idx is None else pw.idx.to(device), pw.fmt, pw.shape, pw.glu)
    return pw


def _transpose(pw, t, out=None, values=None):
    """format_transpose_values for pw into out (default: a poisoned tensor shaped like t.values)."""
    E, R, C = pw.shape3
    n, m, v = pw.fmt.c_args()
    if out is None:
        out = torch.full(t.values.shape, float("nan"), dtype=pw.values.dtype, device=pw.values.device)
    _C.format_transpose_values(out, t.meta, pw.values if values is None else values, pw.meta, pw.idx,
                               n, m, v, pw.glu, R, C)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,glu,E,R,C", CASES)
def test_ref_is_the_2_4_packing_of_the_transpose(fmt, glu, E, R, C, dtype):
    pw = _weight(fmt, glu, E, R, C, dtype, "cpu", seed=torch.seed() % 2**31)
    t = pw.transposed()
    # new values, padding entries of the packed layout included (no place reads those)
    with torch.no_grad():
        pw.values.copy_(torch.randn(pw.values.shape).to(dtype))
    out = _transpose(pw, t)
    dense = sm.unpack(pw).transpose(1, 2).contiguous()
    want = sm.pack(dense, "2:4", mask=sm.unpack(sm.PackedWeight(out, t.meta, None, t.fmt, t.shape, False)) != 0)
    assert not torch.isnan(out.float()).any()      # every place written, padding rows and columns 0
    assert torch.equal(out, want.values)
    assert torch.equal(sm.unpack(sm.PackedWeight(out, t.meta, None, t.fmt, t.shape, False)), dense)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(["samoyeds-1:2:128", "samoyeds-1:2:32", "1:4:32", "samoyeds-2:4:64", "1:8:96",
                            "samoyeds-2:8:64"]),
       glu=st.booleans(), E=st.integers(1, 3), groups=st.integers(1, 9), cols=st.integers(1, 70),
       seed=st.integers(0, 2**31 - 1))
def test_ref_any_shape(fmt, glu, E, groups, cols, seed):
    """Every transposable format, row counts of whole groups (a multiple of 4 overall), any
    column count that is a multiple of 4: the refresh is pack() of the transposed weight."""
    f = sm.SparseFormat.parse(fmt)
    half = groups * f.m
    if half * (2 if glu else 1) % 4:
        half *= 2                   # (R a multiple of 4: W^T's 2:4 groups)
    R, C = (2 * half if glu else half), 4 * cols
    gen = torch.Generator().manual_seed(seed)
    pw = sm.pack(torch.randn(E, R, C, generator=gen), fmt, glu=glu)
    assert pw.transposable
    t = pw.transposed()
    with torch.no_grad():
        pw.values.copy_(torch.randn(pw.values.shape, generator=gen))
    out = _transpose(pw, t)
    assert not torch.isnan(out).any()
    assert torch.equal(sm.unpack(sm.PackedWeight(out, t.meta, None, t.fmt, t.shape, False)),
                       sm.unpack(pw).transpose(1, 2))


def test_errors_name_the_argument():
    pw = _weight("samoyeds-1:2:128", True, 2, 40, 200, torch.float32, "cpu", seed=1)
    t = pw.transposed()
    n, m, v = pw.fmt.c_args()
    out = torch.empty_like(t.values)
    with pytest.raises(ValueError, match=r"^out: "):
        _C.format_transpose_values(out[:, :-1], t.meta, pw.values, pw.meta, pw.idx, n, m, v, True, 40, 200)
    with pytest.raises(TypeError, match=r"^out: "):
        _C.format_transpose_values(out.double(), t.meta, pw.values, pw.meta, pw.idx, n, m, v, True, 40, 200)
    with pytest.raises(ValueError, match=r"^tmeta: "):
        _C.format_transpose_values(out, t.meta[:, :-1], pw.values, pw.meta, pw.idx, n, m, v, True, 40, 200)
    with pytest.raises(ValueError, match=r"^rows: expected a multiple of 4"):
        _C.format_transpose_values(out, t.meta, pw.values, pw.meta, pw.idx, n, m, v, False, 42, 200)
    with pytest.raises(ValueError, match=r"^rows: "):
        _C.format_transpose_values(out, t.meta, pw.values, pw.meta, pw.idx, n, m, v, True, -4, 200)
    with pytest.raises(TypeError, match=r"^cols: "):
        _C.format_transpose_values(out, t.meta, pw.values, pw.meta, pw.idx, n, m, v, True, 40, 200.0)
    with pytest.raises(ValueError, match=r"^values: "):
        _C.format_transpose_values(out, t.meta, pw.values, pw.meta, pw.idx, n, m, v, True, 40, 264)
    with pytest.raises(ValueError, match=r"^out: .*shares no memory"):
        _C.format_transpose_values(pw.values.view(-1)[: out.numel()].view(out.shape), t.meta, pw.values, pw.meta,
                                   pw.idx, n, m, v, True, 40, 200)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,glu,E,R,C", CASES + [("samoyeds-1:2:128", True, 4, 1536, 2048),
                                                   ("samoyeds-1:4:64", True, 3, 1416, 704)])
def test_cuda_matches_the_reference(fmt, glu, E, R, C, dtype):
    pw = _weight(fmt, glu, E, R, C, dtype, "cuda", seed=torch.seed() % 2**31)
    t = pw.transposed()
    with torch.no_grad():
        pw.values.copy_(torch.randn(pw.values.shape, device="cuda").to(dtype))
    out = _transpose(pw, t)
    torch.cuda.synchronize()
    cpu = sm.PackedWeight(pw.values.cpu(), pw.meta.cpu(), None if pw.idx is None else pw.idx.cpu(), pw.fmt,
                          pw.shape, pw.glu)
    tc = sm.PackedWeight(t.values.cpu(), t.meta.cpu(), None, t.fmt, t.shape, False)
    ref = _transpose(cpu, tc)
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(sm.unpack(sm.PackedWeight(out, t.meta, None, t.fmt, t.shape, False)),
                       sm.unpack(pw).transpose(1, 2))


@pytest.mark.gpu
def test_cuda_malformed_metadata_stays_inside():
    """Row indices past the group and repeated 2:4 positions: unspecified values, no access
    outside the arrays (run under compute-sanitizer by benchmarks/sanitize_cases.py)."""
    pw = _weight("samoyeds-1:2:128", True, 2, 264, 200, torch.bfloat16, "cuda", seed=3)
    t = pw.transposed()
    idx = torch.randint(0, 256, pw.idx.shape, dtype=torch.uint8, device="cuda")
    meta = torch.randint(0, 2**31, pw.meta.shape, dtype=torch.int32, device="cuda").view(torch.uint32)
    out = _transpose(sm.PackedWeight(pw.values, meta, idx, pw.fmt, pw.shape, pw.glu), t)
    torch.cuda.synchronize()
    assert not torch.isnan(out.float()).any()
