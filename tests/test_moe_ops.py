"""Routing metadata, routing-weight gather and the combine: reference semantics
on the CPU, and bit-identical results from the GPU."""
from __future__ import annotations

import pytest
import torch

import samoyeds as sm
from helpers import random_topk


def _python_route(topk, E):
    T, K = topk.shape
    flat = topk.reshape(-1).tolist()
    rows = {e: [i for i, v in enumerate(flat) if v == e] for e in range(E)}
    offsets, tok, perm, pos = [0], [], [], [-1] * (T * K)
    for e in range(E):
        for i in rows[e]:
            pos[i] = len(perm)
            perm.append(i)
            tok.append(i // K)
        offsets.append(len(perm))
    return offsets, tok, perm, pos


@pytest.mark.parametrize("pattern", ["uniform", "one", "skewed", "placeholder"])
@pytest.mark.parametrize("T,K,E", [(0, 2, 4), (1, 1, 1), (17, 2, 8), (100, 6, 64), (33, 8, 128)])
@pytest.mark.parametrize("itype", [torch.int64, torch.int32])
def test_route_reference(pattern, T, K, E, itype):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    topk = random_topk(T, K, E, pattern, gen).to(itype)
    r = sm.route(topk, E)
    offsets, tok, perm, pos = _python_route(topk, E)
    n = offsets[-1]
    assert r.offsets.tolist() == offsets
    assert r.token_ids[:n].tolist() == tok
    assert r.perm[:n].tolist() == perm
    assert r.pos.reshape(-1).tolist() == pos
    assert (r.perm[n:] == -1).all()


def test_combine_and_gather_reference():
    gen = torch.Generator().manual_seed(3)
    T, K, E, H = 29, 3, 6, 40
    topk = random_topk(T, K, E, "placeholder", gen)
    w = torch.rand(T, K, generator=gen)
    r = sm.route(topk, E)
    sw = sm.gather_weights(w, r)
    n = int(r.offsets[-1])
    assert torch.equal(sw[:n], w.reshape(-1)[r.perm[:n].long()])
    assert (sw[n:] == 0).all()
    y = torch.randn(T * K, H, generator=gen).to(torch.bfloat16)
    out = sm.combine(y, r.pos)
    ref = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            s = int(r.pos[t, k])
            if s >= 0:
                ref[t] += y[s].float()
    assert torch.equal(out, ref.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,E", [(0, 2, 4), (1, 1, 1), (1, 6, 64), (3, 2, 33), (16, 8, 128), (100, 3, 300),
                                   (333, 2, 8), (2048, 2, 16), (2049, 2, 16), (4096, 8, 128),
                                   (20000, 6, 64), (50, 2, 1000), (7001, 3, 3000), (140000, 4, 8)])
@pytest.mark.parametrize("pattern", ["uniform", "skewed", "placeholder", "one"])
def test_route_gpu_bit_identical(T, K, E, pattern):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    topk = random_topk(T, K, E, pattern, gen)
    w = torch.rand(T, K, generator=gen)
    rc = sm.route(topk, E)
    rg = sm.route(topk.cuda(), E)
    for name in ("offsets", "token_ids", "perm", "pos"):
        assert torch.equal(getattr(rg, name).cpu(), getattr(rc, name)), name
    assert torch.equal(sm.gather_weights(w.cuda(), rg).cpu(), sm.gather_weights(w, rc))
    y = torch.randn(T * K, 136, generator=gen).to(torch.bfloat16)
    assert torch.equal(sm.combine(y.cuda(), rg.pos).cpu(), sm.combine(y, rc.pos))
    assert torch.equal(sm.combine(y.cuda(), rg.pos, dtype="float32").cpu(), sm.combine(y, rc.pos, dtype="float32"))


# ---- moe_zero_unrouted: the rows no routed pair owns ---------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("routed,cols,strided", [(5, 8, False), (0, 3, False), (9, 8, False), (7, 5, True),
                                                 (2, 64, True)])
def test_zero_unrouted_zeroes_exactly_the_rows_past_offsets(device, dtype, routed, cols, strided):
    """Rows [offsets[E], S) become 0 (bytes), every other byte of the tensor, routed rows and
    the gaps of a row stride alike, stays as it was; offsets[E] >= S (all rows routed) and a
    negative offsets[E] (read as 0) are safe."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    S = 9
    base = torch.randint(1, 100, (S, cols + 3 if strided else cols)).to(dtype).to(device)
    out = base[:, :cols] if strided else base
    before = base.clone()
    offsets = torch.tensor([0, min(routed, S), routed], dtype=torch.int32, device=device)
    sm._C.moe_zero_unrouted(out, offsets)
    want = before.clone()
    want[max(0, routed):, :cols] = 0
    assert torch.equal(base.cpu(), want.cpu())
    offsets[-1] = -4
    sm._C.moe_zero_unrouted(out, offsets)
    want[:, :cols] = 0
    assert torch.equal(base.cpu(), want.cpu())


def test_zero_unrouted_names_bad_arguments():
    out = torch.ones(4, 3)
    with pytest.raises(TypeError, match="offsets"):
        sm._C.moe_zero_unrouted(out, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="out"):
        sm._C.moe_zero_unrouted(torch.ones(4), torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="offsets"):
        sm._C.moe_zero_unrouted(out, torch.zeros(0, dtype=torch.int32))
    with pytest.raises(TypeError, match="out"):
        sm._C.moe_zero_unrouted([1, 2], torch.tensor([0, 2], dtype=torch.int32))
