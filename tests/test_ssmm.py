"""ssmm: the C reference against a float64 oracle (CPU), and the CUDA kernel
against both (GPU).  Fresh random data per case; outputs poisoned first."""
from __future__ import annotations

import time

import pytest
import torch

import samoyeds as sm
from helpers import oracle_ssmm, random_topk, rel_err, wgmma_runs

FORMATS = ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "samoyeds-1:2:256"]
REF_ONLY_FORMATS = ["1:4:64", "samoyeds-2:4:64", "3:8:32"]


def _case(T, K, E, R, C, fmt, dtype, pattern, act, glu, gen, device="cpu", bias=False, scale=False):
    x = torch.randn(T, C, generator=gen).to(dtype)
    w = (torch.randn(E, R, C, generator=gen) * C ** -0.5).to(dtype)
    p = sm.pack(w, fmt, glu=glu)
    topk = random_topk(T, K, E, pattern, gen)
    r = sm.route(topk, E)
    b = torch.randn(E, R, generator=gen).to(dtype) if bias else None
    sc = torch.rand(T * K, generator=gen) if scale else None
    return x, p, r, b, sc


def _poisoned(S, cols, dtype, device):
    return torch.full((S, cols), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("fmt", FORMATS + REF_ONLY_FORMATS)
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True), ("gptoss", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_oracle(fmt, act, glu, dtype):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, K, E, R, C = 23, 2, 5, 144, 200
    x, p, r, b, sc = _case(T, K, E, R, C, fmt, dtype, "skewed", act, glu, gen, bias=True, scale=True)
    dense = sm.unpack(p)
    out = _poisoned(T * K, R if act == "none" else R // 2, dtype, "cpu")
    sm.ssmm(x, p, r.offsets, r.token_ids, out=out, act=act, bias=b, scale=sc)
    n = int(r.offsets[-1])
    ref = oracle_ssmm(x, dense, r.offsets, r.token_ids, act, b, sc)
    assert torch.isfinite(out[:n]).all()
    assert torch.isnan(out[n:]).all(), "rows past offsets[E] must not be written"
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert rel_err(out[:n], ref[:n]) < tol


def test_ref_empty_and_zero_tokens():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 64, 128, generator=gen)
    p = sm.pack(w, "samoyeds-1:2:64")
    x = torch.randn(0, 128)
    offsets = torch.zeros(4, dtype=torch.int32)
    out = sm.ssmm(x, p, offsets, torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, 64)


# ---- GPU ------------------------------------------------------------------------------------

SHAPES = [  # T, K, E, R, C, pattern
    (37, 2, 4, 136, 256, "uniform"),      # rows not a multiple of the tile
    (1, 1, 3, 64, 128, "uniform"),        # one token
    (5, 2, 8, 256, 192, "skewed"),        # 1..3 tokens per expert, empty experts
    (300, 2, 4, 320, 384, "one"),         # all tokens to one expert (and K-1 others)
    (0, 2, 4, 128, 128, "uniform"),       # T = 0
    (129, 4, 6, 192, 640, "placeholder"), # ids >= E skipped; token-tile tails
    (260, 1, 2, 1408, 200, "uniform"),    # C not a multiple of 64; R = 1408 like DeepSeek/Qwen
]


def _gpu_case(shape, fmt, dtype, act, glu, bias, scale, seed):
    T, K, E, R, C, pattern = shape
    gen = torch.Generator().manual_seed(seed)
    x, p, r, b, sc = _case(T, K, E, R, C, fmt, dtype, pattern, act, glu, gen, bias=bias, scale=scale)
    return x, p, r, b, sc


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True)])
def test_cuda_matches_ref_and_oracle(shape, fmt, dtype, act, glu):
    seed = torch.seed() % 2**31
    x, p, r, b, sc = _gpu_case(shape, fmt, dtype, act, glu, bias=False, scale=act == "none", seed=seed)
    _check_cuda(x, p, r, b, sc, act, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128"])
def test_cuda_epilogues_bias_scale(act, fmt):
    seed = torch.seed() % 2**31
    x, p, r, b, sc = _gpu_case((97, 2, 5, 384, 256, "skewed"), fmt, torch.bfloat16, act, True,
                               bias=True, scale=True, seed=seed)
    _check_cuda(x, p, r, b, sc, act, torch.bfloat16)


def _check_cuda(x, p, r, b, sc, act, dtype, impl="auto"):
    E, R, C = p.shape3
    S = r.token_ids.shape[0]
    cols = R if act == "none" else R // 2
    dense = sm.unpack(p)
    # C reference (CPU) on the same packed bytes
    ref_out = _poisoned(S, cols, dtype, "cpu")
    sm.ssmm(x, p, r.offsets, r.token_ids, out=ref_out, act=act, bias=b, scale=sc)
    # CUDA
    dev = "cuda"
    pg = p.to(dev)
    out = _poisoned(S, cols, dtype, dev)
    sm.ssmm(x.to(dev), pg, r.offsets.to(dev), r.token_ids.to(dev), out=out, act=act,
            bias=None if b is None else b.to(dev), scale=None if sc is None else sc.to(dev), impl=impl)
    torch.cuda.synchronize()
    out = out.cpu()
    n = int(r.offsets[-1])
    oracle = oracle_ssmm(x, dense, r.offsets, r.token_ids, act, b, sc)[:n]
    assert torch.isfinite(out[:n]).all(), "unwritten or non-finite output rows"
    assert torch.isnan(out[n:]).all(), "rows past offsets[E] were written"
    e_ref, e_cuda = rel_err(ref_out[:n], oracle), rel_err(out[:n], oracle)
    assert e_cuda <= 2 * e_ref + 1e-6, (e_cuda, e_ref)
    return out


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _prefill_impl() -> str:
    """The kernel impl="auto" runs for 2:4 and 1:2:128 once the decode rule lets go."""
    return "wgmma_sp" if wgmma_runs() else "mma_sp"


def _check_wgmma_agrees(shape, fmt, act, glu, bias):
    """The wgmma.sp kernel and the mma.sp kernel on the same fresh inputs (routing scales
    on): each within the oracle tolerance of _check_cuda, and close to each other."""
    if not _sm90():
        pytest.skip("wgmma.sp runs on sm_90 only")
    seed = torch.seed() % 2**31
    x, p, r, b, sc = _gpu_case(shape, fmt, torch.bfloat16, act, glu, bias=bias, scale=True, seed=seed)
    a = _check_cuda(x, p, r, b, sc, act, torch.bfloat16, impl="wgmma_sp")
    m = _check_cuda(x, p, r, b, sc, act, torch.bfloat16, impl="mma_sp")
    n = int(r.offsets[-1])
    assert rel_err(a[:n], m[:n].double()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:256"])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True), ("gptoss", True)])
def test_wgmma_and_mma_sp_paths_agree(shape, fmt, act, glu):
    """The Hopper wgmma.sp kernel (warp-specialised, weights by TMA, persistent grid) and the
    mma.sp kernel on the same inputs: both within the oracle tolerance, and close to each other."""
    _check_wgmma_agrees(shape, fmt, act, glu, bias=glu)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    (2000, 2, 8, 1024, 256, "skewed"),   # more work items than SMs: each CTA of the persistent grid takes several
    (700, 2, 300, 256, 192, "uniform"),  # E > 256: work items decoded from offsets[] instead of registers
    (900, 3, 40, 512, 128, "one"),       # one expert holding most rows, a KT of 2 (shorter than the ring)
])
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128"])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True)])
def test_warp_specialised_work_items(shape, fmt, act, glu):
    """The wgmma.sp kernel's work distribution (a persistent grid, each CTA walking several
    items) against the C reference, the float64 oracle and the mma.sp kernel, with bias and
    routing scales: every item computed once, nothing else written."""
    _check_wgmma_agrees(shape, fmt, act, glu, bias=True)


def _ws_inputs(shape, fmt, act, glu, by_tma):
    """Fresh inputs of the warp-specialised kernel's tests, with bias and routing scales;
    by_tma: x as a down projection reads it, rows in expert order without a row map (ids None),
    its rows past offsets[E] NaN.  Returns (x, p, r, b, sc, ids, S, n, cols, the C reference's
    output (S rows, poisoned past n), the float64 oracle's rows [:n])."""
    T, K, E, R, C, pattern = shape
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x, p, r, b, sc = _case(T, K, E, R, C, fmt, torch.bfloat16, pattern, act, glu, gen, bias=True, scale=True)
    S, n = T * K, int(r.offsets[-1])
    ids = r.token_ids
    if by_tma:
        x = torch.randn(S, C, generator=gen).to(torch.bfloat16)
        x[n:] = float("nan")
        ids = None
    cols = R if act == "none" else R // 2
    ref = _poisoned(S, cols, torch.bfloat16, "cpu")
    sm.ssmm(x, p, r.offsets, ids, out=ref, act=act, bias=b, scale=sc)
    oracle = oracle_ssmm(x, sm.unpack(p), r.offsets, ids, act, b, sc)[:n]
    return x, p, r, b, sc, ids, S, n, cols, ref, oracle


def _ws_outputs(field, values, S, n, cols, call, **fixed):
    """call(out) with samoyeds.config(field=v, **fixed) for each of values, on an output
    poisoned with NaN: every routed row written and finite, none past offsets[E]; the
    outputs (on the CPU) by value."""
    outs = {}
    for v in values:
        with sm.config(**{field: v}, **fixed):
            out = _poisoned(S, cols, torch.bfloat16, "cuda")
            call(out)
            torch.cuda.synchronize()
        outs[v] = out.cpu()
        assert torch.isfinite(outs[v][:n]).all(), f"{field}={v}: unwritten or non-finite output rows"
        assert torch.isnan(outs[v][n:]).all(), f"{field}={v}: rows past offsets[E] were written"
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [
    (2000, 2, 8, 1024, 256, "skewed"),   # more work items than SMs
    (900, 3, 40, 512, 128, "one"),       # one expert holding most rows, a KT of 2
    (70, 2, 3, 640, 320, "uniform"),     # 384 storage rows, 1.5 tiles of 256 (glu: a last item of one chunk pair)
])
@pytest.mark.parametrize("fmt", ["samoyeds-1:2:128", "samoyeds-1:2:256"])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True), ("gptoss", True)])
@pytest.mark.parametrize("rows", ["gather", "tma"])
def test_wgmma_tall_tile(shape, fmt, act, glu, rows):
    """The 1:2:V tiles of 256 storage rows x 64 tokens (tile="256x64": each consumer two
    m64n64 blocks, a gated item's gate and up chunk in one consumer) and x 96 tokens
    ("256x96": two m64n96 blocks, 192 accumulators per thread) against "128x128" on the same
    fresh inputs, with bias and routing scales, token rows gathered or by TMA: each within the
    oracle tolerance of the C reference, nothing written past offsets[E], and bit for bit the
    same (the same sums in the same order per element)."""
    if not _sm90():
        pytest.skip("wgmma.sp runs on sm_90 only")
    x, p, r, b, sc, ids, S, n, cols, ref, oracle = _ws_inputs(shape, fmt, act, glu, rows == "tma")
    pg, xg, offg, bg, scg = p.to("cuda"), x.cuda(), r.offsets.cuda(), b.cuda(), sc.cuda()
    idg = None if ids is None else ids.cuda()
    # ("tma": an error unless the TMA path runs; with no rows at all there is nothing to map)
    token_rows = "gather" if rows == "gather" else "tma" if S else "auto"
    outs = _ws_outputs("tile", ("256x96", "256x64", "128x128"), S, n, cols,
                       lambda out: sm.ssmm(xg, pg, offg, idg, out=out, act=act, bias=bg, scale=scg, impl="wgmma_sp"),
                       token_rows=token_rows)
    for tile, o in outs.items():
        e_ref, e_cuda = rel_err(ref[:n], oracle), rel_err(o[:n], oracle)
        assert e_cuda <= 2 * e_ref + 1e-6, (tile, e_cuda, e_ref)
    assert torch.equal(outs["256x64"][:n], outs["128x128"][:n]), "the 256 x 64 and 128 x 128 tiles differ"
    assert torch.equal(outs["256x96"][:n], outs["128x128"][:n]), "the 256 x 96 and 128 x 128 tiles differ"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,tile", [
    ("samoyeds-1:2:128", "256x64"), ("samoyeds-1:2:128", "256x96"), ("samoyeds-1:2:128", "128x128"),
    ("2:4", "auto")])
def test_wgmma_tma_tokens_back_to_back(fmt, tile):
    """Thousands of launches, enqueued back to back, of the warp-specialised kernel with its token
    rows by TMA (each tile),
    on the shape of GPT-OSS-20B's down projection at 256 tokens (32 experts, 2880 x 2880, 1024
    routed rows, 46 k-tiles per work item): every launch must finish, and outputs sampled along
    the way must be the first bit for bit.  (Producer warps that walked the ring without loading
    into it could sleep through two phases of a stage's `empty` barrier and then wait for good:
    about one launch in a thousand hung.)"""
    if not _sm90():
        pytest.skip("wgmma.sp runs on sm_90 only")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    E, R, C, T, K = 32, 2880, 2880, 256, 4
    w = (torch.randn(E, R, C, generator=gen) * C ** -0.5).to(torch.bfloat16)
    p = sm.pack(w.cuda(), fmt)
    r = sm.route(random_topk(T, K, E, "uniform", gen), E)
    S = T * K
    x = torch.randn(S, C, generator=gen).to(torch.bfloat16).cuda()
    off = r.offsets.cuda()
    with sm.config(token_rows="tma", tile=tile):  # token_rows="tma": an error unless the rows go by TMA
        first = _poisoned(S, R, torch.bfloat16, "cuda")
        sm.ssmm(x, p, off, None, out=first, impl="wgmma_sp")
        torch.cuda.synchronize()
        assert torch.isfinite(first).all()
        out = _poisoned(S, R, torch.bfloat16, "cuda")
        launches, samples = 4000, []
        for i in range(launches):
            sm.ssmm(x, p, off, None, out=out, impl="wgmma_sp")
            if i % 500 == 499:
                samples.append(out.clone())
    done = torch.cuda.Event()
    done.record()
    t0 = time.monotonic()
    while not done.query():
        if time.monotonic() - t0 > 60:
            pytest.fail(f"{launches} launches unfinished after 60 s: a kernel hangs (the GPU stays busy)")
        time.sleep(0.01)
    for i, o in enumerate(samples):
        assert torch.equal(o, first), f"launch {500 * i + 499} differs from the first"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["samoyeds-1:2:128", "samoyeds-1:2:256"])
@pytest.mark.parametrize("rows", ["gather", "tma"])
def test_wgmma_row_pairs_of_unequal_size(fmt, rows):
    """The warp-specialised kernel sums both rows of a 1:2:V pair into one fp32 total and
    keeps row 0's share apart, so row 1 comes out as total - share (docs/PERFORMANCE.md, v15).
    Row 0 here is 256x row 1 and the two take turns slice by slice (checked on the packed
    indices), the case where that subtraction costs the most: row 1's outputs alone must stay
    as close to the float64 oracle as the C reference's, which sums every row by itself."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU and a build with sm_90a")
    V = int(fmt.rsplit(":", 1)[1])
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    E, R, C, T = 2, 256, 4 * V + 64, 333  # four slices and a partial fifth
    w = torch.randn(E, R, C, generator=gen) * C ** -0.5
    slice_of = torch.arange(C) // V
    even = (slice_of % 2 == 0).to(w.dtype)
    w[:, 0::2] *= 256.0 * even + 0.004 * (1 - even)  # row 0: large in even slices, tiny in odd ones
    w[:, 1::2] *= 0.004 * even + 1.0 * (1 - even)    # row 1: kept in odd slices
    w = w.to(torch.bfloat16)
    p = sm.pack(w, fmt)
    want = (torch.arange(p.idx.shape[1]) % 2).to(p.idx.dtype)
    assert torch.equal(p.idx[:, :, : R // 2].cpu(), want.view(1, -1, 1).expand(E, -1, R // 2)), \
        "the packing must take row 0 in even slices and row 1 in odd ones"
    x = torch.randn(T, C, generator=gen).to(torch.bfloat16)
    topk = random_topk(T, 1, E, "uniform", gen)
    r = sm.route(topk, E)
    if rows == "tma":  # x's rows already in expert order, read without a row map
        x = x[r.token_ids.long()].contiguous()
        token_ids = None
    else:
        token_ids = r.token_ids
    n = int(r.offsets[-1])
    ref = _poisoned(n, R, torch.bfloat16, "cpu")
    sm.ssmm(x, p, r.offsets, token_ids, out=ref)
    out = _poisoned(n, R, torch.bfloat16, "cuda")
    sm.ssmm(x.cuda(), p.to("cuda"), r.offsets.cuda(), None if token_ids is None else token_ids.cuda(), out=out,
            impl="wgmma_sp")
    out = out.cpu()
    oracle = oracle_ssmm(x, sm.unpack(p), r.offsets, token_ids)[:n]
    assert torch.isfinite(out).all()
    for row, name in ((0, "row 0"), (1, "row 1")):
        e_ref, e_cuda = rel_err(ref[:, row::2], oracle[:, row::2]), rel_err(out[:, row::2], oracle[:, row::2])
        assert e_cuda <= 2 * e_ref + 1e-6, (name, e_cuda, e_ref)
    small, large = oracle[:, 1::2].abs().mean(), oracle[:, 0::2].abs().mean()
    assert large > 64 * small, "row 0 must dominate the pair's total"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    (37, 2, 4, 136, 256, "uniform"),       # rows and tokens not multiples of the tiles
    (5, 2, 8, 256, 192, "skewed"),         # a few rows per expert, empty experts
    (129, 4, 6, 192, 640, "placeholder"),  # rows past offsets[E]: read into the last tile, never stored
    (260, 1, 2, 1408, 200, "uniform"),     # C not a multiple of 64: columns past C zero-filled
    (2000, 2, 8, 1024, 256, "skewed"),     # several items per CTA of the persistent grid
])
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128"])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True)])
def test_wgmma_tokens_by_tma(shape, fmt, act, glu):
    """x read without a row map (token_ids None, as the down projection reads its
    intermediate rows): the warp-specialised kernels load each k-tile's token rows as one
    TMA box, which also brings in rows of the next expert and, in the last tile, rows past
    offsets[E].  Those rows are NaN here: nothing of them may reach a stored row.  The
    result (token_rows="tma": an error unless the TMA path runs) must equal the cp.async
    gather's ("gather") bit for bit and be within the oracle tolerance of the C reference.
    With token_ids given, "tma" is refused."""
    if not _sm90():
        pytest.skip("wgmma.sp runs on sm_90 only")
    x, p, r, b, sc, _, S, n, cols, ref, oracle = _ws_inputs(shape, fmt, act, glu, by_tma=True)
    pg, xg, offg, bg, scg = p.to("cuda"), x.cuda(), r.offsets.cuda(), b.cuda(), sc.cuda()
    outs = _ws_outputs("token_rows", ("tma", "gather"), S, n, cols,
                       lambda out: sm.ssmm(xg, pg, offg, None, out=out, act=act, bias=bg, scale=scg, impl="wgmma_sp"))
    assert torch.equal(outs["tma"][:n], outs["gather"][:n]), "TMA token rows and the gather differ"
    e_ref, e_cuda = rel_err(ref[:n], oracle), rel_err(outs["tma"][:n], oracle)
    assert e_cuda <= 2 * e_ref + 1e-6, (e_cuda, e_ref)
    tok = torch.arange(S, dtype=torch.int32, device="cuda")
    with sm.config(token_rows="tma"), pytest.raises(NotImplementedError, match="token_rows='tma'"):
        sm.ssmm(xg, pg, offg, tok, act=act, impl="wgmma_sp")  # a row map: only the gather can read it


@pytest.mark.gpu
def test_wgmma_refuses_what_it_cannot_run():
    if not _sm90():
        pytest.skip("wgmma.sp runs on sm_90 only")
    x, p, r, b, sc = _gpu_case((16, 1, 2, 128, 128, "uniform"), "samoyeds-1:2:64", torch.bfloat16, "none", False,
                               bias=False, scale=False, seed=0)
    with pytest.raises(NotImplementedError, match="wgmma.sp"):
        sm.ssmm(x.cuda(), p.to("cuda"), r.offsets.cuda(), r.token_ids.cuda(), impl="wgmma_sp")


@pytest.mark.gpu
def test_cuda_deterministic_and_noncontiguous_rows():
    gen = torch.Generator().manual_seed(7)
    T, K, E, R, C = 200, 2, 4, 256, 512
    xw = torch.randn(T, C + 64, generator=gen).to(torch.bfloat16).cuda()
    x = xw[:, :C]  # row stride C + 64
    w = torch.randn(E, R, C, generator=gen).to(torch.bfloat16)
    p = sm.pack(w, "samoyeds-1:2:128").to("cuda")
    r = sm.route(torch.randint(0, E, (T, K), generator=gen).cuda(), E)
    a = sm.ssmm(x, p, r.offsets, r.token_ids)
    bb = sm.ssmm(x.contiguous(), p, r.offsets, r.token_ids)
    torch.cuda.synchronize()
    assert torch.equal(a, bb)


@pytest.mark.gpu
def test_cuda_rejects_bad_routing_before_launch():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(10, 128, generator=gen).to(torch.bfloat16).cuda()
    p = sm.pack(torch.randn(2, 64, 128, generator=gen).to(torch.bfloat16), "2:4").to("cuda")
    offsets = torch.tensor([0, 3, 6], dtype=torch.int32, device="cuda")
    out = torch.full((6, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([0, 1, 2, 3, 10, 5], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="token_ids"):
        sm.ssmm(x, p, offsets, ids, out=out)
    with pytest.raises(ValueError, match="offsets"):
        sm.ssmm(x, p, torch.tensor([0, 4, 3], dtype=torch.int32, device="cuda"), ids, out=out)
    assert torch.isnan(out).all(), "nothing may be written"
    # unchecked: the kernel reads nothing for the bad id and leaves its row alone
    sm.ssmm(x, p, offsets, ids, out=out, check=False)
    torch.cuda.synchronize()
    assert torch.isnan(out[4]).all() and torch.isfinite(out[[0, 1, 2, 3, 5]]).all()


# ---- GPU: the decode / small-T kernel (cuda/ssmm_decode.cu) -----------------------------------

DECODE_FORMATS = ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "1:4:64", "1:4:128"]
DECODE_SHAPES = [  # T, K, E, R, C, pattern
    (1, 1, 3, 64, 128, "uniform"),        # one token
    (1, 2, 8, 136, 200, "uniform"),       # rows not a multiple of the tile, C not a multiple of 128
    (5, 2, 8, 256, 192, "skewed"),        # 1..3 tokens per expert, empty experts
    (40, 1, 4, 200, 264, "one"),          # all tokens on one expert: more than one token pass
    (0, 2, 4, 128, 128, "uniform"),       # T = 0, S = 0
    (3, 4, 6, 192, 640, "placeholder"),   # ids >= E skipped
    (16, 2, 8, 72, 1000, "uniform"),      # K range split unevenly over warps, slices cross warps
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("fmt", DECODE_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True), ("gptoss", True)])
def test_decode_matches_ref_and_oracle(shape, fmt, dtype, act, glu):
    seed = torch.seed() % 2**31
    bias = act != "none" or dtype == torch.float16
    scale = act == "none" or dtype == torch.bfloat16
    x, p, r, b, sc = _gpu_case(shape, fmt, dtype, act, glu, bias=bias, scale=scale, seed=seed)
    _check_cuda(x, p, r, b, sc, act, dtype, impl="decode")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [
    (16, 2, 8, 136, 200, "uniform"),    # few CTAs (fewer than two per SM): 8 warps of 3 stages
    (24, 8, 64, 512, 264, "skewed"),    # many CTAs, at most 8 rows per expert: 2 warps of 3 stages
    (36, 8, 32, 640, 264, "uniform"),   # many CTAs, 9 rows per expert: 4 warps of 4 stages
])
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128", "1:4:64"])
def test_decode_cta_shapes(shape, fmt):
    """Each CTA shape the decode kernel picks from its inputs (rows per CTA, warps, stages;
    cuda/ssmm_decode.cu, launch_cta: the counts above are those of a 132-SM device) against the
    C reference and the float64 oracle: tails, several token passes, K split over the warps."""
    seed = torch.seed() % 2**31
    x, p, r, b, sc = _gpu_case(shape, fmt, torch.bfloat16, "swiglu", True, bias=True, scale=True, seed=seed)
    _check_cuda(x, p, r, b, sc, "swiglu", torch.bfloat16, impl="decode")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [DECODE_SHAPES[3], (48, 2, 4, 200, 264, "uniform"), (37, 3, 5, 136, 200, "skewed"),
                                   (7, 2, 16, 136, 200, "skewed")])
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "1:4:64"])
def test_decode_token_passes(shape, fmt):
    """The decode kernel's passes of 8, 16 and 32 tokens (1:4:V at most 16), which it picks
    from S (the sorted rows' capacity) and E: the same routed rows run with S = the routed
    rows and with S padded past them (rows past offsets[E], never read or written) to widen
    the passes, each against the float64 oracle and all bit-identical to each other (a
    token's sums do not depend on the other tokens of its pass).  The shapes give experts
    one pass of 32 and several of 8 or 16, a last pass cut short, and empty experts."""
    seed = torch.seed() % 2**31
    x, p, r, b, sc = _gpu_case(shape, fmt, torch.bfloat16, "swiglu", True, bias=True, scale=True, seed=seed)
    E = p.shape3[0]
    n = int(r.offsets[-1])
    base = _check_cuda(x, p, r, b, sc, "swiglu", torch.bfloat16, impl="decode")
    xg, pg, off, bg = x.cuda(), p.to("cuda"), r.offsets.cuda(), b.cuda()
    cols = p.shape3[1] // 2
    # S = n, past 16 and E (16-token passes), past 10 rows per expert (32; 1:4:V: 16)
    for S in sorted({max(n, 1), max(n, 17, E), max(n, 10 * E + 1)}):
        ids = torch.zeros(S, dtype=torch.int32)
        ids[:n] = r.token_ids[:n]
        scale = torch.rand(S)
        scale[:n] = sc[:n]
        out = _poisoned(S, cols, torch.bfloat16, "cuda")
        sm.ssmm(xg, pg, off, ids.cuda(), out=out, act="swiglu", bias=bg, scale=scale.cuda(), impl="decode")
        torch.cuda.synchronize()
        out = out.cpu()
        assert torch.isnan(out[n:]).all(), f"S = {S}: rows past offsets[E] were written"
        assert torch.equal(out[:n], base[:n]), f"S = {S}: differs from S = {r.token_ids.shape[0]}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128", "1:4:64"])
def test_decode_deterministic_and_close_to_mma_sp(fmt):
    """Two runs bit-identical (fixed-order split-K reduction); close to the
    prefill kernel on the same inputs; an expert with more rows than one pass."""
    seed = torch.seed() % 2**31
    x, p, r, b, sc = _gpu_case((48, 2, 4, 512, 2048, "skewed"), fmt, torch.bfloat16, "swiglu", True,
                               bias=True, scale=True, seed=seed)
    xg, pg, off, ids = x.cuda(), p.to("cuda"), r.offsets.cuda(), r.token_ids.cuda()
    bg, sg = b.cuda(), sc.cuda()
    outs = []
    for _ in range(2):
        o = _poisoned(ids.shape[0], 256, torch.bfloat16, "cuda")
        sm.ssmm(xg, pg, off, ids, out=o, act="swiglu", bias=bg, scale=sg, impl="decode")
        outs.append(o)
    m = sm.ssmm(xg, pg, off, ids, act="swiglu", bias=bg, scale=sg, impl="mma_sp")
    torch.cuda.synchronize()
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]), "the decode kernel must be bit-identical run to run"
    assert rel_err(outs[0], m.double()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128"])
def test_auto_picks_decode_for_small_s(fmt):
    """auto runs the decode kernel when S <= decode_max_rows (default 128):
    bit-identical to impl="decode", within tolerance of impl="mma_sp"; with both decode
    thresholds at 0 it runs the prefill kernel, bit for bit."""
    seed = torch.seed() % 2**31
    x, p, r, b, sc = _gpu_case((16, 2, 8, 256, 1024, "uniform"), fmt, torch.bfloat16, "none", False,
                               bias=False, scale=True, seed=seed)
    assert r.token_ids.shape[0] <= 64  # below the default threshold
    auto = _check_cuda(x, p, r, b, sc, "none", torch.bfloat16, impl="auto")
    dec = _check_cuda(x, p, r, b, sc, "none", torch.bfloat16, impl="decode")
    mma = _check_cuda(x, p, r, b, sc, "none", torch.bfloat16, impl="mma_sp")
    n = int(r.offsets[-1])
    assert torch.equal(auto[:n], dec[:n])
    assert rel_err(auto[:n], mma[:n].double()) < 1e-2
    # the thresholds are samoyeds.config fields: 0 and 0 send auto to the prefill kernels
    with sm.config(decode_max_rows=0, decode_rows_per_expert=0):
        pre = _check_cuda(x, p, r, b, sc, "none", torch.bfloat16, impl="auto")
    assert rel_err(pre[:n], dec[:n].double()) < 1e-2
    assert torch.equal(pre[:n], _check_cuda(x, p, r, b, sc, "none", torch.bfloat16, impl=_prefill_impl())[:n])


@pytest.mark.gpu
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True)])
def test_auto_picks_decode_for_few_rows_per_expert(act, glu):
    """Above decode_max_rows, auto still runs the decode kernel while the rows average at
    most decode_rows_per_expert (default 16) per expert: here S = 40 x 4 = 160 rows over
    E = 64 experts."""
    seed = torch.seed() % 2**31
    x, p, r, b, sc = _gpu_case((40, 4, 64, 256, 512, "skewed"), "samoyeds-1:2:128", torch.bfloat16, act, glu,
                               bias=glu, scale=True, seed=seed)
    assert 128 < r.token_ids.shape[0] <= 16 * 64
    auto = _check_cuda(x, p, r, b, sc, act, torch.bfloat16, impl="auto")
    dec = _check_cuda(x, p, r, b, sc, act, torch.bfloat16, impl="decode")
    n = int(r.offsets[-1])
    assert torch.equal(auto[:n], dec[:n])
    with sm.config(decode_rows_per_expert=2):  # 160 > 2 x 64: the prefill kernels
        pre = _check_cuda(x, p, r, b, sc, act, torch.bfloat16, impl="auto")
    assert rel_err(pre[:n], dec[:n].double()) < 1e-2
    assert torch.equal(pre[:n], _check_cuda(x, p, r, b, sc, act, torch.bfloat16, impl=_prefill_impl())[:n])


def _unrouted_case(T, fmt, act, glu, seed):
    """E = 6 experts of which only 1 and 4 are routed: returns the inputs and, packed from the
    same weights, a copy whose unrouted experts' values and bias are NaN."""
    E, R, C = 6, 384, 320
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=gen).to(torch.bfloat16)
    xs = torch.randn(2 * T, C, generator=gen).to(torch.bfloat16)  # rows in expert order, no row map
    w = (torch.randn(E, R, C, generator=gen) * C ** -0.5).to(torch.bfloat16)
    p = sm.pack(w, fmt, glu=glu)
    flip = torch.rand(T, generator=gen) < 0.5
    topk = torch.stack([torch.where(flip, 4, 1), torch.where(flip, 1, 4)], dim=1)
    r = sm.route(topk, E)
    b = torch.randn(E, R, generator=gen).to(torch.bfloat16)
    sc = torch.rand(T * 2, generator=gen)
    unrouted = [0, 2, 3, 5]
    counts = (r.offsets[1:] - r.offsets[:-1]).tolist()
    assert [e for e in range(E) if counts[e] == 0] == unrouted
    bad = sm.PackedWeight(p.values.clone(), p.meta, p.idx, p.fmt, p.shape, glu=p.glu)
    bad.values[unrouted] = float("nan")
    b_bad = b.clone()
    b_bad[unrouted] = float("nan")
    return x, xs, p, bad, r, b, b_bad, sc


def _unrouted_outputs(T, fmt, act, glu, ways):
    """For each (device, impl, samoyeds.config fields) of ways, with the token rows
    gathered and read without a row map: the output on the clean weights and on the copy whose
    unrouted experts are NaN must be equal bit for bit, every routed row finite."""
    seed = torch.seed() % 2**31
    x, xs, p, bad, r, b, b_bad, sc = _unrouted_case(T, fmt, act, glu, seed)
    S, n, R = T * 2, int(r.offsets[-1]), p.shape3[1]
    cols = R if act == "none" else R // 2

    def run(dev, packed, bias, impl, ids):
        out = _poisoned(S, cols, torch.bfloat16, dev)
        sm.ssmm((xs if ids is None else x).to(dev), packed.to(dev), r.offsets.to(dev),
                None if ids is None else ids.to(dev), out=out,
                act=act, bias=bias.to(dev), scale=sc.to(dev), impl=impl)
        if dev == "cuda":
            torch.cuda.synchronize()
        return out.cpu()

    for dev, impl, cfg in ways:
        for ids in (r.token_ids, None):
            with sm.config(**cfg):
                clean = run(dev, p, b, impl, ids)
                dirty = run(dev, bad, b_bad, impl, ids)
            what = f"{dev} impl={impl} {cfg} token rows {'without a row map' if ids is None else 'gathered'}"
            assert torch.isfinite(clean[:n]).all(), f"{what}: unwritten rows on the clean weights"
            assert torch.isnan(clean[n:]).all(), f"{what}: rows past offsets[E] were written"
            assert torch.equal(dirty[:n], clean[:n]), f"{what}: an unrouted expert's weights reached the output"


@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128"])
def test_ref_unrouted_experts_reach_no_output(fmt):
    """The C reference skips the experts nobody routed to: their NaN weights and bias change
    nothing."""
    _unrouted_outputs(9, fmt, "swiglu", True, [("cpu", "auto", {})])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [37, 600])
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128"])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True)])
def test_unrouted_experts_reach_no_output(T, fmt, act, glu):
    """Experts nobody routed to take no part: with their packed values and bias NaN, every
    kernel (decode, mma.sp, wgmma.sp in each tile; token rows gathered and, as the down
    projection reads them, without a row map) gives, bit for bit, what it gives on the clean
    weights.  A kernel that took an unrouted expert's weights into a sum would carry its NaN
    into the output.  (A read whose value goes unused leaves no trace here: that no byte of
    them is read at all, this test cannot show.)"""
    ways = [("cuda", impl, {}) for impl in ("decode", "mma_sp")]
    if _prefill_impl() == "wgmma_sp":
        tiles = ("auto",) if fmt == "2:4" else ("128x128", "256x64", "256x96")
        ways += [("cuda", "wgmma_sp", {"tile": tile}) for tile in tiles]
        ways += [("cuda", "wgmma_sp", {"split_k": 3})]  # (clamped to the K units there are)
    _unrouted_outputs(T, fmt, act, glu, ways)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["mma_sp", "decode"])
@pytest.mark.parametrize("fmt", ["1:4:64", "samoyeds-1:2:64"])
def test_cuda_last_padded_ktile_reads_no_index_past_idx(impl, fmt):
    """Columns are padded to 128, so with V = 64 and C = 136 the last 64-column k-tile lies
    past the last slice.  Its row-selection indices must be the last slice's, never the bytes
    after idx: here idx is the front of a buffer whose remaining bytes are 255 (an invalid
    row), so a read past it would select no valid row (initcheck found the read)."""
    gen = torch.Generator().manual_seed(5)
    E, R, C, T, K = 3, 128, 136, 40 if impl == "mma_sp" else 6, 2
    w = torch.randn(E, R, C, generator=gen).to(torch.bfloat16)
    p = sm.pack(w, fmt).to("cuda")
    buf = torch.full((p.idx.numel() + 4096,), 255, dtype=torch.uint8, device="cuda")
    buf[:p.idx.numel()] = p.idx.reshape(-1)
    bad_tail = sm.PackedWeight(p.values, p.meta, buf[:p.idx.numel()].view(p.idx.shape), p.fmt, p.shape, p.glu)
    x = torch.randn(T, C, generator=gen).to(torch.bfloat16)
    r = sm.route(random_topk(T, K, E, "uniform", gen), E)
    dense = sm.unpack(p.to("cpu"))
    out = torch.full((r.token_ids.shape[0], R), float("nan"), dtype=torch.bfloat16, device="cuda")
    sm.ssmm(x.cuda(), bad_tail, r.offsets.cuda(), r.token_ids.cuda(), out=out, impl=impl)
    n = int(r.offsets[-1])
    oracle = oracle_ssmm(x, dense, r.offsets, r.token_ids, "none", None, None)[:n]
    assert torch.isfinite(out[:n]).all()
    assert rel_err(out[:n].cpu(), oracle) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("impl,tile,fmt", [("auto", "auto", "2:4"), ("wgmma_sp", "128x128", "samoyeds-1:2:128"),
                                           ("wgmma_sp", "256x64", "samoyeds-1:2:128"),
                                           ("wgmma_sp", "256x96", "samoyeds-1:2:128"),
                                           ("mma_sp", "auto", "samoyeds-1:2:128"), ("mma_sp", "auto", "1:4:64"),
                                           ("decode", "auto", "samoyeds-1:2:128"), ("decode", "auto", "2:4")])
@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
def test_cuda_preact_output(impl, tile, fmt, act):
    """ssmm(..., preact=P) on every kernel: out bit-identical to the call without P, P the
    pre-activation (gate then up columns, bias added) as the C reference writes it, rows of
    placeholder ids and past offsets[E] untouched (NaN-poisoned)."""
    if impl == "wgmma_sp" and not _sm90():
        pytest.skip("wgmma.sp needs sm_90a")
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    E, I, H, T, K = 5, 200, 264, 300 if impl != "decode" else 9, 2
    pw = sm.pack(torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16), fmt, glu=True)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    r = sm.route(random_topk(T, K, E, "placeholder", gen), E)
    b = torch.randn(E, 2 * I, generator=gen)
    S, n = r.token_ids.shape[0], int(r.offsets[-1])
    ref = torch.full((S, 2 * I), float("nan"), dtype=torch.bfloat16)
    sm.ssmm(x, pw, r.offsets, r.token_ids, act=act, bias=b, preact=ref)
    pg, xg, og, tg, bg = pw.to("cuda"), x.cuda(), r.offsets.cuda(), r.token_ids.cuda(), b.cuda()
    with sm.config(tile=tile):
        want = sm.ssmm(xg, pg, og, tg, act=act, bias=bg, impl=impl)
        pre = torch.full((S, 2 * I), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = torch.full((S, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        sm.ssmm(xg, pg, og, tg, out, act=act, bias=bg, impl=impl, preact=pre)
    torch.cuda.synchronize()
    assert torch.equal(out[:n], want[:n]), seed
    assert torch.isnan(pre[n:]).all() and torch.isnan(out[n:]).all(), seed
    assert torch.isfinite(pre[:n]).all(), seed
    assert rel_err(pre[:n].cpu(), ref[:n]) < 1e-2, seed


# ---- split-K of the wgmma.sp kernel -------------------------------------------------------------

SPLIT_SHAPES = [  # T, K, E, R, C, pattern; C = 1600: 26 k-tiles, 13 slices of 128 (the last one partial), 7 of 256
    (256, 1, 1, 256, 1600, "uniform"),     # one expert, few work items (the sweep's losing shapes)
    (37, 2, 4, 136, 1600, "uniform"),      # rows not a multiple of the tile
    (5, 2, 8, 256, 1600, "skewed"),        # 1..3 tokens per expert, empty experts
    (129, 4, 6, 192, 1600, "placeholder"), # invalid token ids; token-tile tails
    (0, 2, 4, 128, 1024, "uniform"),       # T = 0
]


def _split_outputs(x, p, r, ids, b, sc, act, dtype, splits, **cfg):
    """sm.ssmm(impl="wgmma_sp") with config(split_k=n, **cfg) for each n of splits, each on an
    output poisoned with NaN: every routed row written and finite, none past offsets[E]; the
    outputs (on the CPU) by n."""
    S, n = r.token_ids.shape[0], int(r.offsets[-1])
    cols = p.shape3[1] if act == "none" else p.shape3[1] // 2
    xg, pg, offg = x.cuda(), p.to("cuda"), r.offsets.cuda()
    idg, bg, scg = (None if t is None else t.cuda() for t in (ids, b, sc))
    outs = {}
    for k in splits:
        with sm.config(split_k=k, **cfg):
            out = _poisoned(S, cols, dtype, "cuda")
            sm.ssmm(xg, pg, offg, idg, out=out, act=act, bias=bg, scale=scg, impl="wgmma_sp")
            torch.cuda.synchronize()
        outs[k] = out.cpu()
        assert torch.isfinite(outs[k][:n]).all(), f"split_k={k}: unwritten or non-finite output rows"
        assert torch.isnan(outs[k][n:]).all(), f"split_k={k}: rows past offsets[E] were written"
    return outs


def _check_splits(shape, fmt, act, glu, dtype, bias, scale, by_tma, **cfg):
    """Split-K forced to 2, 3 and 5 splits, and the rule's choice, against the C reference and
    the float64 oracle (the kernel within twice the reference's error) and against no split
    (close); a split run twice is bit for bit the same."""
    if not _sm90():
        pytest.skip("wgmma.sp runs on sm_90 only")
    T, K, E, R, C, pattern = shape
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x, p, r, b, sc = _case(T, K, E, R, C, fmt, dtype, pattern, act, glu, gen, bias=bias, scale=scale)
    S, n = T * K, int(r.offsets[-1])
    ids = r.token_ids
    if by_tma:  # as the down projection reads x: rows in expert order, no row map; past offsets[E] NaN
        x = torch.randn(S, C, generator=gen).to(dtype)
        x[n:] = float("nan")
        ids = None
    cols = R if act == "none" else R // 2
    ref = _poisoned(S, cols, dtype, "cpu")
    sm.ssmm(x, p, r.offsets, ids, out=ref, act=act, bias=b, scale=sc)
    oracle = oracle_ssmm(x, sm.unpack(p), r.offsets, ids, act, b, sc)[:n]
    outs = _split_outputs(x, p, r, ids, b, sc, act, dtype, (1, 2, 3, 5, 0), **cfg)
    e_ref = rel_err(ref[:n], oracle)
    for k, o in outs.items():
        e_cuda = rel_err(o[:n], oracle)
        assert e_cuda <= 2 * e_ref + 1e-6, (k, e_cuda, e_ref)
        assert rel_err(o[:n], outs[1][:n]) < 1e-2, k
    again = _split_outputs(x, p, r, ids, b, sc, act, dtype, (3,), **cfg)
    n = int(r.offsets[-1])  # (rows past it are NaN in both, and NaN != NaN)
    assert torch.equal(again[3][:n], outs[3][:n]), "split-K is not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SPLIT_SHAPES)
@pytest.mark.parametrize("fmt,tile", [
    ("2:4", "auto"), ("samoyeds-1:2:128", "128x128"), ("samoyeds-1:2:128", "256x64"),
    ("samoyeds-1:2:256", "128x128"), ("samoyeds-1:2:256", "256x64"),
    ("samoyeds-1:2:128", "256x96"),  # never split (WgmmaTile::SPLIT_K): split_k leaves it alone
])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True), ("gptoss", True)])
@pytest.mark.parametrize("rows", ["gather", "tma"])
def test_wgmma_split_k(shape, fmt, tile, act, glu, rows):
    """Split-K of the wgmma.sp kernel (each item's K in 2, 3, 5 or the rule's count of splits,
    fp32 partial sums added by a second kernel in split order) in every tile's store of the
    partial sums (2:4; 1:2:V in 128 x 128, a gated item's gate and up rows in two consumers,
    and in 256 x 64, both in one), bias and routing scales, token rows gathered (token_ids)
    or by TMA, K an odd number of slices with a partial last one."""
    token_rows = "gather" if rows == "gather" else "tma" if shape[0] else "auto"
    _check_splits(shape, fmt, act, glu, torch.bfloat16, True, True, rows == "tma", tile=tile, token_rows=token_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:256"])
@pytest.mark.parametrize("act,glu", [("none", False), ("swiglu", True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgmma_split_k_plain(fmt, act, glu, dtype):
    """Split-K without bias and routing scales, in bf16 and fp16."""
    _check_splits((300, 2, 4, 320, 1600, "one"), fmt, act, glu, dtype, False, False, False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["2:4", "samoyeds-1:2:128"])
def test_wgmma_split_k_rule_splits_few_items(fmt):
    """The sweep's worst shape, 256 rows x K = 16384 x 256 tokens on one expert: 2 work items
    (2:4: one 256-row tile x two 128-token tiles; 1:2:128: the rule's 128 x 128 tile over its
    128 storage rows), so the rule splits K (sam_ssmm_split_k).  impl="auto" gives bit for bit
    what forcing that count gives, and not what no split gives."""
    if not _sm90():
        pytest.skip("wgmma.sp runs on sm_90 only")
    R, C, T = 256, 16384, 256
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = sm._C.ssmm_split_k(C // 64 // 2, 2, 2, sms, 0)  # units of 2 k-tiles: a pair (2:4) or a slice of 128
    assert want > 1
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = (torch.randn(1, R, C, generator=gen) * C ** -0.5).to(torch.bfloat16)
    p = sm.pack(w, fmt).to("cuda")
    x = torch.randn(T, C, generator=gen).to(torch.bfloat16).cuda()
    off = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    outs = {}
    for k in (0, want, 1):
        with sm.config(split_k=k):
            outs[k] = sm.ssmm(x, p, off, None)
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[want]), "the rule did not pick its split count"
    assert not torch.equal(outs[want], outs[1]), "split and unsplit sums came out the same bits"


def _nan_through_gptoss_clamps(device, impls):
    """A NaN gate or up pre-activation stays NaN through GPT-OSS's clamps (as torch.clamp);
    fminf-style clamps would turn it into the limit and hide it."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, K, E, R, C = 19, 2, 3, 128, 128
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, p, r, b, _ = _case(T, K, E, R, C, "samoyeds-1:2:128", dtype, "uniform", "gptoss", True, gen, bias=True)
    b[1, 3] = float("nan")            # expert 1's gate, column 3
    b[2, R // 2 + 5] = float("nan")   # expert 2's up, column 5
    n = int(r.offsets[-1])
    want = oracle_ssmm(x, sm.unpack(p), r.offsets, r.token_ids, "gptoss", b)[:n]
    off = r.offsets.tolist()
    assert off[2] > off[1] and off[3] > off[2]
    for impl in impls:
        out = sm.ssmm(x.to(device), p.to(device), r.offsets.to(device), r.token_ids.to(device),
                      act="gptoss", bias=b.to(device), impl=impl).float().cpu()[:n]
        assert torch.equal(torch.isnan(out), torch.isnan(want)), impl
        assert torch.isnan(out[off[1]:off[2], 3]).all() and torch.isnan(out[off[2]:off[3], 5]).all(), impl
        assert rel_err(torch.nan_to_num(out), torch.nan_to_num(want)) < (1e-5 if device == "cpu" else 8e-3), impl


def test_ref_gptoss_clamps_keep_nan():
    _nan_through_gptoss_clamps("cpu", ["auto"])


@pytest.mark.gpu
def test_cuda_gptoss_clamps_keep_nan():
    impls = ["decode", "mma_sp"] + (["wgmma_sp"] if _prefill_impl() == "wgmma_sp" else [])
    _nan_through_gptoss_clamps("cuda", impls)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["1:4:64", "1:4:128"])
@pytest.mark.parametrize("impl", ["mma_sp", "decode"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_never_selected_last_row_is_zero(fmt, impl, dtype):
    """The kernels fold a group's M rows into one running total and M-1 shares; the last
    row is total - shares.  Where no slice selects it while the others alternate between
    rows 0 and 1 (five slices here, large totals), total - shares leaves an fp32 rounding
    residual; the kernels must write exactly 0 there, as the reference does
    (cuda/ssmm_work.cuh, SEL_LAST_SEEN; an H100 fuzz case once found 1.97e-6)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    M, V = (int(v) for v in fmt.split(":")[1:])
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    E, R, C = 2, 16 * M, 5 * V
    T = 6 if impl == "decode" else 200
    w = torch.randn(E, R, C, generator=gen) * 0.001
    odd = ((torch.arange(C) // V) % 2).to(w.dtype)
    w[:, 0::M] = torch.randn(E, R // M, C, generator=gen) * (64.0 * (1 - odd) + 0.001 * odd)
    w[:, 1::M] = torch.randn(E, R // M, C, generator=gen) * (64.0 * odd + 0.001 * (1 - odd))
    w = w.to(dtype)
    p = sm.pack(w, fmt)
    want = (torch.arange(p.idx.shape[1]) % 2).to(p.idx.dtype)
    assert torch.equal(p.idx[:, :, : R // M], want.view(1, -1, 1).expand(E, -1, R // M)), \
        "the packing must take row 0 in even slices and row 1 in odd ones"
    x = torch.randn(T, C, generator=gen).to(dtype)
    r = sm.route(random_topk(T, 1, E, "uniform", gen), E)
    out = _check_cuda(x, p, r, None, None, "none", dtype, impl=impl)
    n = int(r.offsets[-1])
    for row in range(2, M):
        col = out[:n, row::M]
        assert torch.count_nonzero(col) == 0, (row, col.abs().max().item())
