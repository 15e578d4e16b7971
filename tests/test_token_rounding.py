"""Token rounding: every expert's count becomes the nearest multiple of the tile,
with the right tokens dropped or added."""
from __future__ import annotations

import pytest
import torch

import samoyeds as sm
from samoyeds.token_rounding import token_rounding


def _router(T, E, K, gen, scores="softmax"):
    """Router scores: softmax probabilities, or raw logits (negative too: the ranking must not
    assume scores in [0, 1])."""
    logits = torch.randn(T, E, generator=gen) * 2
    probs = torch.softmax(logits, dim=-1) if scores == "softmax" else logits - 3
    w, i = probs.topk(K, dim=-1)
    return probs, i, w


def _pairs(idx, w, E):
    out = {}
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if 0 <= e < E:
                out[(t, e)] = float(w[t, k])
    return out


@pytest.mark.parametrize("T,E,K,tile", [(50, 6, 2, 4), (200, 16, 4, 8), (7, 3, 1, 4), (64, 8, 2, 1)])
@pytest.mark.parametrize("scores", ["softmax", "logits"])
def test_token_rounding_rules(T, E, K, tile, scores):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    probs, idx, w = _router(T, E, K, gen, scores)
    new_idx, new_w = token_rounding(probs, idx, w, tile=tile)
    before, after = _pairs(idx, w, E), _pairs(new_idx, new_w, E)
    assert ((new_idx == E) == (new_w == 0)).all()
    for e in range(E):
        old = {t for (t, ee) in before if ee == e}
        new = {t for (t, ee) in after if ee == e}
        target = min(T, round(len(old) / tile) * tile)
        assert len(new) == target
        assert abs(len(new) - len(old)) <= tile / 2 or target == T
        if len(new) <= len(old):   # dropped: the lowest-scored routed tokens
            assert new <= old
            if new and old - new:
                assert min(probs[t, e] for t in new) >= max(probs[t, e] for t in old - new)
        else:                      # added: the best-scored tokens that did not route here
            assert old <= new
            others = set(range(T)) - new
            if others:
                assert min(probs[t, e] for t in new - old) >= max(probs[t, e] for t in others - old)
    for (t, e), v in after.items():
        assert v == pytest.approx(before[(t, e)] if (t, e) in before else float(probs[t, e]))
    r = sm.route(new_idx, E)
    counts = (r.offsets[1:] - r.offsets[:-1]).tolist()
    assert all(c % tile == 0 or c == T for c in counts)


def test_token_rounding_identity_when_aligned():
    gen = torch.Generator().manual_seed(0)
    T, E = 32, 4
    probs = torch.softmax(torch.randn(T, E, generator=gen), -1)
    idx = (torch.arange(T) % E).unsqueeze(1)  # 8 tokens per expert
    w = probs.gather(1, idx)
    new_idx, new_w = token_rounding(probs, idx, w, tile=8)
    assert new_idx.shape == (T, 1) and torch.equal(new_idx, idx) and torch.equal(new_w, w)


def test_token_rounding_bad_input():
    with pytest.raises(ValueError, match="tile"):
        token_rounding(torch.rand(4, 3), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1), tile=0)
    with pytest.raises(ValueError, match="router_probs"):
        token_rounding(torch.rand(4), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1))
    with pytest.raises(ValueError, match="tile"):
        token_rounding(torch.rand(4, 3), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1), tile=True)
    with pytest.raises(ValueError, match=r"^router_probs: expected at least one expert"):
        token_rounding(torch.rand(4, 0), torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1))
    nan = torch.rand(4, 3)
    nan[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"^router_probs: 1 NaN scores"):
        token_rounding(nan, torch.zeros(4, 1, dtype=torch.long), torch.rand(4, 1))


@pytest.mark.gpu
def test_token_rounding_gpu_matches_cpu():
    gen = torch.Generator().manual_seed(5)
    probs, idx, w = _router(300, 16, 4, gen)
    a = token_rounding(probs, idx, w, tile=16)
    b = token_rounding(probs.cuda(), idx.cuda(), w.cuda(), tile=16)
    assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())
