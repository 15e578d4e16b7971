"""Llama 4: its MoE block, patched.

Llama 4's experts are not dispatched through ``ExpertsInterface``: its ``Llama4TextMoe``
scales the expert *inputs* by the sigmoid router score and runs every expert on every
token.  The patched block (``SamoyedsLlama4<...>``, a swapped class: swap.py) gathers the
scaled rows ``x[t] * score[t, k]`` of the top-k experts (``[T*K, H]``), runs them as
``T*K`` tokens with one expert each and routing weight 1, and sums the ``K`` rows of each
token: the same result without the dense all-experts matmul.  Its shared expert may run
on a second stream (streams.py), marked in this forward.
"""
from __future__ import annotations

import torch
from torch import nn

from . import streams
from .experts import run_experts
from .swap import swapped_class

LLAMA4_PREFIX = "SamoyedsLlama4<"


def _forward(self: nn.Module, hidden_states: torch.Tensor):
    """Llama4TextMoe.forward with the routed experts in the Samoyeds format.

    The router's dense ``[T, E]`` scores are sigmoid(top-k logit) on the chosen
    experts and 0 elsewhere; every expert input is scaled by its score.  Here
    the ``T*K`` scaled rows of the chosen experts run as single-expert tokens
    with weight 1 and each token's ``K`` outputs are summed.
    """
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    marked = streams.block_start(self, hidden_states)   # the shared expert beside the routed ones
    try:
        router_scores, router_logits = self.router(hidden_states)
        top_k_index = torch.topk(router_logits, self.router.top_k, dim=1).indices   # the router's own choice
        scores = router_scores.gather(1, top_k_index)                                 # [T, K]
        T, K = top_k_index.shape
        routed_in = (hidden_states[:, None, :] * scores[:, :, None]).reshape(T * K, self.hidden_dim)
        ones = torch.ones(T * K, 1, dtype=torch.float32, device=hidden_states.device)
        routed_out = run_experts(self.experts, routed_in, top_k_index.reshape(T * K, 1), ones)
        out = self.shared_expert(hidden_states)
    finally:
        streams.block_end(marked)
    out.add_(routed_out.view(T, K, -1).sum(dim=1))
    return out, router_logits


def patched_class(base: type) -> type:
    """The class a patched ``Llama4TextMoe`` (``base``) takes."""
    return swapped_class(LLAMA4_PREFIX, base, {"forward": _forward, "_samoyeds_llama4": True},
                         "whose routed experts run in the Samoyeds format.",
                         instance_attrs=(streams.MIN_ROWS_ATTR,))
