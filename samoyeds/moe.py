"""The Samoyeds MoE layer: routing, two grouped sparse-sparse matmuls with
fused epilogues, and a deterministic combine (DESIGN.md's forward contract)."""
from __future__ import annotations

import math
from typing import Any, Optional, Union

from . import _C
from ._array import check_ndim, check_shape, current_stream, dtype_name, empty, for_c, tensor_arg
from .ops import ACTS, IMPLS
from .packed import PackedWeight


def moe_forward(x: Any, top_k_index: Any, top_k_weights: Any, gate_up: PackedWeight, down: PackedWeight,
                *, act: str = "swiglu", gate_up_bias: Optional[Any] = None, down_bias: Optional[Any] = None,
                alpha: float = 1.702, limit: float = 7.0, impl: str = "auto",
                out: Optional[Any] = None, check_ids: bool = False, save_preact: Optional[Union[bool, str]] = None) -> Any:
    """Mixture-of-experts feed-forward with packed expert weights.

    Args:
        x: ``[T, H]`` hidden states (bf16/fp16 on the GPU; also fp32 on the CPU).
        top_k_index: ``[T, K]`` int32/int64 expert ids; ids outside ``[0, E)`` are
            expert-parallel placeholders and contribute nothing (transformers' expert
            parallelism writes ``E`` for the experts of other ranks).
        top_k_weights: ``[T, K]`` routing weights (any float dtype; fp32 is fine).
        gate_up: packed ``[E, 2I, H]`` with ``glu=True`` (gate rows, then up rows).
        down: packed ``[E, H, I]``.
        act: gated activation of the gate_up epilogue (``"swiglu"`` or ``"gptoss"``).
        gate_up_bias, down_bias: optional ``[E, 2I]`` / ``[E, H]`` biases.
        check_ids: raise a ValueError when an id is outside ``[0, E]`` (``E``, the
            placeholder, allowed): a debugging aid for routing bugs (an off-by-one id
            otherwise drops that expert's share without a word).  It reads the ids
            back, one host sync per call; off by default.
        save_preact: with grad, keep the gate_up pre-activation ``[T*K, 2I]`` for the
            backward (True), only its gate half (``"gate"``: the backward recomputes the up
            half with half a gate_up matmul; eager mode), or keep only x and the routing and
            recompute it there with one more gate_up matmul (False: less activation memory,
            more time); None takes ``samoyeds.config``'s ``save_preact`` (True unless changed).
    Returns:
        ``[T, H]`` in x's dtype: ``sum_k w[t,k] * down_e(act(gate_up_e(x[t])))``.

    The steps of :func:`samoyeds.route`, :func:`samoyeds.gather_weights`, two
    :func:`samoyeds.ssmm` and :func:`samoyeds.combine`, in one call into the
    extension.  No host synchronisation (unless ``check_ids``); deterministic (the
    combine adds in a fixed order).

    Differentiable with torch tensors: when grad is enabled and ``x``, ``top_k_weights``,
    either weight's ``values`` (e.g. an ``nn.Parameter``) or a bias requires grad, the call
    goes through ``torch.ops.samoyeds.moe_forward_train`` (docs/TRAINING.md; ``impl`` is
    then the automatic choice, and ``out`` is not taken).
    """
    for name, pw in (("gate_up", gate_up), ("down", down)):
        if not isinstance(pw, PackedWeight):
            raise TypeError(f"{name}: expected a PackedWeight, got {type(pw).__name__}")
    if save_preact is not None and not isinstance(save_preact, bool) and save_preact != "gate":
        raise TypeError(f"save_preact: expected None, a bool or 'gate', got {save_preact!r}")
    if not gate_up.glu:
        raise ValueError("gate_up: expected a weight packed with glu=True (gate rows, then up rows)")
    # the logical shapes and the format: the extension sees only the padded packed arrays
    E, I2, H = gate_up.shape3
    if down.shape3 != (E, H, I2 // 2):
        raise ValueError(f"down: expected shape {(E, H, I2 // 2)} (gate_up's E, H and I), got {down.shape3}")
    if down.fmt != gate_up.fmt:
        raise ValueError(f"down: expected the format of gate_up ({gate_up.fmt.name}), got {down.fmt.name}")
    if _torch_needs_grad(x, top_k_weights, gate_up.values, down.values, gate_up_bias, down_bias):
        if out is not None:
            raise ValueError("out: expected None when an input requires grad (the differentiable forward "
                             "allocates its result); run under torch.no_grad() to write into out")
        if impl not in IMPLS:
            raise ValueError(f"impl: expected one of {sorted(IMPLS)}, got {impl!r}")
        if check_ids:
            check_expert_ids(tensor_arg(top_k_index, "top_k_index"), E)
        from .torch_ops import moe_forward_packed
        return moe_forward_packed(x, top_k_index, top_k_weights, gate_up, down, act=act, gate_up_bias=gate_up_bias,
                                  down_bias=down_bias, alpha=alpha, limit=limit, save_preact=save_preact)
    x = tensor_arg(x, "x")
    check_ndim(x, "x", 2)
    check_shape(x, "x", (x.shape[0], H))
    n, m, v = gate_up.fmt.c_args()
    if not ACTS.get(act):  # the gated activations (not "none")
        raise ValueError(f"act: expected one of {sorted(k for k, v in ACTS.items() if v)}, got {act!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {sorted(IMPLS)}, got {impl!r}")
    if check_ids:
        check_expert_ids(tensor_arg(top_k_index, "top_k_index"), E)
    return forward_arrays(x, top_k_index, top_k_weights, gate_up.values, gate_up.meta, gate_up.idx,
                          down.values, down.meta, down.idx, down.cols, n, m, v, ACTS[act],
                          gate_up_bias, down_bias, alpha, limit, IMPLS[impl], out)


def _torch_needs_grad(*tensors: Any) -> bool:
    """torch with grad enabled and a tensor among these that requires grad."""
    if not any(getattr(t, "requires_grad", False) for t in tensors):
        return False
    import torch
    return torch.is_grad_enabled()


def forward_arrays(x: Any, top_k_index: Any, top_k_weights: Any, gate_up_values: Any, gate_up_meta: Any,
                   gate_up_idx: Optional[Any], down_values: Any, down_meta: Any, down_idx: Optional[Any],
                   intermediate: int, n: int, m: int, v: int, act: int, gate_up_bias: Optional[Any] = None,
                   down_bias: Optional[Any] = None, alpha: float = 1.702, limit: float = 7.0, impl: int = 0,
                   out: Optional[Any] = None) -> Any:
    """:func:`moe_forward` on the packed arrays themselves (what a patched model holds):
    one workspace for the routing and both matmuls' outputs, and one call into the
    extension, which checks every argument and launches the five steps.

    ``intermediate`` is ``I`` (down's columns); ``n, m, v`` the format of both weights
    (``v`` 0 for plain 2:4); ``act`` 1 (SwiGLU) or 2 (GPT-OSS); ``impl`` an
    :data:`samoyeds.ops.IMPLS` value.
    """
    x = tensor_arg(x, "x")
    top_k_index = tensor_arg(top_k_index, "top_k_index")
    gate_up_values = tensor_arg(gate_up_values, "gate_up_values")
    check_ndim(x, "x", 2)  # (the workspace's size needs T, H and K; the extension checks the rest)
    check_ndim(top_k_index, "top_k_index", 2)
    check_ndim(gate_up_values, "gate_up_values", 3)
    T, H = x.shape
    K = top_k_index.shape[1]
    # (the extension checks the layout before this count: a [T, 1] slice would be called non-contiguous)
    if top_k_weights is not None and hasattr(top_k_weights, "shape") and math.prod(top_k_weights.shape) != T * K:
        raise ValueError(f"top_k_weights: expected {T * K} entries (top_k_index's T*K), got shape "
                         f"{tuple(top_k_weights.shape)}")
    # x of a dtype the kernels do not take: the extension names it (against gate_up_values'
    # dtype) before it reads the workspace or the output
    takes = dtype_name(x) in ("float32", "float16", "bfloat16")
    nbytes = _C.moe_workspace_bytes(T, K, gate_up_values.shape[0], H, intermediate, x.dtype.itemsize) \
        if takes else 0
    workspace = empty(x, (nbytes,), "uint8")
    if out is None:
        out = empty(x, (T, H), dtype_name(x) if takes else dtype_name(gate_up_values))
    _C.moe_forward(out, workspace, x, top_k_index, for_c(top_k_weights), gate_up_values, gate_up_meta,
                   gate_up_idx, down_values, down_meta, down_idx, intermediate, n, m, v, act,
                   for_c(gate_up_bias), for_c(down_bias), alpha, limit, impl, current_stream(x))
    return out


def check_expert_ids(top_k_index: Any, num_experts: int) -> None:
    """A ValueError when an id of ``top_k_index`` is outside ``[0, E]`` (``E`` is the
    expert-parallel placeholder): what ``check_ids=True`` runs.  One host sync."""
    if math.prod(top_k_index.shape) == 0:
        return
    bad = (top_k_index < 0) | (top_k_index > num_experts)
    count = int(bad.sum())
    if count:
        lo, hi = int(top_k_index.min()), int(top_k_index.max())
        raise ValueError(f"top_k_index: expected expert ids in [0, {num_experts}) or the placeholder {num_experts} "
                         f"(check_ids=True), got {count} outside, ids from {lo} to {hi}")
