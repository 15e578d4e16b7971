"""The Samoyeds MoE forward as a torch custom op, ``torch.ops.samoyeds.moe_forward``, and
a dense gated MLP at decode sizes, ``torch.ops.samoyeds.shared_mlp``.

``torch.compile`` treats the op as one opaque node (no graph break, no tracing
into the C extension): the fake implementation gives the output's shape and
dtype, ``[T, H]`` in x's dtype, from the inputs alone.  The op takes the packed
arrays of both weights as plain tensors, so a module can hold them as buffers
(they move with ``.to(device)`` and appear in ``state_dict``).

``moe_forward`` is differentiable (docs/TRAINING.md): its backward, the op
``torch.ops.samoyeds.moe_backward``, gives the gradients of x, the routing weights, both
weights' packed values (their layout; values may be ``nn.Parameter``) and the biases,
recomputing the gate_up pre-activation.  ``torch.ops.samoyeds.moe_forward_train`` returns
that pre-activation as a second output and saves it, so its backward skips the
recompute; :func:`moe_forward_packed` picks it when an input requires grad.
``shared_mlp``'s backward is dense torch (its weights are not packed).
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional, Tuple

import torch
from torch.nn import functional as F

from . import _C, _config
from . import moe as _moe
from ._array import check_ndim, check_shape
from .ops import ACTS, dense_decode, glu, glu_backward
from .format import SparseFormat
from .ops import combine, dy_t_shape, gather_weights, route, ssmm, ssmm_dw, ssmm_dw_takes_dy_t, ssmm_dx
from .ops import ssmm_dx_supported
from .packed import PackedWeight

__all__ = ["ACT_IDS", "act_id", "moe_backward", "moe_forward", "moe_forward_autograd", "moe_forward_eager",
           "moe_forward_packed", "moe_forward_train", "moe_forward_train_eager", "shared_mlp", "shared_mlp_eager"]

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


# --- training: the forward that keeps the pre-activation, and the backward ----------------------------------

_ACT_NAMES = {ACT_IDS["swiglu"]: "swiglu", ACT_IDS["gptoss"]: "gptoss"}

#: Bits of moe_backward's ``needs``: which gradients to compute.
NEED_X, NEED_WEIGHTS, NEED_GATE_UP, NEED_DOWN, NEED_GATE_UP_BIAS, NEED_DOWN_BIAS = (1 << i for i in range(6))


def _packed_pair(gate_up_values, gate_up_meta, gate_up_idx, gate_up_rows, gate_up_cols, down_values, down_meta,
                 down_idx, down_rows, down_cols, n, m, v):
    """The two PackedWeights of the op's arrays (values detached: the ops read them)."""
    fmt = SparseFormat(n, m, v if n < m else None)
    E = gate_up_values.shape[0]
    gu = PackedWeight(gate_up_values.detach(), gate_up_meta, gate_up_idx, fmt, (E, gate_up_rows, gate_up_cols), True)
    dn = PackedWeight(down_values.detach(), down_meta, down_idx, fmt, (E, down_rows, down_cols), False)
    return gu, dn


def _check_logical(x, gate_up_rows, gate_up_cols, down_rows, down_cols) -> None:
    check_ndim(x, "x", 2)
    check_shape(x, "x", (x.shape[0], gate_up_cols))
    if (down_rows, down_cols) != (gate_up_cols, gate_up_rows // 2) or gate_up_rows % 2:
        raise ValueError(f"down_rows, down_cols: expected {(gate_up_cols, gate_up_rows // 2)} (gate_up's H and I), "
                         f"got {(down_rows, down_cols)}")


def _opt(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach()


@torch.library.custom_op("samoyeds::moe_forward_train", mutates_args=())
def moe_forward_train(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up_values: torch.Tensor, gate_up_meta: torch.Tensor, gate_up_idx: Optional[torch.Tensor],
                      gate_up_rows: int, gate_up_cols: int,
                      down_values: torch.Tensor, down_meta: torch.Tensor, down_idx: Optional[torch.Tensor],
                      down_rows: int, down_cols: int,
                      n: int, m: int, v: int, act: int,
                      gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                      alpha: float = 1.702, limit: float = 7.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_forward` that also returns the gate_up pre-activation ``[T*K, 2I]`` (x's
    dtype; sorted rows, gate columns then up columns, bias included) and saves it for the
    backward.  Steps: route, ssmm (gate_up, no activation), :func:`samoyeds.glu`, ssmm
    (down, bias, routing weights), combine.  The output equals :func:`moe_forward`'s up to
    the rounding of the pre-activation before the activation (moe_forward applies it to
    the fp32 sums)."""
    return moe_forward_train_eager(x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx,
                                   gate_up_rows, gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols,
                                   n, m, v, act, gate_up_bias, down_bias, alpha, limit)


def moe_forward_train_eager(x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx, gate_up_rows,
                            gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols, n, m, v, act,
                            gate_up_bias=None, down_bias=None, alpha=1.702, limit=7.0):
    """The body of :func:`moe_forward_train` (no autograd)."""
    _check_logical(x, gate_up_rows, gate_up_cols, down_rows, down_cols)
    act_name = _ACT_NAMES.get(act)
    if act_name is None:
        raise ValueError(f"act: expected 1 (swiglu) or 2 (gptoss), got {act}")
    gu, dn = _packed_pair(gate_up_values, gate_up_meta, gate_up_idx, gate_up_rows, gate_up_cols, down_values,
                          down_meta, down_idx, down_rows, down_cols, n, m, v)
    x = x.detach()
    check_ndim(top_k_index, "top_k_index", 2)
    T, H = x.shape
    K = top_k_index.shape[1]
    if T * K == 0:
        return x.new_zeros((T, H)), x.new_zeros((T * K, gate_up_rows))
    r = _route(top_k_index, gu.num_experts, remember=True)
    ws = gather_weights(top_k_weights.detach().contiguous(), r)
    h, preact = _gate_up(x, gu, r, gate_up_bias, act_name, alpha, limit)
    y = ssmm(h, dn, r.offsets, None, bias=_opt(down_bias), scale=ws, check=False)  # (route made the routing)
    return combine(y, r.pos, dtype=_dtype_name(x.dtype)), preact


_ROUTES = None   # torch.utils.weak.WeakIdKeyDictionary: top_k_index -> (its _version, E, Routing)


def _route(top_k_index: torch.Tensor, E: int, remember: bool = False):
    """``route(top_k_index, E)``, made once per training step: the training forward
    (``remember``) keeps the routing with the ``top_k_index`` tensor, weakly (it goes with
    the tensor) and only while the tensor is unchanged (its version counter), and the
    backward, which gets the same tensor back from autograd, takes it from there instead of
    routing again."""
    global _ROUTES
    if _ROUTES is None:
        from torch.utils.weak import WeakIdKeyDictionary
        _ROUTES = WeakIdKeyDictionary()
    hit = _ROUTES.get(top_k_index)
    if hit is not None and hit[0] == top_k_index._version and hit[1] == E:
        return hit[2]
    r = route(top_k_index.contiguous(), E)
    if remember:
        _ROUTES[top_k_index] = (top_k_index._version, E, r)
    return r


def _gate_up(x: torch.Tensor, gu: PackedWeight, r, gate_up_bias: Optional[torch.Tensor], act_name: str,
             alpha: float, limit: float, zero_h: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """One gate_up ssmm for the sorted rows: ``h = act(x[tok(s)] @ W_gu,e^T + b)``
    ``[T*K, I]`` and the pre-activation ``[T*K, 2I]`` (gate columns, then up columns), both
    in x's dtype, written by the same kernel; rows past offsets[E] (placeholder ids): 0 in
    the pre-activation, in h 0 with ``zero_h``, else not written (the down projection reads
    only the routed rows)."""
    S = r.token_ids.shape[0]
    preact = x.new_empty((S, gu.rows))
    h = x.new_empty((S, gu.rows // 2))
    ssmm(x, gu, r.offsets, r.token_ids, h, act=act_name, bias=_opt(gate_up_bias), alpha=alpha, limit=limit,
         check=False, preact=preact)  # (route made the routing)
    _zero_unrouted(preact, r.offsets)
    if zero_h:
        _zero_unrouted(h, r.offsets)
    return h, preact


def _full_preact(x: torch.Tensor, gate: torch.Tensor, gu: PackedWeight, r, gate_up_bias: Optional[torch.Tensor]
                 ) -> torch.Tensor:
    """The pre-activation ``[S, 2I]`` from its saved gate half ``[S, I]`` (save_preact="gate"):
    the gate columns copied, the up columns recomputed by one ssmm on the up rows alone
    (:meth:`PackedWeight.up_half`) into them, in the forward's arithmetic (fp32 sums of the same
    products, plus the up half's bias, one rounding); rows past offsets[E] 0."""
    S, I = gate.shape
    full = x.new_empty((S, 2 * I))
    full[:, :I].copy_(gate)
    bias = None if gate_up_bias is None else gate_up_bias.detach()[:, I:].contiguous()
    ssmm(x, gu.up_half(), r.offsets, r.token_ids, full[:, I:], bias=bias, check=False)
    _zero_unrouted(full, r.offsets)
    return full


def _zero_unrouted(out: torch.Tensor, offsets: torch.Tensor) -> None:
    """Rows of ``out`` from ``offsets[E]`` on (no routed pair) set to 0, on the device, without
    a host sync: what the kernels leave unwritten (a fill of the whole tensor first had cost a
    pass over it, about 3 % of a training step at T = 4096)."""
    _C.moe_zero_unrouted(out, offsets)   # (on torch's current stream)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


@moe_forward_train.register_fake
def _moe_forward_train_fake(x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx,
                            gate_up_rows, gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols,
                            n, m, v, act, gate_up_bias=None, down_bias=None, alpha=1.702, limit=7.0):
    out = _moe_forward_fake(x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx, gate_up_rows,
                            gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols, n, m, v, act,
                            gate_up_bias, down_bias, alpha, limit)
    return out, x.new_empty((top_k_index.shape[0] * top_k_index.shape[1], gate_up_rows))


@torch.library.custom_op("samoyeds::moe_backward", mutates_args=())
def moe_backward(grad_out: Optional[torch.Tensor], x: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor,
                 gate_up_values: torch.Tensor, gate_up_meta: torch.Tensor, gate_up_idx: Optional[torch.Tensor],
                 gate_up_rows: int, gate_up_cols: int,
                 down_values: torch.Tensor, down_meta: torch.Tensor, down_idx: Optional[torch.Tensor],
                 down_rows: int, down_cols: int,
                 n: int, m: int, v: int, act: int,
                 gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                 alpha: float, limit: float, preact: Optional[torch.Tensor], grad_preact: Optional[torch.Tensor],
                 needs: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor]:
    """The backward of :func:`moe_forward` (and :func:`moe_forward_train`).

    ``grad_out [T, H]`` (None: zeros), the forward's inputs, ``preact`` (the saved
    pre-activation, or None to recompute it with one gate_up ssmm), ``grad_preact`` (a
    gradient of moe_forward_train's second output, or None) and ``needs``, a bit set of
    :data:`NEED_X` ... :data:`NEED_DOWN_BIAS`.  Returns ``(dx, dweights, dgate_up_values,
    ddown_values, dgate_up_bias, ddown_bias)``, each shaped and typed like its input, an
    empty tensor where the bit is clear (or the bias absent).  Gradients of the values are
    in their packed layout (0 on padding)."""
    return moe_backward_eager(grad_out, x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx,
                              gate_up_rows, gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols,
                              n, m, v, act, gate_up_bias, down_bias, alpha, limit, preact, grad_preact, needs)


def _grad_shapes(x, top_k_weights, gate_up_values, down_values, gate_up_bias, down_bias, needs):
    """(shape, dtype) of moe_backward's six results."""
    want = [(x, NEED_X), (top_k_weights, NEED_WEIGHTS), (gate_up_values, NEED_GATE_UP), (down_values, NEED_DOWN),
            (gate_up_bias, NEED_GATE_UP_BIAS), (down_bias, NEED_DOWN_BIAS)]
    return [(tuple(t.shape), t.dtype) if t is not None and needs & bit else ((0,), x.dtype if t is None else t.dtype)
            for t, bit in want]


@moe_backward.register_fake
def _moe_backward_fake(grad_out, x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx,
                       gate_up_rows, gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols, n, m, v,
                       act, gate_up_bias, down_bias, alpha, limit, preact, grad_preact, needs):
    return tuple(x.new_empty(shape, dtype=dt)
                 for shape, dt in _grad_shapes(x, top_k_weights, gate_up_values, down_values, gate_up_bias,
                                               down_bias, needs))


def _glu_backward(dh: torch.Tensor, preact: torch.Tensor, act: int, alpha: float, limit: float) -> torch.Tensor:
    """d preact [S, 2I] (fp32) from d act [S, I] (fp32) and preact, for the activations of
    csrc/sam_ref.h (sam_act_glu).  GPT-OSS's clamps pass the gradient where the input is
    inside [-limit, limit] (the gate: up to limit), both ends included, as torch's clamp."""
    I = preact.shape[1] // 2
    g, u = preact[:, :I].float(), preact[:, I:].float()
    if act == ACT_IDS["swiglu"]:
        sg = torch.sigmoid(g)
        silu = g * sg
        dg = dh * u * (sg * (1.0 + g * (1.0 - sg)))
        du = dh * silu
    else:
        gc = torch.clamp(g, max=limit)
        uc = torch.clamp(u, min=-limit, max=limit)
        sg = torch.sigmoid(alpha * gc)
        glu_ = gc * sg
        dg = torch.where(g <= limit, dh * (uc + 1.0) * (sg + alpha * gc * sg * (1.0 - sg)), 0.0)
        du = torch.where((u >= -limit) & (u <= limit), dh * glu_, 0.0)
    return torch.cat((dg, du), dim=1)


def _segment_sum(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[E, N] fp32: the sum of rows [offsets[e], offsets[e+1]) of ``rows [S, N]`` for every
    expert (rows past offsets[E], placeholders, form one more segment that is dropped).
    A segmented reduction, no atomics: deterministic."""
    S = rows.shape[0]
    ext = torch.cat((offsets.to(torch.int64), offsets.new_full((1,), S, dtype=torch.int64)))
    return torch.segment_reduce(rows.float(), "sum", offsets=ext, axis=0)[:-1]


#: How :func:`_matmul_w` multiplies by a packed weight (dX): ``"auto"`` (the default: on the GPU
#: the transposed packing where the format has one, else :func:`samoyeds.ops.ssmm_dx`; on the
#: CPU ssmm_dx), ``"ssmm_dx"`` (the forward's packing itself, no transposed copy, wherever its
#: kernel runs) or ``"transposed"`` (:func:`samoyeds.ssmm` on :meth:`PackedWeight.transposed`,
#: cached and refreshed after every optimizer step).  On an H200 at T = 16384 the transposed
#: path, refresh included, took 13.0 / 2.5 ms per layer (Mixtral-8x7B / Qwen3-30B-A3B) where
#: ssmm_dx's sm_90a wgmma kernel took 16.6 / 2.9 with its copy of dy (its mma.sync kernel:
#: 53.8 / 6.6; docs/KERNELS.md, "The wgmma kernel").
DX_PATHS = ("auto", "ssmm_dx", "transposed")

#: Who makes the gate_up weight gradient's transposed copy of d(pre-activation) on the GPU:
#: ``"ssmm_dw"`` (the default: its own copy kernel, dyt_fill16) or ``"glu_backward"`` (the GLU
#: backward's pass writes it too, ``out_t``, and ssmm_dw reads it, ``dy_t``: one read of
#: d(pre-activation) and one launch less).  Not settled on an H200 (Mixtral-8x7B, T = 4096): in
#: one call's breakdown the fused path's glu_backward + ssmm_dw took 1.06 + 2.23 ms against
#: 0.38 + 3.17 (dev/lab/results/h200/train_breakdown_4096_873b1c6.json), yet the whole step
#: with it on ran at 1.63x of grouped_mm where another call with it off ran at 1.70x (the
#: fused pass alone at ~45 % of the copy rate): the default stays until one call times both.
DW_COPY_PATHS = tuple(_config._DW_COPY)   # ("ssmm_dw", "glu_backward"): samoyeds.config(dw_copy=...)


def _ssmm_dx_takes(dy: torch.Tensor, w: PackedWeight) -> bool:
    """Whether :func:`samoyeds.ops.ssmm_dx` runs this product: on the CPU always (the C
    reference); on the GPU where its kernel takes the format, the shape and dy's rows."""
    if not dy.is_cuda:
        return True
    # the row stride as the binding takes it (csrc/args.c): one row (or none) has its width
    ld = dy.stride(0) if dy.dim() == 2 and dy.shape[0] > 1 and dy.shape[1] > 0 else dy.shape[-1]
    return (dy.dtype in (torch.bfloat16, torch.float16) and ssmm_dx_supported(w) and dy.stride(-1) == 1
            and ld % 8 == 0 and dy.data_ptr() % 16 == 0)


def _dx_route(dy: torch.Tensor, w: PackedWeight, path: str = "auto") -> str:
    """What :func:`_matmul_w` runs for ``path`` (:data:`DX_PATHS`): ``"ssmm_dx"``,
    ``"transposed"`` or ``"dense"`` (the masked dense weight in torch)."""
    if path not in DX_PATHS:
        raise ValueError(f"path: expected one of {DX_PATHS}, got {path!r}")
    if path == "auto":   # the transposed packing is the faster on the GPU (DX_PATHS)
        path = "transposed" if dy.is_cuda and w.transposable else "ssmm_dx"
    if path == "ssmm_dx" and _ssmm_dx_takes(dy, w):
        return "ssmm_dx"
    return "transposed" if w.transposable else "dense"


def _matmul_w(dy: torch.Tensor, w: PackedWeight, offsets: torch.Tensor, token_ids: Optional[torch.Tensor],
              scale: Optional[torch.Tensor], rows: int, path: str = "auto") -> torch.Tensor:
    """``out[s] = (dy[token_ids[s]] @ W_e) * scale[s]`` for the sorted rows s of every expert
    e (``[rows, C]``, dy's dtype; rows past offsets[E] 0): the gradient with respect to an
    ssmm's input.  ``path`` (:data:`DX_PATHS`): ``"ssmm_dx"`` runs
    :func:`samoyeds.ops.ssmm_dx` on the forward's packing wherever it runs (the CPU; on the
    GPU 2:4, 1:2:V and 1:4:V with V a multiple of 64), else, as ``"transposed"`` does,
    :func:`samoyeds.ssmm` on :meth:`PackedWeight.transposed` where the transpose is 2:4, else
    the masked dense weight in torch (fp32, one host sync).  ``"auto"``: the transposed
    packing on the GPU where there is one (the faster there), else as ``"ssmm_dx"``."""
    route = _dx_route(dy, w, path)
    if route == "ssmm_dx":
        return ssmm_dx(dy, w, offsets, token_ids, scale, out=dy.new_empty((rows, w.shape3[2])))
    if route == "transposed":
        out = dy.new_empty((rows, w.shape3[2]))
        ssmm(dy, w.transposed(), offsets, token_ids, out, scale=scale, check=False)
        _zero_unrouted(out, offsets)   # the rows past offsets[E] are read by the elementwise steps after this
        return out
    E, R, C = w.shape3
    dense = w.unpack().reshape(E, R, C)
    out = dy.new_zeros((rows, C))
    off = offsets.tolist()
    for e in range(E):
        s0, s1 = off[e], off[e + 1]
        if s1 == s0:
            continue
        src = dy[token_ids[s0:s1].long()] if token_ids is not None else dy[s0:s1]
        y = src.float() @ dense[e].float()
        if scale is not None:
            y = y * scale[s0:s1, None]
        out[s0:s1] = y.to(out.dtype)
    return out


def _dy_t_buffer(preact: torch.Tensor, x: torch.Tensor, gu: PackedWeight, S: int) -> Optional[torch.Tensor]:
    """Room for the gate_up weight gradient's copy of d(preact) (:func:`samoyeds.ops.dy_t_shape`)
    where glu_backward writes it and ssmm_dw reads it: a bf16/fp16 GPU tensor like x on a device
    where ssmm_dw takes it; None elsewhere, and where the memory cannot be had (ssmm_dw then
    makes its own copy, or gathers)."""
    if not (preact.is_cuda and preact.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and ssmm_dw_takes_dy_t(preact)):
        return None
    try:
        return preact.new_empty(dy_t_shape(preact.shape[1], S, gu.num_experts))
    except torch.cuda.OutOfMemoryError:
        return None


def moe_backward_eager(grad_out, x, top_k_index, top_k_weights, gate_up_values, gate_up_meta, gate_up_idx,
                       gate_up_rows, gate_up_cols, down_values, down_meta, down_idx, down_rows, down_cols, n, m, v,
                       act, gate_up_bias, down_bias, alpha, limit, preact=None, grad_preact=None,
                       needs=(1 << 6) - 1, dx_path: str = "auto", dw_copy: Optional[str] = None):
    """The body of :func:`moe_backward` (samoyeds ops and elementwise torch).  ``dx_path``:
    how the two dX products run (:data:`DX_PATHS`, :func:`_matmul_w`); ``dw_copy``: who makes
    the gate_up dW's copy of d(pre-activation) (:data:`DW_COPY_PATHS`; None: ``samoyeds.config``'s,
    what the op and the autograd formula take).  The op takes the default ``dx_path``."""
    if dw_copy is None:
        dw_copy = _config.get().dw_copy
    if dw_copy not in DW_COPY_PATHS:
        raise ValueError(f"dw_copy: expected one of {DW_COPY_PATHS}, got {dw_copy!r}")
    _check_logical(x, gate_up_rows, gate_up_cols, down_rows, down_cols)
    if act not in _ACT_NAMES:
        raise ValueError(f"act: expected 1 (swiglu) or 2 (gptoss), got {act}")
    if gate_up_bias is None:
        needs &= ~NEED_GATE_UP_BIAS
    if down_bias is None:
        needs &= ~NEED_DOWN_BIAS
    shapes = _grad_shapes(x, top_k_weights, gate_up_values, down_values, gate_up_bias, down_bias, needs)
    res = [None] * len(shapes)   # each written by its op below (ssmm_dw writes every entry); zeros where none

    def results():
        return tuple(t if t is not None else x.new_zeros(shape, dtype=dt) for t, (shape, dt) in zip(res, shapes))
    x = x.detach()
    T, H = x.shape
    K = top_k_index.shape[1]
    S, I = T * K, gate_up_rows // 2
    if S == 0 or (grad_out is None and grad_preact is None) or not needs:
        return results()
    gu, dn = _packed_pair(gate_up_values, gate_up_meta, gate_up_idx, gate_up_rows, gate_up_cols, down_values,
                          down_meta, down_idx, down_rows, down_cols, n, m, v)
    xdt = _dtype_name(x.dtype)
    r = _route(top_k_index, gu.num_experts)
    ws = gather_weights(top_k_weights.detach().contiguous(), r)
    if preact is None:
        h, preact = _gate_up(x, gu, r, gate_up_bias, _ACT_NAMES[act], alpha, limit, zero_h=True)
    else:
        preact = preact.detach()
        if preact.shape[1] == I and I > 0:   # the gate half (save_preact="gate")
            preact = _full_preact(x, preact, gu, r, gate_up_bias)
        h = glu(preact[:, :I], preact[:, I:], act=_ACT_NAMES[act], alpha=alpha, limit=limit)   # [S, I]
    need_pre = needs & (NEED_X | NEED_GATE_UP | NEED_GATE_UP_BIAS)
    dpre = dpre_t = None
    if grad_out is not None:
        dout = grad_out.detach().to(x.dtype).contiguous()
        g = None   # [S, H]: the sorted rows' output gradients (unscaled), only for a down bias's terms
        if needs & NEED_DOWN_BIAS or (needs & NEED_WEIGHTS and down_bias is not None):
            g = dout.index_select(0, r.token_ids)
        if needs & NEED_DOWN:   # dout's rows read by token id: no [S, H] copy
            res[3] = ssmm_dw(dout, h, dn, r.offsets, None, ws, dy_token_ids=r.token_ids)
        if needs & NEED_DOWN_BIAS:
            res[5] = _segment_sum(g.float() * ws[:, None], r.offsets).to(down_bias.dtype)
        hdot = None
        if needs & NEED_WEIGHTS:
            # d w[t, k] = <dout[t], h_s @ W_e^T + b_e> = <dout[t] @ W_e, h_s> + <dout[t], b_e>
            dh_u = _matmul_w(dout, dn, r.offsets, r.token_ids, None, S, dx_path)   # x's dtype; rows past offsets[E] 0
            if need_pre:   # <dh_u[s], h_s>: the row dot products, in glu_backward's pass below
                hdot = torch.empty(S, dtype=torch.float32, device=x.device)
            else:
                hdot = (dh_u.float() * h.float()).sum(1)
            dh, dh_scale = dh_u, ws
            dh_u = None
        elif need_pre:
            dh, dh_scale = _matmul_w(dout, dn, r.offsets, r.token_ids, ws, S, dx_path), None
        # (the peak of the step: each [S, I] or [S, 2I] temporary dropped after its last reader)
        h = None   # (read by the down dW and the row dot products above; glu_backward recomputes its own)
        if need_pre:
            # one pass (samoyeds.ops.glu_backward: _glu_backward's arithmetic, the routing weights
            # applied first, the rows past offsets[E] 0); fp32 where more is added or summed
            keep32 = bool(needs & NEED_GATE_UP_BIAS) or grad_preact is not None
            if dh.dtype != preact.dtype:
                dh = dh.float()
            # dw_copy "glu_backward": on the GPU the gate_up weight gradient's transposed copy of
            # d(preact), written by the same pass (ssmm_dw then makes none)
            dpre_t = (_dy_t_buffer(preact, x, gu, S)
                      if dw_copy == "glu_backward" and needs & NEED_GATE_UP and grad_preact is None else None)
            dpre = glu_backward(dh, preact, scale=dh_scale, offsets=r.offsets, act=_ACT_NAMES[act], alpha=alpha,
                                limit=limit, dtype="float32" if keep32 else _dtype_name(preact.dtype), hdot=hdot,
                                out_t=dpre_t)
            dh = preact = None   # (preact: freed here where the backward made it, not saved)
        if needs & NEED_WEIGHTS:
            dws = hdot
            if down_bias is not None:
                eid = torch.searchsorted(r.offsets[1:].to(torch.int64),
                                         torch.arange(S, device=x.device), right=True).clamp(max=dn.num_experts - 1)
                dws = dws + (g.float() * down_bias.detach().float().index_select(0, eid)).sum(1)
            pos = r.pos.to(torch.int64)
            res[1] = torch.where(pos >= 0, dws[pos.clamp(min=0)], 0.0).to(top_k_weights.dtype).reshape(
                top_k_weights.shape)
    if need_pre and grad_preact is not None:
        dpre = grad_preact.detach().float() if dpre is None else dpre + grad_preact.detach().float()
    if dpre is not None:
        if needs & NEED_GATE_UP_BIAS:
            res[4] = _segment_sum(dpre, r.offsets).to(gate_up_bias.dtype)
        dpre_x = dpre.to(x.dtype)   # (no copy where glu_backward wrote x's dtype)
        if needs & NEED_GATE_UP:
            res[2] = ssmm_dw(dpre_x, x, gu, r.offsets, r.token_ids, dy_t=dpre_t)
        if needs & NEED_X:
            res[0] = combine(_matmul_w(dpre_x, gu, r.offsets, None, None, S, dx_path), r.pos, dtype=xdt)
    return results()


# indices of the differentiable inputs of moe_forward / moe_forward_train, and their bits
_GRAD_INPUTS = ((0, NEED_X), (2, NEED_WEIGHTS), (3, NEED_GATE_UP), (8, NEED_DOWN), (17, NEED_GATE_UP_BIAS),
                (18, NEED_DOWN_BIAS))
_N_INPUTS = 21


def _setup_context(ctx, inputs, output, train: bool) -> None:
    (x, top_k_index, top_k_weights, gu_v, gu_m, gu_i, gu_r, gu_c, dn_v, dn_m, dn_i, dn_r, dn_c, n, m, v, act,
     gu_b, dn_b, alpha, limit) = inputs
    preact = output[1] if train else None
    ctx.save_for_backward(x, top_k_index, top_k_weights, gu_v, gu_m, gu_i, dn_v, dn_m, dn_i, gu_b, dn_b, preact)
    ctx.scalars = (gu_r, gu_c, dn_r, dn_c, n, m, v, act, alpha, limit)
    ctx.set_materialize_grads(False)


def _needs_bits(flags) -> int:
    """The :data:`NEED_X` ... bits of the inputs ``flags`` (needs_input_grad) marks."""
    needs = 0
    for i, bit in _GRAD_INPUTS:
        if i < len(flags) and flags[i]:   # (the dispatcher drops trailing arguments equal to their defaults)
            needs |= bit
    return needs


def _backward_grads(ctx, grad_out, grad_preact, needs: int, backward_op) -> list:
    """The gradients of the 21 inputs (None where not needed) from ``backward_op``
    (:func:`moe_backward`'s signature)."""
    x, top_k_index, top_k_weights, gu_v, gu_m, gu_i, dn_v, dn_m, dn_i, gu_b, dn_b, preact = ctx.saved_tensors
    gu_r, gu_c, dn_r, dn_c, n, m, v, act, alpha, limit = ctx.scalars
    grads = [None] * _N_INPUTS
    if not needs or (grad_out is None and grad_preact is None):
        return grads
    res = backward_op(grad_out, x, top_k_index, top_k_weights, gu_v, gu_m, gu_i, gu_r, gu_c, dn_v, dn_m, dn_i, dn_r,
                      dn_c, n, m, v, act, gu_b, dn_b, alpha, limit, preact, grad_preact, needs)
    for (i, bit), g in zip(_GRAD_INPUTS, res):
        if needs & bit:
            grads[i] = g
    return grads


def _backward(ctx, grad_out, grad_preact=None):
    return tuple(_backward_grads(ctx, grad_out, grad_preact, _needs_bits(ctx.needs_input_grad),
                                 torch.ops.samoyeds.moe_backward))


moe_forward.register_autograd(_backward, setup_context=lambda ctx, inputs, output:
                              _setup_context(ctx, inputs, output, False))
moe_forward_train.register_autograd(_backward, setup_context=lambda ctx, inputs, output:
                                    _setup_context(ctx, inputs, output, True))


class _MoeFunction(torch.autograd.Function):
    """The autograd formula of the ops above without the dispatcher, for eager mode: the
    same bodies (:func:`moe_forward_train_eager` or :func:`moe_forward_eager`, then
    :func:`moe_backward_eager`), the same saved tensors.  Through the op, each training step
    paid about 0.3 ms of host time (measured on the CPU with a tiny layer) in the custom-op
    layers: torch binding the 21-argument schema (``fill_defaults``) and the Python dispatch
    both ways."""

    @staticmethod
    def forward(ctx, save_preact, *args):
        if save_preact:
            out, preact = moe_forward_train_eager(*args)
            if save_preact == "gate":   # the gate half alone: the backward recomputes the up half
                preact = preact[:, :args[6] // 2].contiguous()
        else:
            out, preact = moe_forward_eager(*args), None
        _setup_context(ctx, args, (out, preact), bool(save_preact))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        needs = _needs_bits(ctx.needs_input_grad[1:])
        return (None, *_backward_grads(ctx, grad_out, None, needs, moe_backward_eager))


# the ops' 21 parameters in order, and the defaults of the trailing ones (from the body's signature)
_SIGNATURE = inspect.signature(moe_forward_train_eager).parameters
_PARAMS = tuple(_SIGNATURE)
_DEFAULTS = {k: p.default for k, p in _SIGNATURE.items() if p.default is not inspect.Parameter.empty}


def _direct(args) -> bool:
    """Whether the eager autograd path (:class:`_MoeFunction`) may stand in for the op:
    not while compiling or tracing, under no torch-function or dispatch mode and no
    functorch transform, and with plain tensors (no subclass that dispatches the op itself)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_function_stack() > 0:
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    if _get_current_dispatch_mode() is not None or torch._C._functorch.maybe_current_level() is not None:
        return False
    return all(type(a) in (torch.Tensor, torch.nn.Parameter) for a in args if isinstance(a, torch.Tensor))


def moe_forward_autograd(*args, save_preact=True, **kwargs) -> torch.Tensor:
    """``torch.ops.samoyeds.moe_forward(*args)``'s output, differentiable: through
    :func:`moe_forward_train` (the pre-activation ``[T*K, 2I]`` saved for the backward)
    with ``save_preact``, else through ``moe_forward`` (nothing more saved; the backward
    recomputes the pre-activation with one more gate_up matmul).  In eager mode the same
    formula runs without the dispatcher (:class:`_MoeFunction`), and ``save_preact="gate"``
    saves the gate half alone (the backward recomputes the up half: :func:`_full_preact`);
    through the ops (compiling, tracing) ``"gate"`` saves the whole, as True."""
    if len(args) + len(kwargs) <= len(_PARAMS) and _direct(args + tuple(kwargs.values())):
        full = list(args) + [None] * (len(_PARAMS) - len(args))
        for i in range(len(args), len(_PARAMS)):
            name = _PARAMS[i]
            if name in kwargs:
                full[i] = kwargs.pop(name)
            elif name in _DEFAULTS:
                full[i] = _DEFAULTS[name]
            else:
                raise TypeError(f"moe_forward_autograd: missing argument {name!r}")
        if kwargs:
            raise TypeError(f"moe_forward_autograd: unexpected arguments {sorted(kwargs)}")
        return _MoeFunction.apply(save_preact if save_preact == "gate" else bool(save_preact), *full)
    if save_preact:
        return torch.ops.samoyeds.moe_forward_train(*args, **kwargs)[0]
    return torch.ops.samoyeds.moe_forward(*args, **kwargs)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)



def moe_forward_packed(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up: PackedWeight, down: PackedWeight, *, act: str = "swiglu",
                       gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None,
                       alpha: float = 1.702, limit: float = 7.0, save_preact=None) -> torch.Tensor:
    """:func:`samoyeds.moe.moe_forward` through the custom op (compilable).

    Same arguments and result as :func:`samoyeds.moe.moe_forward`: ``x [T, H]``,
    ``top_k_index``/``top_k_weights [T, K]``, packed ``gate_up [E, 2I, H]``
    (``glu=True``) and ``down [E, H, I]`` in one format; returns ``[T, H]`` in x's dtype.
    ``save_preact`` (None: ``samoyeds.config``'s): with grad, keep the pre-activation for
    the backward (True), its gate half (``"gate"``, eager mode), or recompute it there (False).
    """
    if gate_up.fmt != down.fmt:
        raise ValueError(f"down: expected the format of gate_up ({gate_up.fmt.name}), got {down.fmt.name}")
    if not gate_up.glu:
        raise ValueError("gate_up: expected a weight packed with glu=True (gate rows, then up rows)")
    n, m, v = gate_up.fmt.c_args()
    _, gr, gc = gate_up.shape3
    _, dr, dc = down.shape3
    op = torch.ops.samoyeds.moe_forward
    if _needs_grad(x, top_k_weights, gate_up.values, down.values, gate_up_bias, down_bias):
        op = functools.partial(moe_forward_autograd,
                               save_preact=_config.get().save_preact if save_preact is None else save_preact)
    return op(
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
    :func:`samoyeds.glu` pass; otherwise the same three matmuls in torch.  Differentiable
    (a dense torch backward).
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


def _shared_mlp_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _shared_mlp_backward(ctx, dy):
    """Dense torch (the shared experts are not packed): a = x gate^T and b = x up^T
    recomputed, the SwiGLU derivative in fp32, the products in the tensors' dtype."""
    x, gate, up, down = ctx.saved_tensors
    if dy is None:
        return None, None, None, None
    H = gate.shape[1]
    x2 = x.reshape(-1, H)
    dy2 = dy.reshape(-1, down.shape[0]).to(down.dtype)
    a, b = F.linear(x2, gate).float(), F.linear(x2, up).float()
    sg = torch.sigmoid(a)
    s = a * sg
    dh = (dy2 @ down).float()
    da = (dh * b * sg * (1.0 + a * (1.0 - sg))).to(gate.dtype)
    db = (dh * s).to(up.dtype)
    need = ctx.needs_input_grad
    dx = (da @ gate + db @ up).reshape(x.shape).to(x.dtype) if need[0] else None
    dgate = da.T @ x2.to(gate.dtype) if need[1] else None
    dup = db.T @ x2.to(up.dtype) if need[2] else None
    ddown = dy2.T @ (s * b).to(down.dtype) if need[3] else None
    return dx, dgate, dup, ddown


shared_mlp.register_autograd(_shared_mlp_backward, setup_context=_shared_mlp_setup)


@shared_mlp.register_fake
def _shared_mlp_fake(x, gate, up, down):
    torch._check(x.shape[-1] == gate.shape[1], lambda: f"x: expected {gate.shape[1]} columns, got {x.shape[-1]}")
    return x.new_empty(x.shape)
