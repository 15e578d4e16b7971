"""The Samoyeds MoE layer: routing, two grouped sparse-sparse matmuls with
fused epilogues, and a deterministic combine (DESIGN.md's forward contract)."""
from __future__ import annotations

from typing import Any, Optional

from ._array import for_c
from .ops import combine, gather_weights, route, ssmm
from .packed import PackedWeight


def moe_forward(x: Any, top_k_index: Any, top_k_weights: Any, gate_up: PackedWeight, down: PackedWeight,
                *, act: str = "swiglu", gate_up_bias: Optional[Any] = None, down_bias: Optional[Any] = None,
                alpha: float = 1.702, limit: float = 7.0, impl: str = "auto",
                out: Optional[Any] = None) -> Any:
    """Mixture-of-experts feed-forward with packed expert weights.

    Args:
        x: ``[T, H]`` hidden states (bf16/fp16 on the GPU; also fp32 on the CPU).
        top_k_index: ``[T, K]`` int32/int64 expert ids; ids outside ``[0, E)`` are
            expert-parallel placeholders and contribute nothing.
        top_k_weights: ``[T, K]`` routing weights (any float dtype; fp32 is fine).
        gate_up: packed ``[E, 2I, H]`` with ``glu=True`` (gate rows, then up rows).
        down: packed ``[E, H, I]``.
        act: gated activation of the gate_up epilogue (``"swiglu"`` or ``"gptoss"``).
        gate_up_bias, down_bias: optional ``[E, 2I]`` / ``[E, H]`` biases.
    Returns:
        ``[T, H]`` in x's dtype: ``sum_k w[t,k] * down_e(act(gate_up_e(x[t])))``.

    No host synchronisation; deterministic (the combine adds in a fixed order).
    """
    for name, pw in (("gate_up", gate_up), ("down", down)):
        if not isinstance(pw, PackedWeight):
            raise TypeError(f"{name}: expected a PackedWeight, got {type(pw).__name__}")
    if not gate_up.glu:
        raise ValueError("gate_up: expected a weight packed with glu=True (gate rows, then up rows)")
    E = gate_up.num_experts
    if down.num_experts != E:
        raise ValueError(f"down: expected {E} experts (gate_up's), got {down.num_experts}")
    if down.cols != gate_up.rows // 2 or down.rows != gate_up.cols:
        raise ValueError(f"down: expected shape [E, {gate_up.cols}, {gate_up.rows // 2}] to match gate_up "
                         f"{list(gate_up.shape3)}, got {list(down.shape3)}")
    x = for_c(x)
    routing = route(top_k_index, E)
    scale = gather_weights(top_k_weights, routing)
    h = ssmm(x, gate_up, routing.offsets, routing.token_ids, act=act, bias=gate_up_bias, alpha=alpha,
             limit=limit, impl=impl, check=False)   # the routing is valid by construction
    y = ssmm(h, down, routing.offsets, None, bias=down_bias, scale=scale, impl=impl, check=False)
    return combine(y, routing.pos, out=out)
