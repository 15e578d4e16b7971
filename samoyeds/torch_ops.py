"""The Samoyeds MoE forward as a torch custom op, ``torch.ops.samoyeds.moe_forward``, and
a dense gated MLP at decode sizes, ``torch.ops.samoyeds.shared_mlp``.

``torch.compile`` treats the op as one opaque node (no graph break, no tracing
into the C extension): the fake implementation gives the output's shape and
dtype, ``[T, H]`` in x's dtype, from the inputs alone.  The op takes the packed
arrays of both weights as plain tensors, so a module can hold them as buffers
(they move with ``.to(device)`` and appear in ``state_dict``).

The ops are inference only: a forward on inputs that require grad warns once that
the result will carry no usable gradient, and a backward through them raises a
samoyeds error (the packed weights are frozen and no gradient with respect to the
activations is implemented yet).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from . import moe as _moe
from ._array import check_ndim, check_shape, warn_no_backward
from .ops import ACTS, dense_decode, glu
from .packed import PackedWeight

__all__ = ["ACT_IDS", "act_id", "moe_forward", "moe_forward_eager", "moe_forward_packed", "shared_mlp",
           "shared_mlp_eager"]

#: The activation names of :func:`samoyeds.moe.moe_forward` and the int the op takes.
ACT_IDS = {"swiglu": ACTS["swiglu"], "gptoss": ACTS["gptoss"]}


def act_id(act: str) -> int:
    """The op's ``act`` int for an activation name (``"swiglu"`` or ``"gptoss"``)."""
    if act not in ACT_IDS:
        raise ValueError(f"act: expected one of {sorted(ACT_IDS)}, got {act!r}")
    return ACT_IDS[act]


@torch.library.custom_op("samoyeds::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_values: torch.Tensor, gate_up_meta: torch.Tensor, gate_up_idx: Optional[torch.Tensor],
                gate_up_rows: int, gate_up_cols: int,
                down_values: torch.Tensor, down_meta: torch.Tensor, down_idx: Optional[torch.Tensor],
                down_rows: int, down_cols: int,
                n: int, m: int, v: int, act: int,
                gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """MoE feed-forward with packed expert weights (see :func:`samoyeds.moe.moe_forward`).

    Args:
        x: ``[T, H]`` hidden states (fp32/bf16/fp16 on the CPU; bf16/fp16 on CUDA).
        top_k_index: ``[T, K]`` int32/int64 expert ids; ids outside ``[0, E)`` add nothing.
        top_k_weights: ``[T, K]`` routing weights (any float dtype).
        gate_up_values, gate_up_meta, gate_up_idx: the arrays of a ``[E, 2I, H]``
            weight packed with ``glu=True`` (``gate_up_idx`` None for plain 2:4).
        gate_up_rows, gate_up_cols: its logical rows and columns, ``2I`` and ``H``.
        down_values, down_meta, down_idx: the arrays of a packed ``[E, H, I]`` weight.
        down_rows, down_cols: its logical rows and columns, ``H`` and ``I``.
        n, m, v: the format of both weights (``v`` 0 for plain 2:4).
        act: :data:`ACT_IDS` value (1 SwiGLU, 2 GPT-OSS clamped gate).
        gate_up_bias, down_bias: optional ``[E, 2I]`` (gate then up) and ``[E, H]``.
        alpha, limit: GPT-OSS activation constants (ignored by SwiGLU).
    Returns:
        A new ``[T, H]`` tensor in x's dtype.
    """
    return moe_forward_eager(x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx, gate_up_rows,
                             gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols, n, m, v, act,
                             gate_up_bias, down_bias, alpha, limit)


def moe_forward_eager(x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx, gate_up_rows,
                      gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols, n, m, v, act,
                      gate_up_bias=None, down_bias=None, alpha=1.702, limit=7.0) -> torch.Tensor:
    """The body of the op, callable without the dispatcher: same arguments and result as
    :func:`moe_forward`.  Eager inference calls it directly (the custom-op layers cost
    more host time per call than the whole MoE kernel sequence at decode sizes);
    ``torch.compile`` and autograd go through the op."""
    # the logical shapes (the extension sees only the padded packed arrays; it checks the rest)
    check_ndim(x, "x", 2)
    check_shape(x, "x", (x.shape[0], gate_up_cols))
    if (down_rows, down_cols) != (gate_up_cols, gate_up_rows // 2) or gate_up_rows % 2:
        raise ValueError(f"down_rows, down_cols: expected {(gate_up_cols, gate_up_rows // 2)} (gate_up's H and I), "
                         f"got {(down_rows, down_cols)}")
    return _moe.forward_arrays(x.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous(),
                               gate_up_values, gate_up_meta, gate_up_idx, down_values, down_meta, down_idx,
                               down_cols, n, m, v, act, gate_up_bias, down_bias, alpha, limit)


@moe_forward.register_fake
def _moe_forward_fake(x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx,
                      gate_up_rows, gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols,
                      n, m, v, act, gate_up_bias=None, down_bias=None, alpha=1.702, limit=7.0):
    torch._check(x.dim() == 2, lambda: f"x: expected a 2-d tensor, got {x.dim()}-d with shape {tuple(x.shape)}")
    torch._check(x.shape[1] == gate_up_cols,
                 lambda: f"x: expected shape {(x.shape[0], gate_up_cols)}, got {tuple(x.shape)}")
    torch._check(top_k_index.dim() == 2, lambda: f"top_k_index: expected a 2-d tensor, got {top_k_index.dim()}-d "
                 f"with shape {tuple(top_k_index.shape)}")
    torch._check(top_k_weights.shape == top_k_index.shape,
                 lambda: f"top_k_weights: expected shape {tuple(top_k_index.shape)}, got {tuple(top_k_weights.shape)}")
    return x.new_empty(x.shape)


def _no_backward_setup(ctx, inputs, output) -> None:
    warn_no_backward()  # (torch calls this only when an input requires grad, with grad enabled)


def _no_backward(name: str):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"samoyeds.{name} has no backward (autograd formula) yet: samoyeds is inference only. Run the "
            "forward under torch.no_grad(), or train on the dense model (samoyeds.unpatch_model(model) or "
            "samoyeds.to_dense)")
    return backward


moe_forward.register_autograd(_no_backward("moe_forward"), setup_context=_no_backward_setup)


def moe_forward_packed(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up: PackedWeight, down: PackedWeight, *, act: str = "swiglu",
                       gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                       alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """:func:`samoyeds.moe.moe_forward` through the custom op (compilable).

    Same arguments and result as :func:`samoyeds.moe.moe_forward`: ``x [T, H]``,
    ``top_k_index``/``top_k_weights [T, K]``, packed ``gate_up [E, 2I, H]``
    (``glu=True``) and ``down [E, H, I]`` in one format; returns ``[T, H]`` in x's dtype.
    """
    if gate_up.fmt != down.fmt:
        raise ValueError(f"down: expected the format of gate_up ({gate_up.fmt.name}), got {down.fmt.name}")
    if not gate_up.glu:
        raise ValueError("gate_up: expected a weight packed with glu=True (gate rows, then up rows)")
    n, m, v = gate_up.fmt.c_args()
    _, gr, gc = gate_up.shape3
    _, dr, dc = down.shape3
    return torch.ops.samoyeds.moe_forward(
        x, top_k_index, top_k_weights,
        gate_up.values, gate_up.meta, gate_up.idx, gr, gc,
        down.values, down.meta, down.idx, dr, dc,
        n, m, v, act_id(act), gate_up_bias, down_bias, float(alpha), float(limit))


@torch.library.custom_op("samoyeds::shared_mlp", mutates_args=())
def shared_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with dense bias-free weights ``gate, up [I, H]``,
    ``down [H, I]`` (an unpruned shared-experts MLP): on the GPU, where the kernels take
    the tensors, two :func:`samoyeds.dense_decode` launches up to 32 token rows (gate, up and
    SiLU fused into the first), above that the three matmuls with SiLU-times-up as one
    :func:`samoyeds.glu` pass; otherwise the same three matmuls in torch.  Inference only (no backward).
    Returns ``[..., H]`` in x's dtype."""
    return shared_mlp_eager(x, gate, up, down)


def _dense_decode_takes(x2: torch.Tensor, ws) -> bool:
    """Whether samoyeds.dense_decode takes x2 and the weights as they are (GPU, bf16/fp16,
    one dtype and device, contiguous 16-byte aligned weight rows of a multiple of 8)."""
    if not x2.is_cuda or x2.dtype not in (torch.bfloat16, torch.float16):
        return False
    return all(w.dtype == x2.dtype and w.device == x2.device and w.is_contiguous() and w.shape[-1] % 8 == 0
               and w.data_ptr() % 16 == 0 for w in ws)


def shared_mlp_eager(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                     decode_rows: int = 32) -> torch.Tensor:
    """The body of :func:`shared_mlp`, callable without the dispatcher (eager inference):
    up to ``decode_rows`` token rows two dense_decode launches; above, the three matmuls in
    torch with SiLU and the product in one :func:`samoyeds.glu` pass."""
    check_ndim(gate, "gate", 2)  # (the torch path needs them as much as the kernels)
    I, H = gate.shape
    check_shape(x, "x", tuple(x.shape[:-1]) + (H,))
    check_shape(up, "up", (I, H))
    check_shape(down, "down", (H, I))
    x2 = x.reshape(-1, H)
    if not _dense_decode_takes(x2, (gate, up, down)):
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    if x2.shape[0] > decode_rows:
        return F.linear(glu(F.linear(x2, gate), F.linear(x2, up)), down).reshape(x.shape)
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or (x2.shape[0] > 1 and x2.stride(0) % 8):
        x2 = x2.contiguous()
    h = dense_decode(x2, gate, up, act="swiglu")
    # the kernel just before is the gate/up one, which writes neither weight
    return dense_decode(h, down, weights_ready=True).reshape(x.shape)


shared_mlp.register_autograd(_no_backward("shared_mlp"), setup_context=_no_backward_setup)


@shared_mlp.register_fake
def _shared_mlp_fake(x, gate, up, down):
    torch._check(x.shape[-1] == gate.shape[1], lambda: f"x: expected {gate.shape[1]} columns, got {x.shape[-1]}")
    return x.new_empty(x.shape)
