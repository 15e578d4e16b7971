"""ssmm_dx on the GPU (cuda/ssmm_dx.cu, cuda/ssmm_dx_wgmma.cu): each CUDA kernel against the C reference (CPU, same
inputs) and a float64 torch oracle, on fresh random inputs per case, the output poisoned with
NaN first: every entry written, rows past offsets[E] exactly 0 (their dy rows NaN, never
read), an invalid token id a zero row, bit-identical run to run; the layer's backward on
either dX path."""
from __future__ import annotations

import pytest
import torch

import samoyeds as sm
from helpers import random_topk, rel_err, wgmma_runs
from samoyeds.ops import ssmm_dx

FORMATS = ["2:4", "samoyeds-1:2:128", "samoyeds-1:2:64", "1:4:64", "samoyeds-1:2:192"]

CASES = [  # T, K, E, (R plain, R glu), C, pattern
    (37, 2, 4, (136, 136), 200, "uniform"),      # odd rows per expert; C not a multiple of 128
    (5, 2, 8, (96, 96), 128, "skewed"),          # 1..3 rows per expert, empty experts; 64 storage rows
    (0, 2, 3, (64, 64), 128, "uniform"),         # T = 0: nothing to write
    (300, 2, 4, (200, 144), 584, "one"),         # 300 rows in one expert (3 row tiles); 5 column blocks
    (129, 3, 6, (144, 272), 264, "placeholder"), # ids >= E: rows past offsets[E] zeroed, dy NaN there
    (61, 2, 3, (36, 40), 72, "uniform"),         # rows per half not a multiple of 8: dy read by elements
]
VARIANTS = [(True, False), (False, True), (True, True)]  # token_ids, scale
# the mma.sync kernel (any sm_80+) and the wgmma one (sm_90a: skipped elsewhere)
IMPLS = ["mma", pytest.param("wgmma", marks=pytest.mark.skipif("not wgmma_runs()"))]


def oracle_dx(dy, p, offsets, token_ids, scale, S):
    E, R, C = p.shape3
    dense = sm.unpack(p.to("cpu")).double().reshape(E, R, C)
    out = torch.zeros(S, C, dtype=torch.float64)
    off = offsets.tolist()
    for e in range(E):
        rows = torch.arange(off[e], off[e + 1])
        if rows.numel() == 0:
            continue
        src = dy[token_ids[rows].long()] if token_ids is not None else dy[rows]
        out[rows] = (src.double() @ dense[e]) * (scale[rows].double()[:, None] if scale is not None else 1)
    return out


def make_inputs(case, fmt, dtype, glu, with_ids, with_scale, seed):
    T, K, E, Rs, C, pattern = case
    R = Rs[1] if glu else Rs[0]
    gen = torch.Generator().manual_seed(seed)
    p = sm.pack((torch.randn(E, R, C, generator=gen) / R ** 0.5).to(dtype), fmt, glu=glu)
    r = sm.route(random_topk(T, K, E, pattern, gen), E)
    S, n = T * K, int(r.offsets[-1])
    # rows padded to 8 elements (the GPU takes 16-byte row strides)
    if with_ids:
        dy, tok = torch.randn(T, (R + 7) // 8 * 8, generator=gen).to(dtype)[:, :R], r.token_ids
    else:
        dy, tok = torch.randn(S, (R + 7) // 8 * 8, generator=gen).to(dtype)[:, :R], None
        dy[n:] = float("nan")  # rows past offsets[E] are never read
    sc = torch.rand(S, generator=gen) if with_scale else None
    return p, r, dy, tok, sc, S


def on(t, device):
    """t on device with its row stride kept."""
    if t.dim() != 2 or t.stride(0) == t.shape[1] or t.stride(1) != 1:
        return t.to(device)
    buf = torch.empty(t.shape[0], t.stride(0), dtype=t.dtype, device=device)
    buf[:, :t.shape[1]] = t.to(device)
    return buf[:, :t.shape[1]]


def run_dx(p, r, dy, tok, sc, S, device, impl="auto"):
    C = p.shape3[2]
    out = torch.full((S, C), float("nan"), dtype=dy.dtype, device=device)
    to = (lambda t: None if t is None else on(t, device))
    assert ssmm_dx(to(dy), p.to(device), to(r.offsets), to(tok), to(sc), out=out, impl=impl) is out
    if device != "cpu":
        torch.cuda.synchronize()
    return out.cpu()


def check(case, fmt, dtype, glu, with_ids, with_scale, impl):
    seed = torch.seed() % 2 ** 31
    p, r, dy, tok, sc, S = make_inputs(case, fmt, dtype, glu, with_ids, with_scale, seed)
    want = oracle_dx(dy, p, r.offsets, tok, sc, S)
    ref = run_dx(p, r, dy, tok, sc, S, "cpu")  # the C reference
    got = run_dx(p, r, dy, tok, sc, S, "cuda", impl)
    assert torch.isfinite(got).all(), f"unwritten or non-finite entries (seed {seed})"
    n = int(r.offsets[-1])
    assert not got[n:].any(), f"rows past offsets[E] must be exactly 0 (seed {seed})"
    e_ref, e_got = rel_err(ref, want), rel_err(got, want)
    # both sum in fp32 and round once; the orders differ
    assert e_got <= 2.0 * e_ref + 1e-6, (e_got, e_ref, seed)
    return p, r, dy, tok, sc, S, got


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("with_ids,with_scale", VARIANTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_matches_ref_and_oracle(case, fmt, glu, with_ids, with_scale, impl):
    check(case, fmt, torch.bfloat16, glu, with_ids, with_scale, impl)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_float16(case, fmt, glu, impl):
    check(case, fmt, torch.float16, glu, True, True, impl)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,glu", [("samoyeds-1:2:128", True), ("samoyeds-1:2:64", False), ("1:4:64", True),
                                     ("2:4", False), ("2:4", True)])
@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_larger_and_deterministic(fmt, glu, impl):
    """Several row tiles per expert and column blocks, long K loops, an operand tile per
    slice; two runs bit-identical (no atomics, a fixed order)."""
    case = (1000, 2, 8, (1024, 768), 1024, "skewed")
    p, r, dy, tok, sc, S, got = check(case, fmt, torch.bfloat16, glu, True, glu, impl)
    assert torch.equal(got, run_dx(p, r, dy, tok, sc, S, "cuda", impl)), "two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_invalid_token_reads_as_a_zero_row_and_outside_rows_are_zero(impl):
    gen = torch.Generator().manual_seed(5)
    E, T, K, R, C = 3, 50, 2, 136, 200
    p = sm.pack(torch.randn(E, R, C, generator=gen).to(torch.bfloat16), "samoyeds-1:2:64").to("cuda")
    r = sm.route(random_topk(T, K, E, "uniform", gen), E)
    dy = torch.randn(T, R, generator=gen).to(torch.bfloat16).cuda()
    tok = r.token_ids.cuda().clone()
    tok[3] = T + 7
    off = r.offsets.cuda() + 2                      # rows [0, 2) and [S - 2, S) owned by no expert
    off[-1] = min(int(off[-1]), T * K - 2)
    out = torch.full((T * K, C), float("nan"), dtype=torch.bfloat16, device="cuda")
    ssmm_dx(dy, p, off, tok, None, out=out, impl=impl)
    torch.cuda.synchronize()
    assert not out[3].any() and not out[:2].any() and not out[int(off[-1]):].any()
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["samoyeds-1:2:64", "2:4"])
def test_cuda_no_experts_zeroes_every_row(fmt):
    """E = 0 (offsets of one entry): every row is owned by no expert and written as 0, as the
    C reference does."""
    p = sm.pack(torch.randn(0, 64, 128).to(torch.bfloat16), fmt).to("cuda")
    out = torch.full((5, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    ssmm_dx(torch.randn(5, 64, dtype=torch.bfloat16, device="cuda"), p,
            torch.zeros(1, dtype=torch.int32, device="cuda"), out=out)
    torch.cuda.synchronize()
    assert not out.any() and torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_row_strides(impl):
    """dy with a row stride (a slice of wider rows): the same bits as a contiguous copy."""
    gen = torch.Generator().manual_seed(5)
    E, T, K, R, C = 3, 50, 2, 136, 200
    p = sm.pack(torch.randn(E, R, C, generator=gen).to(torch.bfloat16), "samoyeds-1:2:64").to("cuda")
    r = sm.route(random_topk(T, K, E, "uniform", gen), E)
    big = torch.randn(T, R + 24, generator=gen).to(torch.bfloat16).cuda()
    off, tok = r.offsets.cuda(), r.token_ids.cuda()
    a, b = ssmm_dx(big[:, :R], p, off, tok, impl=impl), ssmm_dx(big[:, :R].contiguous(), p, off, tok, impl=impl)
    torch.cuda.synchronize()
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_refuses_formats_without_a_kernel():
    p = sm.pack(torch.randn(2, 64, 128).to(torch.bfloat16), "3:8:32").to("cuda")
    off = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match=r"^ssmm_dx: the GPU kernel supports formats"):
        ssmm_dx(torch.randn(4, 64, dtype=torch.bfloat16, device="cuda"), p, off)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["samoyeds-1:2:128", "1:4:64"])
def test_cuda_layer_backward_on_either_dx_path(fmt, monkeypatch):
    """moe_backward_eager with dX by ssmm_dx and by the transposed packing (the GPU's default
    for these formats): the same gradients up to bf16 rounding of differently ordered fp32 sums."""
    from samoyeds import torch_ops as to
    gen = torch.Generator().manual_seed(9)
    T, K, E, H, I = 200, 2, 8, 256, 128
    x = torch.randn(T, H, generator=gen).bfloat16().cuda()
    ids = torch.randint(0, E + 1, (T, K), generator=gen).cuda()
    w = torch.rand(T, K, generator=gen).cuda()
    gu = sm.pack((torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).bfloat16(), fmt, glu=True).to("cuda")
    dn = sm.pack((torch.randn(E, H, I, generator=gen) / I ** 0.5).bfloat16(), fmt).to("cuda")
    go = torch.randn(T, H, generator=gen).bfloat16().cuda()
    n, m, v = gu.fmt.c_args()
    args = (go, x, ids, w, gu.values, gu.meta, gu.idx, gu.rows, gu.cols, dn.values, dn.meta, dn.idx, dn.rows,
            dn.cols, n, m, v, to.act_id("swiglu"), None, None, 1.702, 7.0)
    a = to.moe_backward_eager(*args, dx_path="ssmm_dx")
    b = to.moe_backward_eager(*args, dx_path="transposed")
    for k, (ga, gb) in enumerate(zip(a, b)):
        if ga.numel():
            assert rel_err(ga, gb) < 1e-2, k

    def no_ssmm_dx(*a, **k):
        raise AssertionError("the default dX path ran ssmm_dx on a format with a transposed packing")

    monkeypatch.setattr(to, "ssmm_dx", no_ssmm_dx)
    for k, (gb, gc) in enumerate(zip(b, to.moe_backward_eager(*args))):
        if gb.numel():
            assert rel_err(gb, gc) < 1e-3, k


@pytest.mark.parametrize("fmt", ["samoyeds-1:2:64", "1:4:64", "2:4"])
def test_oracle_agrees_with_the_c_reference(fmt):
    """This file's oracle against the C reference on the CPU: the GPU tests' yardstick is sound."""
    case = (37, 2, 4, (136, 136), 200, "placeholder")
    p, r, dy, tok, sc, S = make_inputs(case, fmt, torch.float32, True, False, True, 3)
    assert rel_err(run_dx(p, r, dy, tok, sc, S, "cpu"), oracle_dx(dy, p, r.offsets, tok, sc, S)) < 1e-5


def test_impl_is_checked_by_name():
    """An unknown kernel name, or an impl code outside the C binding's range, raises naming impl."""
    from samoyeds import _C
    p = sm.pack(torch.randn(2, 64, 128), "samoyeds-1:2:64")
    off, dy = torch.tensor([0, 2, 4], dtype=torch.int32), torch.randn(4, 64)
    with pytest.raises(ValueError, match="^impl: expected one of 'auto', 'mma', 'wgmma'"):
        ssmm_dx(dy, p, off, impl="fast")
    out = torch.empty(4, 128)
    with pytest.raises(ValueError, match="impl"):
        _C.ssmm_dx(out, dy, p.values, p.meta, p.idx, off, None, 64, 128, *p.c_args(), impl=3)
    _C.ssmm_dx(out, dy, p.values, p.meta, p.idx, off, None, 64, 128, *p.c_args(), impl=2)  # the CPU: ignored
    assert torch.allclose(out, ssmm_dx(dy, p, off))
