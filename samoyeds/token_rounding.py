"""Tile-aware token rounding (SonicMoE's "NR-f"), opt-in.

A grouped MoE kernel processes each expert's tokens in tiles of ``tile`` rows
(128 for samoyeds' kernels); an expert with 130 tokens pays for two tiles.
Token rounding changes the routing so that every expert's token count is the
nearest multiple of the tile: an expert rounded down drops its lowest-scored
routed tokens, one rounded up takes the best-scored tokens that did not route
to it.  Each expert moves by at most ``tile / 2`` tokens.

Caveat: this is no longer token-choice routing.  A token may lose one of its
top-k experts or gain extra ones, so the layer computes a (slightly) different
function.  It is meant for prefill and training throughput with models trained
or fine-tuned with it (SonicMoE trains with it and evaluates with plain top-k);
do not switch it on for decoding or for exact reproduction of a model.
"""
from __future__ import annotations

from typing import Any, Tuple


def token_rounding(router_probs: Any, top_k_index: Any, top_k_weights: Any, tile: int = 128,
                   ) -> Tuple[Any, Any]:
    """Rounds every expert's token count to the nearest multiple of ``tile``.

    Args:
        router_probs: ``[T, E]`` router scores (e.g. softmax probabilities), float.
        top_k_index: ``[T, K]`` the router's top-k expert ids (int32/int64).
        top_k_weights: ``[T, K]`` their weights.
        tile: the kernel's token tile (samoyeds: 128).
    Returns:
        ``(index, weights)`` shaped ``[T, K2]`` (``K2 >= 1``, the largest number of
        experts any token now has).  Unused slots hold the placeholder id ``E``
        (skipped by :func:`samoyeds.route`) with weight 0.  Kept pairs keep their
        top-k weight; added pairs get their router score.  Counts per expert are
        ``round(count / tile) * tile``, capped at T.

    The shape of the result depends on the data: this function synchronises
    with the device once (to size it).
    """
    import torch

    if router_probs.ndim != 2 or top_k_index.ndim != 2 or top_k_index.shape != top_k_weights.shape:
        raise ValueError(f"router_probs: expected [T, E] with top_k_index/top_k_weights [T, K]; got "
                         f"{tuple(router_probs.shape)}, {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)}")
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile: expected a positive int, got {tile!r}")
    T, E = router_probs.shape
    if top_k_index.shape[0] != T:
        raise ValueError(f"top_k_index: expected {T} rows (router_probs'), got {top_k_index.shape[0]}")
    if E == 0:
        raise ValueError("router_probs: expected at least one expert column, got [T, 0]")
    dev = router_probs.device
    idx = top_k_index.long()
    valid = (idx >= 0) & (idx < E)
    routed = torch.zeros(T, E, dtype=torch.bool, device=dev)
    routed.scatter_(1, idx.clamp(0, E - 1), valid)
    weight = torch.zeros(T, E, dtype=top_k_weights.dtype, device=dev)
    weight.scatter_(1, idx.clamp(0, E - 1), torch.where(valid, top_k_weights, torch.zeros_like(top_k_weights)))
    # routed tokens rank first in every expert's column, by score; then the others by score
    # (two stable sorts, so any scores order right: probabilities, logits, biased scores)
    scores = router_probs.float()
    by_score = scores.argsort(dim=0, descending=True, stable=True)
    unrouted = (~routed.gather(0, by_score)).int()
    order = by_score.gather(0, unrouted.argsort(dim=0, stable=True))  # [T, E] token order per expert
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(T, device=dev).unsqueeze(1).expand(T, E))
    count = routed.sum(0)
    target = torch.clamp(torch.round(count.float() / tile) * tile, max=T).long()
    keep = rank < target.unsqueeze(0)                                   # [T, E]
    new_w = torch.where(routed, weight, router_probs.to(weight.dtype))
    # the one synchronisation: the result's width, and whether a score is NaN (no order)
    most, nans = (torch.stack([keep.sum(1).max(), scores.isnan().sum()]).tolist() if T else (0, 0))
    if nans:
        raise ValueError(f"router_probs: {nans} NaN scores (no order to round by)")
    k2 = max(int(most), 1)
    # each token's kept experts in increasing id, placeholders after (distinct keys: the
    # same order on every device)
    ids = torch.arange(E, device=dev)
    key = torch.where(keep, E - ids, -1 - ids)
    sel = key.topk(k2, dim=1, sorted=True)
    e_ids = sel.indices
    used = sel.values > 0
    out_idx = torch.where(used, e_ids, torch.full_like(e_ids, E)).to(top_k_index.dtype)
    out_w = torch.where(used, new_w.gather(1, e_ids), torch.zeros_like(new_w[:, :1]).expand_as(e_ids))
    return out_idx, out_w
