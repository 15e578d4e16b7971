"""glu_backward (csrc/dense_ref.c, cuda/glu.cu): the C reference against _glu_backward
(samoyeds/torch_ops.py, the torch definition) and a float64 oracle on the CPU; the CUDA
kernel against the C reference and the oracle, outputs poisoned with NaN first, rows past
offsets[E] poisoned too (never read: written as 0).  Fresh random inputs per case."""
from __future__ import annotations

import pytest
import torch

from samoyeds.ops import glu_backward
from helpers import dy_t_of
from samoyeds.torch_ops import ACT_IDS, _glu_backward

ALPHA, LIMIT = 1.702, 7.0
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(7, 13), (1, 1), (0, 5), (33, 64), (5, 8)]   # odd S and I, S = 0, whole 8-column pieces


def _inputs(S, I, dtype, scale=True, gen=None):
    # a spread that reaches past GPT-OSS's limit (7), both signs
    pre = (torch.randn(S, 2 * I, generator=gen) * 5.0).to(dtype)
    dh = torch.randn(S, I, generator=gen)
    sc = torch.rand(S, generator=gen) + 0.25 if scale else None
    return pre, dh, sc


def oracle(dh, pre, act, scale=None, alpha=ALPHA, limit=LIMIT):
    """float64 d preact [S, 2I] of the same inputs (the clamps' ends pass the gradient)."""
    I = pre.shape[1] // 2
    d = dh.double() * (scale.double()[:, None] if scale is not None else 1.0)
    g, u = pre[:, :I].double(), pre[:, I:].double()
    if act == "swiglu":
        sg = torch.sigmoid(g)
        return torch.cat((d * u * sg * (1 + g * (1 - sg)), d * g * sg), 1)
    gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
    sg = torch.sigmoid(alpha * gc)
    dg = torch.where(g <= limit, d * (uc + 1) * (sg + alpha * gc * sg * (1 - sg)), 0.0)
    du = torch.where((u >= -limit) & (u <= limit), d * gc * sg, 0.0)
    return torch.cat((dg, du), 1)


def torch_ref(dh, pre, act, scale=None, alpha=ALPHA, limit=LIMIT):
    d = dh.float() * scale[:, None] if scale is not None else dh.float()
    return _glu_backward(d, pre, ACT_IDS[act], alpha, limit)


def close32(a, b):
    """Equal up to a few ulps of a differently rounded exp, which GPT-OSS's gate derivative
    (sg + alpha g sg (1 - sg), cancelling for negative g) scales: relative to the tensor."""
    scale = b.abs().max().item() if b.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=4e-6, atol=1e-6 * scale + 1e-30)


def _ulps(dtype):
    """Relative size of one ulp of dtype at most (a differently rounded exp may flip one), at
    least the fp32 slack of the comparisons above."""
    return {torch.float32: 4e-6, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]


@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
@pytest.mark.parametrize("S,I", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_scale", [False, True])
def test_ref_matches_torch_definition(act, S, I, dtype, with_scale):
    pre, dh, sc = _inputs(S, I, dtype, with_scale)
    want = torch_ref(dh, pre, act, sc)
    out = torch.full((S, 2 * I), float("nan"))
    glu_backward(dh, pre, out, scale=sc, act=act)
    # the same fp32 arithmetic: at most the ulps of a differently rounded exp apart
    close32(out, want)
    if S:
        o64 = oracle(dh, pre, act, sc)
        err, base = (out.double() - o64).abs().max().item(), (want.double() - o64).abs().max().item()
        assert err <= 2 * base + 1e-6 * o64.abs().max().item()
    # dh in preact's dtype, out in preact's dtype: one rounding of the same fp32 values
    dh_t = dh.to(dtype)
    got = glu_backward(dh_t, pre, scale=sc, act=act)
    assert got.dtype == dtype
    want_t = torch_ref(dh_t, pre, act, sc)
    scale = want_t.abs().max().item() if want_t.numel() else 0.0
    torch.testing.assert_close(got.float(), want_t.to(dtype).float(), rtol=_ulps(dtype), atol=1e-6 * scale + 1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_clamp_edges(dtype):
    """GPT-OSS at the clamps' ends: the gate passes its gradient up to limit included, the
    up inside [-limit, limit] both ends included; beyond, exactly 0 (as torch's clamp)."""
    edges = torch.tensor([-7.5, -7.0, -6.5, 0.5, 6.5, 7.0, 7.5, 8.0])   # (no 0: d up = d * 0 there)
    g = edges.repeat_interleave(len(edges))
    u = edges.repeat(len(edges))
    pre = torch.cat((g[None], u[None]), 1).to(dtype)            # [1, 2I]: gate, then up
    I = g.numel()
    dh = torch.randn(1, I) + 2.0
    out = glu_backward(dh, pre, act="gptoss", alpha=ALPHA, limit=LIMIT, dtype="float32")
    want = torch_ref(dh, pre, "gptoss")
    close32(out, want)
    dg, du = out[0, :I], out[0, I:]
    assert torch.equal(dg == 0, g > LIMIT)
    assert torch.equal(du == 0, (u > LIMIT) | (u < -LIMIT))
    # at the other limits too
    out2 = glu_backward(dh, pre, act="gptoss", alpha=1.0, limit=6.5, dtype="float32")
    close32(out2, torch_ref(dh, pre, "gptoss", alpha=1.0, limit=6.5))
    assert torch.equal(out2[0, :I] == 0, g > 6.5)


@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
@pytest.mark.parametrize("live", [0, 5, 11])
def test_ref_offsets_tail_rows_zero(act, live):
    """Rows past offsets[E] come out as exact zeros whatever dh and preact hold there (NaN)."""
    S, I, E = 11, 9, 3
    pre, dh, sc = _inputs(S, I, torch.bfloat16)
    pre[live:] = float("nan")
    dh[live:] = float("nan")
    sc[live:] = float("nan")
    cuts = sorted(torch.randint(0, live + 1, (E - 1,)).tolist())
    offsets = torch.tensor([0] + cuts + [live], dtype=torch.int32)
    out = torch.full((S, 2 * I), float("nan"))
    glu_backward(dh, pre, out, scale=sc, offsets=offsets, act=act)
    assert torch.equal(out[live:], torch.zeros(S - live, 2 * I))
    close32(out[:live], torch_ref(dh[:live], pre[:live], act, sc[:live]))


def test_ref_row_strides():
    S, I = 6, 10
    wide = torch.randn(S, 2 * I + 6).to(torch.bfloat16) * 4
    pre = wide[:, 3:3 + 2 * I]
    dhw = torch.randn(S, I + 5)
    dh = dhw[:, 2:2 + I]
    outw = torch.full((S, 2 * I + 4), float("nan"), dtype=torch.bfloat16)
    out = outw[:, 1:1 + 2 * I]
    glu_backward(dh, pre, out, act="swiglu")
    assert torch.equal(out, glu_backward(dh.contiguous(), pre.contiguous(), act="swiglu"))
    assert torch.isnan(outw[:, 0].float()).all() and torch.isnan(outw[:, 2 * I + 1:].float()).all()


def test_errors_name_the_argument():
    pre = torch.randn(4, 6, dtype=torch.bfloat16)
    dh = torch.randn(4, 3)
    with pytest.raises(ValueError, match="^preact:"):
        glu_backward(dh, torch.randn(4, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^dh:"):
        glu_backward(torch.randn(4, 4), pre)
    with pytest.raises(ValueError, match="^dh:"):
        glu_backward(torch.randn(3, 3), pre)
    with pytest.raises(TypeError, match="^dh:"):
        glu_backward(dh.half(), pre)
    with pytest.raises(TypeError, match="^out:"):
        glu_backward(dh, pre, torch.empty(4, 6, dtype=torch.float16))
    with pytest.raises(ValueError, match="^out:"):
        glu_backward(dh, pre, torch.empty(4, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="^preact:"):
        glu_backward(dh, pre.to(torch.int32))
    with pytest.raises(ValueError, match="^scale:"):
        glu_backward(dh, pre, scale=torch.ones(5))
    with pytest.raises(TypeError, match="^scale:"):
        glu_backward(dh, pre, scale=torch.ones(4, dtype=torch.float16))
    with pytest.raises(TypeError, match="^offsets:"):
        glu_backward(dh, pre, offsets=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="^offsets:"):
        glu_backward(dh, pre, offsets=torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="^act:"):
        glu_backward(dh, pre, act="relu")
    with pytest.raises(TypeError, match="^dtype:"):
        glu_backward(dh, pre, dtype="float16")
    with pytest.raises(TypeError, match="^dh:"):
        glu_backward([1.0], pre)


# ---- the CUDA kernel ---------------------------------------------------------------------------

GPU_SHAPES = [(37, 13), (64, 128), (0, 8), (5, 8), (300, 1000), (3, 4)]   # scalar and 16-byte paths


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
@pytest.mark.parametrize("S,I", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dh32,out32", [(True, True), (True, False), (False, False), (False, True)])
@pytest.mark.parametrize("with_scale,with_offsets", [(False, False), (True, True), (True, False)])
def test_cuda_matches_ref_and_oracle(act, S, I, dtype, dh32, out32, with_scale, with_offsets):
    pre, dh, sc = _inputs(S, I, dtype, with_scale)
    dh = dh if dh32 else dh.to(dtype)
    live = S
    offsets = None
    if with_offsets:
        live = S * 2 // 3
        pre[live:] = float("nan")
        dh[live:] = float("nan")
        if sc is not None:
            sc[live:] = float("nan")
        offsets = torch.tensor([0, live // 2, live], dtype=torch.int32)
    odt = torch.float32 if out32 else dtype
    ref = torch.full((S, 2 * I), float("nan"), dtype=odt)
    glu_backward(dh, pre, ref, scale=sc, offsets=offsets, act=act)
    out = torch.full((S, 2 * I), float("nan"), dtype=odt, device="cuda")
    glu_backward(dh.cuda(), pre.cuda(), out, scale=None if sc is None else sc.cuda(),
                 offsets=None if offsets is None else offsets.cuda(), act=act)
    got = out.cpu()
    assert not torch.isnan(got).any()
    assert torch.equal(got[live:], torch.zeros(S - live, 2 * I, dtype=odt))
    if live == 0:
        return
    # the kernel's expf may differ from the host's by an ulp or two: the flash-attention rule
    o64 = oracle(dh[:live], pre[:live], act, None if sc is None else sc[:live])
    err = (got[:live].double() - o64).abs().max().item()
    base = (ref[:live].double() - o64).abs().max().item()
    assert err <= 2 * base + 4e-6 * o64.abs().max().item() + 1e-30
    # and the torch definition on the GPU (same formulas, same expf): fp32 within an ulp or two
    if out32:
        want = torch_ref(dh[:live].cuda(), pre[:live].cuda(), act, None if sc is None else sc[:live].cuda())
        close32(got[:live], want.cpu())


@pytest.mark.gpu
def test_cuda_unaligned_and_strided():
    """Row strides and addresses that rule out 16-byte accesses take the element path."""
    S, I = 40, 64
    wide = (torch.randn(S, 2 * I + 2, device="cuda") * 4).to(torch.bfloat16)
    pre = wide[:, 1:1 + 2 * I]                       # 2-byte offset: not 16-byte aligned
    dh = torch.randn(S, I, device="cuda")
    outw = torch.full((S, 2 * I + 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = outw[:, 8:]
    for o in (out, None):
        got = glu_backward(dh, pre, o, act="gptoss")
        ref = glu_backward(dh.cpu(), pre.cpu(), act="gptoss")
        o64 = oracle(dh.cpu(), pre.cpu(), "gptoss")
        assert (got.cpu().double() - o64).abs().max() <= 2 * (ref.double() - o64).abs().max() + 1e-6
    assert torch.isnan(outw[:, :8].float()).all()


@pytest.mark.gpu
def test_cuda_tail_rows_uninitialised():
    """The rows past offsets[E] are fresh device memory never written: run under
    `compute-sanitizer --tool initcheck` (PYTORCH_NO_CUDA_MEMORY_CACHING=1), which reports
    any read of them; the result there is 0 and the rest deterministic."""
    S, I, live = 96, 256, 50
    pre = torch.empty(S, 2 * I, dtype=torch.bfloat16, device="cuda")
    dh = torch.empty(S, I, dtype=torch.bfloat16, device="cuda")
    sc = torch.empty(S, device="cuda")
    pre[:live] = (torch.randn(live, 2 * I, device="cuda") * 5).to(torch.bfloat16)
    dh[:live] = torch.randn(live, I, device="cuda").to(torch.bfloat16)
    sc[:live] = torch.rand(live, device="cuda")
    offsets = torch.tensor([0, 20, 20, live], dtype=torch.int32, device="cuda")
    a = glu_backward(dh, pre, scale=sc, offsets=offsets, act="swiglu")
    b = glu_backward(dh, pre, scale=sc, offsets=offsets, act="swiglu")
    assert torch.equal(a, b)
    assert torch.equal(a[live:].cpu(), torch.zeros(S - live, 2 * I, dtype=torch.bfloat16))


def hdot_oracle(dh, pre, act, alpha=ALPHA, limit=LIMIT):
    """float64 sum_i dh[s, i] * h[s, i], h = act(gate, up) rounded to pre's dtype (as glu writes it)."""
    I = pre.shape[1] // 2
    g, u = pre[:, :I].double(), pre[:, I:].double()
    if act == "swiglu":
        h = g * torch.sigmoid(g) * u
    else:
        gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
        h = gc * torch.sigmoid(alpha * gc) * (uc + 1)
    return (dh.double() * h.to(pre.dtype).double()).sum(1)


def _hdot_close(got, want, dh, pre, dtype):
    """fp32 sums of I products against float64: |err| within I fp32 roundings of the sum of
    |terms|, plus h's own rounding where act(gate, up) in fp32 lands on the other side of a
    rounding boundary of the pre-activation's dtype than in float64 (one ulp of dtype)."""
    I = pre.shape[1] // 2
    terms = (dh.double().abs() * (pre[:, :I].double().abs() * (pre[:, I:].double().abs() + 1) + 1)).sum(1)
    tol = (I + 2) * 2.0 ** -23 * terms + _ulps(dtype) * terms
    assert ((got.double() - want).abs() <= tol + 1e-30).all(), (got, want)


@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
@pytest.mark.parametrize("S,I", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_hdot(act, S, I, dtype):
    """hdot (the row dot products of dh before the scale with h) against float64, the other
    output the same to the bit as without hdot; rows past offsets[E] 0."""
    pre, dh, sc = _inputs(S, I, dtype)
    hdot = torch.full((S,), float("nan"))
    out = glu_backward(dh, pre, scale=sc, act=act, hdot=hdot)
    assert torch.equal(out, glu_backward(dh, pre, scale=sc, act=act))
    _hdot_close(hdot, hdot_oracle(dh, pre, act), dh, pre, dtype)
    if S >= 3:
        live = S - 2
        offsets = torch.tensor([0, live], dtype=torch.int32)
        hdot.fill_(float("nan"))
        glu_backward(dh, pre, scale=sc, offsets=offsets, act=act, hdot=hdot)
        assert torch.equal(hdot[live:], torch.zeros(2))
        _hdot_close(hdot[:live], hdot_oracle(dh[:live], pre[:live], act), dh[:live], pre[:live], dtype)


def test_hdot_errors_name_the_argument():
    pre, dh, _ = _inputs(6, 8, torch.float32)
    with pytest.raises(ValueError, match=r"^hdot: "):
        glu_backward(dh, pre, hdot=torch.zeros(5))
    with pytest.raises((TypeError, ValueError), match=r"^hdot: "):
        glu_backward(dh, pre, hdot=torch.zeros(6, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
@pytest.mark.parametrize("S,I", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dh32,out32", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_cuda_hdot(act, S, I, dtype, dh32, out32, with_offsets):
    """The warp-per-row kernel (hdot given): out bit for bit what the kernel without hdot
    writes, hdot against the C reference and float64, rows past offsets[E] poisoned (never
    read) and written as 0, deterministic."""
    pre, dh, sc = _inputs(S, I, dtype, True)
    dh = dh if dh32 else dh.to(dtype)
    live, offsets = S, None
    if with_offsets:
        live = S * 2 // 3
        pre[live:] = float("nan")
        dh[live:] = float("nan")
        sc[live:] = float("nan")
        offsets = torch.tensor([0, live // 2, live], dtype=torch.int32).cuda()
    odt = torch.float32 if out32 else dtype
    args = (dh.cuda(), pre.cuda())
    kw = dict(scale=sc.cuda(), offsets=offsets, act=act)
    want = glu_backward(*args, torch.full((S, 2 * I), float("nan"), dtype=odt, device="cuda"), **kw)
    hd = [torch.full((S,), float("nan"), device="cuda") for _ in range(2)]
    got = [glu_backward(*args, torch.full((S, 2 * I), float("nan"), dtype=odt, device="cuda"), hdot=h, **kw)
           for h in hd]
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    assert torch.equal(hd[0], hd[1])
    h = hd[0].cpu()
    assert torch.equal(h[live:], torch.zeros(S - live))
    if live:
        ref = torch.full((S,), float("nan"))
        glu_backward(dh, pre, scale=sc, offsets=None if offsets is None else offsets.cpu(), act=act, hdot=ref)
        o64 = hdot_oracle(dh[:live], pre[:live], act)
        _hdot_close(h[:live], o64, dh[:live], pre[:live], dtype)
        _hdot_close(ref[:live], o64, dh[:live], pre[:live], dtype)


# ---- out_t: out again in ssmm_dw's transposed layout by expert segment (samoyeds.ops.dy_t_shape)

def _routed(S, gen, empty_first=False):
    """Offsets of a few experts over S sorted rows: empty experts, a placeholder tail."""
    E = 5
    cuts = sorted(torch.randint(0, max(S - 2, 0) + 1, (E - 1,), generator=gen).tolist())
    off = [0] + cuts + [max(S - 2, 0)]
    if empty_first:
        off[1] = 0
    return torch.tensor(off, dtype=torch.int32)


@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
@pytest.mark.parametrize("S,I", [(37, 13), (0, 5), (70, 64), (9, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_out_t(act, S, I, dtype):
    """The C reference's out_t: out rounded to preact's dtype in the segmented transposed
    layout (built in torch from its definition), out and hdot the same bits as without it."""
    gen = torch.Generator().manual_seed(S * 31 + I)
    pre, dh, sc = _inputs(S, I, dtype, gen=gen)
    offsets = _routed(S, gen, empty_first=True)
    from samoyeds.ops import dy_t_shape
    out_t = torch.full(dy_t_shape(2 * I, S, offsets.numel() - 1), float("nan"), dtype=dtype)
    hd, hd2 = torch.full((S,), float("nan")), torch.full((S,), float("nan"))
    out = glu_backward(dh, pre, scale=sc, offsets=offsets, act=act, hdot=hd, dtype="float32", out_t=out_t)
    assert torch.equal(out, glu_backward(dh, pre, scale=sc, offsets=offsets, act=act, hdot=hd2, dtype="float32"))
    assert torch.equal(hd, hd2)
    assert torch.equal(out_t, dy_t_of(out, offsets, dtype=dtype))


def test_out_t_errors_name_the_argument():
    from samoyeds.ops import dy_t_shape
    pre, dh, _ = _inputs(6, 8, torch.bfloat16)
    off = torch.tensor([0, 2, 6], dtype=torch.int32)
    good = dy_t_shape(16, 6, 2)
    with pytest.raises(ValueError, match=r"^offsets: expected the expert offsets with out_t"):
        glu_backward(dh, pre, out_t=torch.zeros(good, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^out_t: expected shape"):
        glu_backward(dh, pre, offsets=off, out_t=torch.zeros(good[0], good[1] + 64, dtype=torch.bfloat16))
    with pytest.raises((TypeError, ValueError), match=r"^out_t: "):
        glu_backward(dh, pre, offsets=off, out_t=torch.zeros(good, dtype=torch.float16))
    bad = torch.tensor([0, 4, 2], dtype=torch.int32)
    out_t = torch.full(good, 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"offsets: offsets\[2\] = 2; expected non-decreasing"):
        glu_backward(dh, pre, offsets=bad, out_t=out_t)
    assert (out_t == 7.0).all(), "nothing written before the offsets are checked"


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
@pytest.mark.parametrize("S,I", [(1, 8), (37, 13), (0, 5), (300, 64), (130, 200), (700, 768)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dh32,out32", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("with_hdot", [False, True])
def test_cuda_out_t(act, S, I, dtype, dh32, out32, with_hdot):
    """The fused kernel (glu_backward_t_kernel): out the same bits as the kernel without out_t,
    out_t the layout of that out (built in torch), hdot against float64; empty experts, a
    placeholder tail poisoned (never read, written as 0), I not a multiple of 8 (element-wise
    loads), everything poisoned first."""
    from samoyeds.ops import dy_t_shape
    gen = torch.Generator().manual_seed(torch.seed() % 2 ** 31)
    pre, dh, sc = _inputs(S, I, dtype, gen=gen)
    dh = dh if dh32 else dh.to(dtype)
    offsets = _routed(S, gen, empty_first=S % 2 == 1)
    live = int(offsets[-1])
    pre[live:], dh[live:] = float("nan"), float("nan")
    odt = torch.float32 if out32 else dtype
    kw = dict(scale=sc.cuda(), offsets=offsets.cuda(), act=act)
    args = (dh.cuda(), pre.cuda())
    h1 = torch.full((S,), float("nan"), device="cuda") if with_hdot else None
    want = glu_backward(*args, torch.full((S, 2 * I), float("nan"), dtype=odt, device="cuda"), hdot=h1, **kw)
    out_t = torch.full(dy_t_shape(2 * I, S, offsets.numel() - 1), float("nan"), dtype=dtype, device="cuda")
    h2 = torch.full((S,), float("nan"), device="cuda") if with_hdot else None
    got = glu_backward(*args, torch.full((S, 2 * I), float("nan"), dtype=odt, device="cuda"), hdot=h2, out_t=out_t,
                       **kw)
    assert torch.equal(got, want)
    assert torch.equal(got[live:].cpu(), torch.zeros(S - live, 2 * I, dtype=odt))
    assert torch.equal(out_t.cpu(), dy_t_of(got.cpu(), offsets, dtype=dtype))
    if with_hdot:
        h = h2.cpu()
        assert torch.equal(h[live:], torch.zeros(S - live))
        if live:
            _hdot_close(h[:live], hdot_oracle(dh[:live].float(), pre[:live], act), dh[:live].float(), pre[:live],
                        dtype)


@pytest.mark.gpu
def test_cuda_out_t_rows_outside_the_offsets():
    """offsets[0] > 0: the rows before it are computed (as without out_t) by the other kernel,
    in no segment of out_t; the fused kernel twice gives the same bits (deterministic)."""
    from samoyeds.ops import dy_t_shape
    gen = torch.Generator().manual_seed(3)
    S, I = 200, 64
    pre, dh, sc = _inputs(S, I, torch.bfloat16, gen=gen)
    offsets = torch.tensor([17, 60, 60, 150], dtype=torch.int32)
    args, kw = (dh.cuda(), pre.cuda()), dict(scale=sc.cuda(), offsets=offsets.cuda())
    want = glu_backward(*args, **kw)
    ts = [torch.full(dy_t_shape(2 * I, S, 3), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    hs = [torch.full((S,), float("nan"), device="cuda") for _ in range(2)]
    outs = [glu_backward(*args, out_t=t, hdot=h, **kw) for t, h in zip(ts, hs)]
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)
    assert torch.equal(ts[0], ts[1]) and torch.equal(hs[0], hs[1])
    assert torch.equal(ts[0].cpu(), dy_t_of(want.cpu(), offsets))
    assert torch.isfinite(hs[0][:150]).all() and not hs[0][150:].any()
