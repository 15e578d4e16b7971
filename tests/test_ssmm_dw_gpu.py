"""ssmm_dw on the GPU (cuda/ssmm_dw.cu, cuda/ssmm_dw_wgmma.cu): the CUDA kernels against the C reference (CPU,
same inputs) and a float64 torch oracle, on fresh random inputs per case, the output
poisoned with NaN first: every entry written, padding entries and experts without rows
exactly 0, rows past offsets[E] never read (NaN there), bit-identical run to run.
On sm_90 the default runs the wgmma kernel (ssmm_dw_wgmma.cu); the tests marked `impl`
also run the mma.sync kernel (impl="mma") and both of the wgmma kernel's producers
(impl="gather", "copy"; sm_90a only), whichever the rule picks."""
from __future__ import annotations


import pytest
import torch

import samoyeds as sm
from helpers import dy_t_of, random_topk, rel_err, wgmma_runs
from samoyeds.ops import ssmm_dw

FORMATS = ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "1:4:64", "samoyeds-1:2:192"]

CASES = [  # T, K, E, (R plain, R glu), C, pattern
    (37, 2, 4, (136, 136), 200, "uniform"),      # odd rows per expert; C not a multiple of 128
    (5, 2, 8, (96, 96), 128, "skewed"),          # 1..3 rows per expert, empty experts; 64 storage rows
    (0, 2, 3, (64, 64), 128, "uniform"),         # T = 0: every value 0
    (300, 2, 4, (200, 144), 584, "one"),         # 300 rows in one expert (K loop of 10); 3 column blocks
    (129, 3, 6, (144, 272), 264, "placeholder"), # ids >= E: rows past offsets[E] (NaN) never read
    (61, 2, 3, (36, 40), 72, "uniform"),         # rows per half not a multiple of 8: dy read by elements
]
VARIANTS = [  # token_ids, scale
    (True, False),
    (False, True),   # x in sorted order (a down projection), routing scales
    (True, True),
]


def slot_map(p: sm.PackedWeight):
    """(slot [E, R, C] int64, kept [E, R, C] bool): the flat index into p.values of the value
    at each kept position, found by unpacking values that hold their own index + 1."""
    n = p.values.numel()
    assert n < 2 ** 24, "ids must be exact in float32"
    ids = torch.arange(1, n + 1, dtype=torch.float32).reshape(p.values.shape)
    cpu = p.to("cpu")
    dense = sm.unpack(sm.PackedWeight(ids, cpu.meta, cpu.idx, cpu.fmt, cpu.shape, cpu.glu))
    kept = dense > 0
    return (dense.long() - 1).clamp_min(0), kept


def oracle_dw(dy, x, p, offsets, token_ids, scale):
    """float64 gradient in the packed layout (0 at padding entries), and the mask of the
    entries that hold a kept value."""
    E, R, C = p.shape3
    off = offsets.cpu().tolist()
    g = torch.zeros(E, R, C, dtype=torch.float64)
    for e in range(E):
        rows = torch.arange(off[e], off[e + 1])
        if rows.numel() == 0:
            continue
        xt = x[token_ids[rows].long()] if token_ids is not None else x[rows]
        d = dy[rows].double()
        if scale is not None:
            d = d * scale[rows].double()[:, None]
        g[e] = d.T @ xt.double()
    slot, kept = slot_map(p)
    out = torch.zeros(p.values.numel(), dtype=torch.float64)
    out[slot[kept]] = g[kept]
    covered = torch.zeros(p.values.numel(), dtype=torch.bool)
    covered[slot[kept]] = True
    return out.reshape(p.values.shape), covered.reshape(p.values.shape)


def make_inputs(case, fmt, dtype, glu, with_ids, with_scale, seed):
    T, K, E, Rs, C, pattern = case
    R = Rs[1] if glu else Rs[0]
    gen = torch.Generator().manual_seed(seed)
    p = sm.pack(torch.randn(E, R, C, generator=gen).to(dtype), fmt, glu=glu)
    r = sm.route(random_topk(T, K, E, pattern, gen), E)
    S, n = T * K, int(r.offsets[-1])
    # rows padded to 8 elements (the GPU takes 16-byte row strides): R not a multiple of 8
    # still reaches the kernel's element-wise reads of dy
    dy = torch.randn(S, (R + 7) // 8 * 8, generator=gen).to(dtype)[:, :R]
    dy[n:] = float("nan")  # rows past offsets[E] are never read
    if with_ids:
        x, tok = torch.randn(T, C, generator=gen).to(dtype), r.token_ids
    else:
        x, tok = torch.randn(S, C, generator=gen).to(dtype), None
        x[n:] = float("nan")
    sc = torch.rand(S, generator=gen) if with_scale else None
    return p, r, dy, x, tok, sc


def on(t, device):
    """t on device with its row stride kept (``.to`` makes a sliced tensor contiguous)."""
    if t.dim() != 2 or t.stride(0) == t.shape[1] or t.stride(1) != 1:
        return t.to(device)
    buf = torch.empty(t.shape[0], t.stride(0), dtype=t.dtype, device=device)
    buf[:, :t.shape[1]] = t.to(device)
    return buf[:, :t.shape[1]]


def run_dw(p, r, dy, x, tok, sc, device, dy_ids=None):
    pd = p.to(device)
    out = torch.full(p.values.shape, float("nan"), dtype=dy.dtype, device=device)
    to = (lambda t: None if t is None else on(t, device))
    got = ssmm_dw(to(dy), to(x), pd, to(r.offsets), to(tok), to(sc), out=out, impl=IMPL["impl"],
                  dy_token_ids=to(dy_ids))
    assert got is out
    if device != "cpu":
        torch.cuda.synchronize()
    return out.cpu()


def check(case, fmt, dtype, glu, with_ids, with_scale, device="cuda"):
    seed = torch.seed() % 2 ** 31
    p, r, dy, x, tok, sc = make_inputs(case, fmt, dtype, glu, with_ids, with_scale, seed)
    want, covered = oracle_dw(dy, x, p, r.offsets, tok, sc)
    ref = run_dw(p, r, dy, x, tok, sc, "cpu")  # the C reference
    got = run_dw(p, r, dy, x, tok, sc, device)
    assert torch.isfinite(got).all(), f"unwritten or non-finite entries (seed {seed})"
    assert not got[~covered].any(), f"padding entries must be exactly 0 (seed {seed})"
    off = r.offsets.tolist()
    for e in range(len(off) - 1):
        if off[e + 1] == off[e]:
            assert not got[e].any(), f"expert {e} has no rows: its gradient is 0 (seed {seed})"
    e_ref, e_got = rel_err(ref, want), rel_err(got, want)
    # the kernel rounds dy * scale to the operand dtype before the tensor cores (the C
    # reference keeps it in fp32): one more rounding of the same size as the output's
    slack = 3.0 if sc is not None else 2.0
    assert e_got <= slack * e_ref + 1e-6, (e_got, e_ref, seed)
    return p, r, dy, x, tok, sc, got


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("with_ids,with_scale", VARIANTS)
def test_cuda_matches_ref_and_oracle(case, fmt, glu, with_ids, with_scale):
    check(case, fmt, torch.bfloat16, glu, with_ids, with_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("glu", [False, True])
def test_cuda_float16(case, fmt, glu):
    check(case, fmt, torch.float16, glu, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,glu", [("samoyeds-1:2:128", True), ("samoyeds-1:2:64", False), ("1:4:64", True),
                                     ("2:4", False), ("2:4", True)])
def test_cuda_larger_and_deterministic(fmt, glu):
    """Several row and column blocks per expert, long K loops, an A tile per slice; two runs
    bit-identical (no atomics, a fixed order)."""
    case = (1000, 2, 8, (512, 768), 1024, "skewed")
    p, r, dy, x, tok, sc, got = check(case, fmt, torch.bfloat16, glu, True, glu)
    again = run_dw(p, r, dy, x, tok, sc, "cuda")
    assert torch.equal(got, again), "two runs differ"


@pytest.mark.gpu
def test_cuda_row_strides():
    """dy and x with row strides (slices of wider rows): the same bits as contiguous copies."""
    gen = torch.Generator().manual_seed(5)
    E, T, K, R, C = 3, 50, 2, 136, 200
    p = sm.pack(torch.randn(E, R, C, generator=gen).to(torch.bfloat16), "samoyeds-1:2:64").to("cuda")
    r = sm.route(random_topk(T, K, E, "uniform", gen), E)
    big_dy = torch.randn(T * K, R + 24, generator=gen).to(torch.bfloat16).cuda()
    big_x = torch.randn(T, C + 8, generator=gen).to(torch.bfloat16).cuda()
    off, tok = r.offsets.cuda(), r.token_ids.cuda()
    a = ssmm_dw(big_dy[:, :R], big_x[:, :C], p, off, tok)
    b = ssmm_dw(big_dy[:, :R].contiguous(), big_x[:, :C].contiguous(), p, off, tok)
    torch.cuda.synchronize()
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_refuses_formats_without_a_kernel():
    """n > 1 runs on the C reference only: the GPU call raises, as ssmm's does."""
    gen = torch.Generator().manual_seed(6)
    p = sm.pack(torch.randn(2, 64, 128, generator=gen).to(torch.bfloat16), "3:8:32").to("cuda")
    off = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
    dy = torch.randn(4, 64, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(4, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(NotImplementedError, match=r"^ssmm_dw: the GPU kernel needs n = 1"):
        ssmm_dw(dy, x, p, off)


@pytest.mark.parametrize("fmt", ["samoyeds-1:2:64", "1:4:64", "2:4"])
def test_oracle_agrees_with_the_c_reference(fmt):
    """The oracle of this file (slot map by unpacking ids) against the C reference on the CPU:
    the GPU tests' yardstick is sound."""
    case = (37, 2, 4, (136, 136), 200, "skewed")
    p, r, dy, x, tok, sc = make_inputs(case, fmt, torch.float32, True, True, True, 3)
    want, covered = oracle_dw(dy, x, p, r.offsets, tok, sc)
    ref = run_dw(p, r, dy, x, tok, sc, "cpu")
    assert rel_err(ref, want) < 1e-5
    assert not ref[~covered].any()


# ---- the wgmma kernel's tiles (ssmm_dw_wgmma.cu: 256 storage rows x 128 columns, 64-token
# k-tiles in a ring of 4 (2 with two G tiles), G tiles per slice of a CTA's two 64-column halves)
WGMMA_FORMATS = FORMATS + ["samoyeds-1:4:128", "samoyeds-1:4:320", "samoyeds-1:2:320"]
WGMMA_CASES = [  # T, K, E, (R plain, R glu), C, pattern
    (700, 2, 3, (640, 1152), 392, "one"),        # rp 320 / 640: partial last row block; 4 column blocks,
                                                 # the last partial; 11+ k-tiles (past the ring)
    (260, 3, 5, (512, 1024), 520, "skewed"),     # k-tiles 4 / 5 per expert, empty experts; C % 64 == 8
    (90, 2, 4, (264, 528), 136, "placeholder"),  # rc not a multiple of 64: padding rows inside a block
    (33, 2, 2, (72, 88), 64, "uniform"),         # C < 128: a column block half past C; rows by elements
]


IMPL = {"impl": "auto"}   # run_dw's ssmm_dw(impl=...), set by the fixture below


@pytest.fixture(params=["auto", "mma", "gather", "copy"])
def impl(request):
    """Which ssmm_dw kernel: the rule's, the mma.sync one, or the wgmma one with either
    producer (dy's kept rows gathered from dy, or read from its transposed copy)."""
    if request.param in ("gather", "copy") and not wgmma_runs():
        pytest.skip("the wgmma kernel needs an sm_90 device and the sm_90a build")
    IMPL["impl"] = request.param
    yield request.param
    IMPL["impl"] = "auto"


@pytest.mark.gpu
@pytest.mark.parametrize("case", WGMMA_CASES)
@pytest.mark.parametrize("fmt", WGMMA_FORMATS)
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("with_ids,with_scale", [(True, False), (False, True)])
def test_cuda_wgmma_tiles(case, fmt, glu, with_ids, with_scale, impl):
    check(case, fmt, torch.bfloat16, glu, with_ids, with_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", WGMMA_FORMATS)
@pytest.mark.parametrize("glu", [False, True])
def test_cuda_wgmma_float16_deterministic(fmt, glu, impl):
    case = WGMMA_CASES[0]
    p, r, dy, x, tok, sc, got = check(case, fmt, torch.float16, glu, True, True)
    again = run_dw(p, r, dy, x, tok, sc, "cuda")
    assert torch.equal(got, again), "two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,glu", [("samoyeds-1:2:128", True), ("samoyeds-1:2:192", False), ("1:4:64", True),
                                     ("2:4", False)])
def test_cuda_kernels_agree(fmt, glu):
    """The wgmma and the mma.sync kernel on the same inputs: both within the reference's error
    of the oracle, and close to each other (fp32 sums in different orders: not bitwise)."""
    case = WGMMA_CASES[1]
    seed = 11
    p, r, dy, x, tok, sc = make_inputs(case, fmt, torch.bfloat16, glu, True, True, seed)
    a = run_dw(p, r, dy, x, tok, sc, "cuda")
    IMPL["impl"] = "mma"
    try:
        b = run_dw(p, r, dy, x, tok, sc, "cuda")
    finally:
        IMPL["impl"] = "auto"
    want, _ = oracle_dw(dy, x, p, r.offsets, tok, sc)
    assert rel_err(a, want) < 2e-2 and rel_err(b, want) < 2e-2
    assert rel_err(a, b.double()) < 2e-2


# ---- dy read by token id (dy_token_ids: the down projection's output gradient without its
# gathered [S, R] copy): every kernel against the same call on the gathered rows

def dy_by_ids(case, fmt, glu, seed, with_scale=True):
    """make_inputs' problem with x in sorted order (routing scales or none), and dy as [T + 3, R]
    rows by token (a source row per token, 3 rows no sorted row reads), the sorted rows'
    ids into it, and those rows gathered ([S, R], NaN past offsets[E])."""
    p, r, dy, x, tok, sc = make_inputs(case, fmt, torch.bfloat16, glu, False, with_scale, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    T, R, n = case[0], dy.shape[1], int(r.offsets[-1])
    src = torch.randn(T + 3, (R + 7) // 8 * 8, generator=gen).to(torch.bfloat16)[:, :R]
    ids = (r.token_ids.long() + 3).to(torch.int32)   # rows 0..2 of src: read by no sorted row
    full = torch.empty(len(ids), src.stride(0), dtype=src.dtype)[:, :R]   # rows of 16 bytes, as src's
    full.copy_(src[ids.long()])
    full[n:] = float("nan")
    return p, r, src, ids, full, x, sc


@pytest.mark.parametrize("fmt,glu", [("samoyeds-1:2:64", True), ("2:4", False)])
def test_dy_token_ids_c_reference(fmt, glu):
    """The C reference reading dy by id: the bits of the call on the gathered rows; an id of a
    routed row outside dy, or ids of another length, refused naming dy_token_ids."""
    p, r, src, ids, full, x, sc = dy_by_ids(CASES[4], fmt, glu, 7)
    got = run_dw(p, r, src, x, None, sc, "cpu", dy_ids=ids)
    assert torch.equal(got, run_dw(p, r, full, x, None, sc, "cpu"))
    want, _ = oracle_dw(full, x, p, r.offsets, None, sc)
    assert rel_err(got, want) < 2e-2
    bad = ids.clone()
    bad[int(r.offsets[1]) - 1] = src.shape[0]
    with pytest.raises(ValueError, match=r"dy_token_ids\[\d+\] = \d+ is outside dy's"):
        run_dw(p, r, src, x, None, sc, "cpu", dy_ids=bad)
    with pytest.raises(ValueError, match=r"^dy_token_ids: expected shape"):
        run_dw(p, r, src, x, None, sc, "cpu", dy_ids=ids[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4], CASES[5], WGMMA_CASES[0]])
@pytest.mark.parametrize("fmt,glu", [("samoyeds-1:2:128", True), ("samoyeds-1:2:192", False), ("1:4:64", True),
                                     ("2:4", False)])
def test_cuda_dy_token_ids(case, fmt, glu, impl):
    """Every kernel reading dy by id: the bits of the same kernel on the gathered rows, within
    the C reference's error of the oracle; an id outside dy read as a zero row.  2:4 without
    scales: the mma.sync kernel's direct path (dy's rows by cp.async)."""
    seed = torch.seed() % 2 ** 31
    p, r, src, ids, full, x, sc = dy_by_ids(case, fmt, glu, seed, with_scale=fmt != "2:4")
    got = run_dw(p, r, src, x, None, sc, "cuda", dy_ids=ids)
    assert torch.isfinite(got).all(), f"unwritten or non-finite entries (seed {seed})"
    assert torch.equal(got, run_dw(p, r, full, x, None, sc, "cuda")), f"differs from the gathered rows (seed {seed})"
    want, _ = oracle_dw(full, x, p, r.offsets, None, sc)
    ref = run_dw(p, r, src, x, None, sc, "cpu", dy_ids=ids)
    assert rel_err(got, want) <= 3.0 * rel_err(ref, want) + 1e-6, seed
    n = int(r.offsets[-1])
    if n:
        bad = ids.clone()
        zeroed = torch.empty(full.shape[0], src.stride(0), dtype=full.dtype)[:, :full.shape[1]]   # 16-byte rows
        zeroed.copy_(full)
        bad[n // 2] = -7 if n % 2 else src.shape[0] + 40
        zeroed[n // 2] = 0
        got = run_dw(p, r, src, x, None, sc, "cuda", dy_ids=bad)
        assert torch.equal(got, run_dw(p, r, zeroed, x, None, sc, "cuda")), f"a bad id is a zero row (seed {seed})"


# ---- dy_t: dy * scale already in the copy producer's transposed layout (glu_backward's out_t)

@pytest.mark.parametrize("fmt,glu", [("samoyeds-1:2:64", True), ("2:4", False)])
def test_dy_t_c_reference(fmt, glu):
    """The C reference reading dy_t: without a scale the bits of the call on dy; with one,
    within the oracle's tolerance (dy * scale rounded once more); a dy_t of another shape
    refused naming it."""
    for with_scale in (False, True):
        p, r, dy, x, tok, sc = make_inputs(CASES[4], fmt, torch.float32, glu, True, with_scale, 5)
        t = dy_t_of(dy, r.offsets, sc)
        got = ssmm_dw(dy, x, p, r.offsets, tok, sc, dy_t=t)
        if not with_scale:
            assert torch.equal(got, ssmm_dw(dy, x, p, r.offsets, tok, sc))
        want, _ = oracle_dw(dy, x, p, r.offsets, tok, sc)
        assert rel_err(got, want) < 1e-5
    with pytest.raises(ValueError, match=r"^dy_t: expected shape"):
        ssmm_dw(dy, x, p, r.offsets, tok, sc, dy_t=t[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4], WGMMA_CASES[0], WGMMA_CASES[1]])
@pytest.mark.parametrize("fmt,glu", [("samoyeds-1:2:128", True), ("samoyeds-1:2:192", False), ("1:4:64", True),
                                     ("2:4", False)])
@pytest.mark.parametrize("with_scale", [False, True])
def test_cuda_dy_t(case, fmt, glu, with_scale):
    """The copy producer reading the caller's dy_t: the bits of the kernel making its own copy
    (the same values, rounded the same way); the other kernels refuse it."""
    if not wgmma_runs():
        pytest.skip("dy_t is read by the sm_90a wgmma kernel only")
    seed = torch.seed() % 2 ** 31
    p, r, dy, x, tok, sc = make_inputs(case, fmt, torch.bfloat16, glu, True, with_scale, seed)
    t = dy_t_of(dy, r.offsets, sc).cuda()
    pd, to = p.to("cuda"), (lambda a: None if a is None else on(a, "cuda"))
    args = (to(dy), to(x), pd, to(r.offsets), to(tok), to(sc))
    want = ssmm_dw(*args, impl="copy")
    for impl in ("auto", "copy"):
        got = ssmm_dw(*args, torch.full_like(want, float("nan")), impl=impl, dy_t=t)
        assert torch.equal(got, want), (impl, seed)
    for impl in ("mma", "gather"):
        with pytest.raises(NotImplementedError, match=r"^ssmm_dw: dy_t is read by the wgmma kernel's copy producer"):
            ssmm_dw(*args, impl=impl, dy_t=t)
