"""The sparse-sparse matmul, dense weights at a few tokens, the router and the MoE
routing/combine ops (out-parameter style, like BLAS: outputs are allocated here in the inputs'
framework)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from . import _C
from ._array import check_ndim, current_stream, dtype_name, empty, for_c, framework, tensor_arg
from .packed import PackedWeight

ACTS = {"none": 0, "swiglu": 1, "silu": 1, "gptoss": 2}
IMPLS = {"auto": 0, "mma_sp": 1, "wgmma_sp": 2, "decode": 3}


def ssmm(x: Any, w: PackedWeight, expert_offsets: Any, token_ids: Optional[Any] = None,
         out: Optional[Any] = None, *, act: str = "none", bias: Optional[Any] = None,
         scale: Optional[Any] = None, alpha: float = 1.702, limit: float = 7.0,
         impl: str = "auto", stream: Optional[int] = None, check: Optional[bool] = None,
         preact: Optional[Any] = None) -> Any:
    """Grouped sparse-sparse matmul over experts.

    For every expert ``e`` and sorted row ``s`` in
    ``[expert_offsets[e], expert_offsets[e+1])``::

        y = x[token_ids[s]] @ W_e.T (+ bias[e])      fp32 accumulation
        out[s] = act(y) * scale[s]

    Args:
        x: ``[T, C]`` activations (bf16/fp16 on the GPU; also fp32 on the CPU).
           Rows are read by index, never gathered into a copy.
        w: packed weights ``[E, R, C]`` (or ``[R, C]``, one expert).
        expert_offsets: ``[E+1]`` int32, non-decreasing.
        token_ids: ``[S]`` int32 rows of x, or None for ``s`` itself.
        out: ``[S, R]`` (``[S, R/2]`` with a gated ``act``); allocated if None
           with ``S = len(token_ids)`` (or ``T``).  Rows past
           ``expert_offsets[E]`` are not written.
        act: ``"none"``, ``"swiglu"`` (``silu(gate) * up``; needs ``w.glu``) or
           ``"gptoss"`` (GPT-OSS's clamped gate with ``alpha``, ``limit``).
        bias: ``[E, R]`` added before the activation.
        scale: ``[S]`` float32 multiplied after it (e.g. routing weights).
        impl: GPU kernel: ``"auto"`` (``"decode"`` when ``S`` is at most
           ``decode_max_rows`` (:func:`samoyeds.config`; default 128), or at most
           ``decode_rows_per_expert`` (default 16) times ``E``; else ``wgmma.sp`` on sm_90 for
           2:4 and 1:2:v with v a multiple of 128, else ``mma.sp``), ``"mma_sp"``,
           ``"wgmma_sp"`` or ``"decode"`` (split-K over the routed experts' weights for
           a few tokens per expert: every SM streams part of them; any S works, an
           expert with more rows than one pass holds (8-32, chosen from the rows per
           expert on average) reads its weights once more per further pass).
        stream: CUDA stream; None uses the producer's current stream.
        impl: ``"auto"`` (on sm_90a the wgmma kernel, else the mma.sync one) or ``"mma"``
            (the mma.sync kernel everywhere: for comparisons); the CPU ignores it.
        preact: with a gated ``act``, a ``[S, R]`` output (x's dtype) that also gets the
           pre-activation of the same rows: ``y + bias`` of the gate rows in columns
           ``[0, R/2)``, of the up rows in ``[R/2, R)``, rounded once (what the backward
           needs, written by the same kernel).
        check: validate ``expert_offsets`` and ``token_ids`` against ``x`` and
           ``out`` before a GPU launch (one host sync).  None: check unless the
           stream is being captured into a CUDA graph.  On the CPU the C
           reference always checks.  The GPU kernel never reads or writes out of
           bounds either way: an invalid token id is treated as absent.
    """
    if act not in ACTS:
        raise ValueError(f"act: expected one of {sorted(ACTS)}, got {act!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {sorted(IMPLS)}, got {impl!r}")
    if not isinstance(w, PackedWeight):
        raise TypeError(f"w: expected a PackedWeight, got {type(w).__name__}")
    x, bias, scale = tensor_arg(x, "x"), for_c(bias), for_c(scale)
    token_ids = tensor_arg(token_ids, "token_ids", optional=True)
    E, R, C = w.shape3
    if out is None:
        S = token_ids.shape[0] if token_ids is not None else x.shape[0]
        out = empty(x, (S, R if ACTS[act] == 0 else R // 2), dtype_name(x))
    if stream is None:
        stream = current_stream(x)
    if check is not False and framework(x) == "torch" and x.is_cuda:
        _check_routing(x, expert_offsets, token_ids, out, forced=check is True)
    _C.ssmm(out, x, w.values, w.meta, w.idx, expert_offsets, token_ids, R, C, *w.c_args(),
            act=ACTS[act], bias=bias, scale=scale, alpha=alpha, limit=limit, impl=IMPLS[impl],
            stream=stream, preact=for_c(preact))
    return out


#: ssmm_dw's kernels on the GPU: the rule's, the mma.sync one, the wgmma one with dy's kept
#: rows gathered from dy, and with them read from a transposed copy of dy (sm_90a only).
_DW_IMPLS = ("auto", "mma", "gather", "copy")
_DX_IMPLS = ("auto", "mma", "wgmma")


def ssmm_dw(dy: Any, x: Any, w: PackedWeight, expert_offsets: Any, token_ids: Optional[Any] = None,
            scale: Optional[Any] = None, out: Optional[Any] = None, *, stream: Optional[int] = None,
            impl: str = "auto", dy_token_ids: Optional[Any] = None, dy_t: Optional[Any] = None) -> Any:
    """The gradient of :func:`ssmm` (``act="none"``) with respect to ``w.values``, in their
    packed layout.

    For every expert ``e`` and every kept value of ``W_e`` at original row ``r`` and column
    ``c`` (its place in ``w.values``)::

        grad = sum over sorted rows s of e of dy[dy_token_ids[s], r] * scale[s] * x[token_ids[s], c]

    fp32 accumulation in increasing ``s``, one rounding (deterministic).  Padding entries of
    the layout are 0; every entry of ``out`` is written.

    Args:
        dy: ``[S, R]`` upstream gradient of the sorted rows (``R`` the weight's logical rows:
           gate rows then up rows for a ``glu`` weight), x's dtype, rows of unit column stride;
           with ``dy_token_ids``, ``[T', R]`` read by those ids (the down projection's output
           gradient by token, without its gathered ``[S, R]`` copy).
        x: ``[T, C]`` activations (bf16/fp16 on the GPU; also fp32 on the CPU), read by
           ``token_ids`` (or row ``s`` when None).
        w: the packed weight (its mask; its values are not read).
        expert_offsets: ``[E+1]`` int32, as for :func:`ssmm`; sorted rows outside the
           ranges are never read.
        token_ids: ``[S]`` int32 or None.
        scale: ``[S]`` float32 multiplying dy's rows, or None.
        out: ``[E, Rp, Cp/2]`` like ``w.values`` (x's dtype); allocated if None.
        stream: CUDA stream; None uses the producer's current stream.
        impl: the GPU kernel: ``"auto"`` (the rule: on sm_90a the wgmma kernel, reading dy's
           kept rows from a transposed copy of dy, or gathering them from dy where the copy
           cannot be allocated; else the mma.sync kernel), ``"mma"``, ``"gather"`` or ``"copy"``
           (the last two need sm_90a).  The copy ((R + 1) x (S + 64 E) elements) is allocated
           on the stream from CUDA's stream-ordered pool, outside torch's allocator.  The CPU
           ignores it.
        dy_token_ids: ``[S]`` int32 or None (None: sorted row ``s`` reads ``dy[s]``).  The C
           reference refuses an id of a routed row outside ``[0, T')``; the GPU kernels read
           it as a zero row.
        dy_t: ``dy * scale`` already in the wgmma kernel's transposed layout (``[R + 1,
           cols]``, :func:`dy_t_shape`, as :func:`glu_backward`'s ``out_t`` writes it), or
           None: then read instead of dy and scale (dy gives the shape and dtype), and the
           kernel makes no copy of its own.  Taken by the C reference and, on the GPU, by the
           wgmma kernel's copy producer only (``impl`` ``"auto"`` or ``"copy"`` on sm_90a;
           :func:`ssmm_dw_takes_dy_t`); the others refuse it.
    """
    if not isinstance(w, PackedWeight):
        raise TypeError(f"w: expected a PackedWeight, got {type(w).__name__}")
    dy, x, scale = tensor_arg(dy, "dy"), tensor_arg(x, "x"), for_c(scale)
    token_ids = tensor_arg(token_ids, "token_ids", optional=True)
    dy_token_ids = tensor_arg(dy_token_ids, "dy_token_ids", optional=True)
    dy_t = tensor_arg(dy_t, "dy_t", optional=True)
    E, R, C = w.shape3
    if out is None:
        out = empty(x, tuple(w.values.shape), dtype_name(x))
    if impl not in _DW_IMPLS:
        raise ValueError(f"impl: expected one of {', '.join(map(repr, _DW_IMPLS))}, got {impl!r}")
    _C.ssmm_dw(out, dy, x, w.meta, w.idx, expert_offsets, token_ids, R, C, *w.c_args(), scale=scale,
               stream=stream if stream is not None else current_stream(x), impl=_DW_IMPLS.index(impl),
               dy_token_ids=dy_token_ids, dy_t=dy_t)
    return out


def dy_t_shape(rows: int, sorted_rows: int, num_experts: int) -> tuple:
    """The shape of an upstream gradient's transposed copy by expert segment (:func:`ssmm_dw`'s
    ``dy_t``, :func:`glu_backward`'s ``out_t``) for ``rows`` columns of dy (R), ``sorted_rows``
    rows (S) and ``num_experts`` (E): ``(R + 1, cols)``, ``cols`` = S + 64 E rounded up to 64.
    Expert e's sorted rows lie at columns ``seg(e) + s - offsets[e]``, ``seg(e)`` =
    ``max(offsets[e], 0) + 64 e`` rounded up to 64; every other element, and the last row, is 0."""
    for name, v in (("rows", rows), ("sorted_rows", sorted_rows), ("num_experts", num_experts)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
    return rows + 1, (sorted_rows + 64 * num_experts + 63) // 64 * 64


def ssmm_dw_takes_dy_t(t: Any) -> bool:
    """Whether :func:`ssmm_dw` (``impl="auto"``) takes a ``dy_t`` for tensors on ``t``'s
    device: on the CPU (the C reference) always; on a GPU where the sm_90a wgmma kernel runs
    (an sm_90 device and a build holding sm_90a code)."""
    kind, index = tensor_arg(t, "t").__dlpack_device__()
    if int(kind) == 1:   # kDLCPU
        return True
    if int(kind) != 2 or "sm_90a" not in str(_C.build_info().get("cuda_archs", "")):   # kDLCUDA
        return False
    import torch
    return torch.cuda.get_device_capability(int(index)) == (9, 0)


def ssmm_dx(dy: Any, w: PackedWeight, expert_offsets: Any, token_ids: Optional[Any] = None,
            scale: Optional[Any] = None, out: Optional[Any] = None, *, stream: Optional[int] = None,
            impl: str = "auto") -> Any:
    """The gradient of :func:`ssmm` (``act="none"``) with respect to its input, from the
    forward's own packing (no transposed copy of the weight).

    For every expert ``e`` and sorted row ``s`` in ``[expert_offsets[e], expert_offsets[e+1])``::

        out[s] = (dy[token_ids[s]] @ W_e) * scale[s]      fp32 accumulation, one rounding

    summed over the kept values only (the storage rows of ``w``: half of ``W_e``'s rows at
    1:2:V).  Rows of ``out`` outside the offsets' ranges (placeholders past
    ``expert_offsets[E]``) are written as 0.  Deterministic.

    Args:
        dy: ``[T, R]`` upstream gradient (``R`` the weight's logical rows: gate rows then up
           rows for a ``glu`` weight), w's dtype (bf16/fp16 on the GPU; also fp32 on the
           CPU), rows of unit column stride, read by ``token_ids`` (or row ``s`` when None).
        w: the packed weight ``[E, R, C]``, as the forward used it.
        expert_offsets: ``[E+1]`` int32, as for :func:`ssmm`.
        token_ids: ``[S]`` int32 or None.
        scale: ``[S]`` float32 multiplying the rows' sums, or None.
        out: ``[S, C]`` in dy's dtype (``S = len(token_ids)``, or ``T``); allocated if None.
        stream: CUDA stream; None uses the producer's current stream.
        impl: the GPU kernel: ``"auto"`` (the rule: on sm_90a the wgmma kernel, which reads
           dy's kept rows from a transposed copy of dy, R x (S + 16 E) elements allocated on
           the stream from CUDA's stream-ordered pool outside torch's allocator, and falls
           back to the mma.sync kernel where that memory cannot be had; else the mma.sync
           kernel), ``"mma"`` or ``"wgmma"`` (needs sm_90a).  The CPU ignores it.

    The GPU kernels (cuda/ssmm_dx.cu, cuda/ssmm_dx_wgmma.cu) take formats 2:4, 1:2:V and 1:4:V with V a multiple
    of 64 and C a multiple of 8 (:func:`ssmm_dx_supported`).
    """
    if not isinstance(w, PackedWeight):
        raise TypeError(f"w: expected a PackedWeight, got {type(w).__name__}")
    dy, scale = tensor_arg(dy, "dy"), for_c(scale)
    token_ids = tensor_arg(token_ids, "token_ids", optional=True)
    E, R, C = w.shape3
    if out is None:
        check_ndim(dy, "dy", 2)
        S = token_ids.shape[0] if token_ids is not None else dy.shape[0]
        out = empty(dy, (S, C), dtype_name(dy))
    if impl not in _DX_IMPLS:
        raise ValueError(f"impl: expected one of {', '.join(map(repr, _DX_IMPLS))}, got {impl!r}")
    _C.ssmm_dx(out, dy, w.values, w.meta, w.idx, expert_offsets, token_ids, R, C, *w.c_args(), scale=scale,
               stream=stream if stream is not None else current_stream(dy), impl=_DX_IMPLS.index(impl))
    return out


def ssmm_dx_supported(w: PackedWeight) -> bool:
    """Whether :func:`ssmm_dx`'s GPU kernel takes ``w``'s format and shape (2:4, 1:2:V or
    1:4:V with V a multiple of 64; C a multiple of 8).  The C reference takes every format."""
    f = w.fmt
    if f.n == f.m:
        ok = True
    else:
        ok = f.n == 1 and f.m in (2, 4) and f.v % 64 == 0
    return ok and w.shape3[2] % 8 == 0


def dense_decode(x: Any, w: Any, up: Optional[Any] = None, out: Optional[Any] = None, *, act: str = "none",
                 alpha: float = 1.702, limit: float = 7.0, weights_ready: bool = False,
                 stream: Optional[int] = None) -> Any:
    """Dense weights at a few tokens: ``out = x @ w.T`` or, with a gated ``act``,
    ``out = act(x @ w.T, x @ up.T)`` (``w`` the gate rows, ``up`` the up rows), fp32
    accumulation, one rounding.

    The GPU kernel is bound by reading the weights: one launch streams ``w`` (and ``up``)
    once per pass of up to 32 tokens, with the activation fused, and sums in a fixed
    order (deterministic).  It is what a block's unpruned shared experts run at decode
    sizes (:func:`samoyeds.patch_model`); past a few dozen tokens a GEMM library's tiles
    reuse the weights better.

    Args:
        x: ``[T, C]`` (bf16/fp16 on the GPU; also fp32 on the CPU), rows of unit
           column stride.
        w, up: ``[R, C]`` contiguous, x's dtype; on the GPU ``C`` a multiple of 8.
        out: ``[T, R]``; allocated if None.
        act: ``"none"``, ``"swiglu"`` (``silu(x @ w.T) * (x @ up.T)``) or ``"gptoss"``.
        weights_ready: the kernel just before this one on the stream writes neither
           ``w`` nor ``up`` and is a samoyeds kernel (it lets its dependents start only
           after its own wait): the weights are then requested while it ends (sm_90).
           Leave False unless both hold.
        stream: CUDA stream; None uses the producer's current stream.
    """
    if act not in ACTS:
        raise ValueError(f"act: expected one of {sorted(ACTS)}, got {act!r}")
    x, w, up = tensor_arg(x, "x"), tensor_arg(w, "w"), tensor_arg(up, "up", optional=True)
    if out is None:
        check_ndim(x, "x", 2)
        check_ndim(w, "w", 2)
        out = empty(x, (x.shape[0], w.shape[0]), dtype_name(x))
    _C.dense_decode(out, x, w, up, act=ACTS[act], alpha=alpha, limit=limit, weights_ready=bool(weights_ready),
                    stream=stream if stream is not None else current_stream(x))
    return out


def glu(gate: Any, up: Any, out: Optional[Any] = None, *, act: str = "swiglu", alpha: float = 1.702,
        limit: float = 7.0, stream: Optional[int] = None) -> Any:
    """A gated activation of two matrices, elementwise: ``out = silu(gate) * up``
    (``act="swiglu"``) or GPT-OSS's clamped variant (``"gptoss"``), in fp32 with one
    rounding.  One pass over ``gate`` and ``up`` (torch's ``F.silu(gate) * up`` makes two):
    what a dense MLP runs between its gate/up and down matmuls at prefill sizes.

    Args:
        gate, up: ``[T, I]`` of one dtype (bf16/fp16 on the GPU; also fp32 on the CPU),
           rows of unit column stride (they may be column slices of wider arrays).
        out: ``[T, I]`` of that dtype; allocated if None.
        stream: CUDA stream; None uses the producer's current stream.
    """
    if act not in ("swiglu", "silu", "gptoss"):
        raise ValueError(f"act: expected 'swiglu' or 'gptoss', got {act!r}")
    gate, up = tensor_arg(gate, "gate"), tensor_arg(up, "up")
    if out is None:
        out = empty(gate, tuple(gate.shape), dtype_name(gate))
    _C.glu(out, gate, up, act=ACTS[act], alpha=alpha, limit=limit,
           stream=stream if stream is not None else current_stream(gate))
    return out


def glu_backward(dh: Any, preact: Any, out: Optional[Any] = None, *, scale: Optional[Any] = None,
                 offsets: Optional[Any] = None, act: str = "swiglu", alpha: float = 1.702, limit: float = 7.0,
                 dtype: Optional[str] = None, stream: Optional[int] = None, hdot: Optional[Any] = None,
                 out_t: Optional[Any] = None) -> Any:
    """The backward of :func:`glu` on the halves of a pre-activation: ``out = [dgate, dup]``
    for ``h = act(preact[:, :I], preact[:, I:])`` and ``dh = dL/dh`` (times ``scale[s]``
    per row), in fp32 with one rounding, one pass.  SwiGLU and GPT-OSS's clamped variant;
    the clamps pass the gradient at their ends (as torch's clamp).  What an MoE backward
    runs between the down projection's dX and the gate_up projection's gradients.

    Args:
        dh: ``[S, I]``, float32 or preact's dtype, rows of unit column stride.
        preact: ``[S, 2I]`` (bf16/fp16/fp32): gate columns ``[0, I)``, up columns ``[I, 2I)``,
           rows of unit column stride.
        out: ``[S, 2I]``, float32 or preact's dtype; allocated if None (in ``dtype``,
           default preact's).
        scale: ``[S]`` float32 multiplying dh's rows (e.g. routing weights), or None.
        offsets: ``[E+1]`` int32 MoE expert offsets, or None: rows ``s >= offsets[E]``
           (placeholders) are written as 0 and never read; read on the device (no sync).
        act: ``"swiglu"`` or ``"gptoss"`` (with ``alpha``, ``limit``).
        stream: CUDA stream; None uses the producer's current stream.
        hdot: ``[S]`` float32, or None: also written, in the same pass, with each row's
           ``sum_i dh[s, i] * h[s, i]`` (dh before ``scale``; h as :func:`glu` writes it,
           rounded to preact's dtype; fp32 sums; 0 past ``offsets[E]``): an MoE backward's
           routing-weight gradient.
        out_t: ``[2I + 1, cols]`` in preact's dtype (:func:`dy_t_shape` ``(2I, S, E)``), or
           None: also written, in the same pass, with ``out`` rounded to preact's dtype in the
           transposed layout by expert segment that :func:`ssmm_dw` takes as ``dy_t`` (needs
           ``offsets``; the C reference refuses offsets that are not non-decreasing in
           ``[0, S]``; on the GPU a bf16 or fp16 preact).  The gate_up weight gradient then
           makes no copy of its own.
    """
    if act not in ("swiglu", "silu", "gptoss"):
        raise ValueError(f"act: expected 'swiglu' or 'gptoss', got {act!r}")
    hdot, out_t = tensor_arg(hdot, "hdot", optional=True), tensor_arg(out_t, "out_t", optional=True)
    dh, preact = tensor_arg(dh, "dh"), tensor_arg(preact, "preact")
    scale, offsets = tensor_arg(scale, "scale", optional=True), tensor_arg(offsets, "offsets", optional=True)
    if out is None:
        check_ndim(preact, "preact", 2)
        if dtype is not None and dtype not in ("float32", dtype_name(preact)):
            raise TypeError(f"dtype: expected 'float32' or preact's {dtype_name(preact)!r}, got {dtype!r}")
        out = empty(preact, tuple(preact.shape), dtype or dtype_name(preact))
    _C.glu_backward(out, dh, preact, scale, offsets, act=ACTS[act], alpha=alpha, limit=limit,
                    stream=stream if stream is not None else current_stream(preact), hdot=hdot, out_t=out_t)
    return out


ROUTER_MODES = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_topk": 2}


def router(x: Any, w: Any, k: int, *, bias: Optional[Any] = None, mode: str = "softmax_topk", n_group: int = 1,
           topk_group: int = 1, renorm: bool = False, scale: float = 1.0, choice_bias: Optional[Any] = None,
           logits_dtype: Optional[str] = None, weights_dtype: Optional[str] = None, out: Optional[tuple] = None,
           stream: Optional[int] = None) -> tuple:
    """An MoE router: logits, routing weights and the top-k experts of every token.

    For every token (fp32 accumulation)::

        logits = x @ w.T (+ bias), rounded to logits_dtype
        "softmax_topk": p = softmax(logits) (fp32, from the rounded logits); with
            n_group > 1 the experts outside the topk_group groups of largest max(p)
            count as 0 (groups: E / n_group contiguous experts); ids = the k largest p,
            largest first (equal values: the lower id); v = p[ids]; renorm:
            v /= v.sum()
        "topk_softmax": ids = the k largest logits; v = softmax(logits[ids])
        "sigmoid_topk": p = sigmoid(logits), c = p + choice_bias; with n_group > 1 a
            group's score is the sum of its two largest c and the experts outside the
            topk_group best groups count as -inf; ids = the k largest c; v = p[ids];
            renorm: v /= v.sum() + 1e-20
        weights = v * scale, rounded to weights_dtype

    which is what Mixtral's, Qwen2/3-MoE's and OLMoE's routers (softmax_topk, renorm as
    ``norm_topk_prob``), DeepSeek-V2's (greedy or group-limited greedy, fp32 logits, the
    routed scaling factor), DeepSeek-V3's (sigmoid_topk, its score correction bias as
    choice_bias) and GPT-OSS's (topk_softmax with a bias) compute.  On the GPU one or
    two launches: the logits on tensor cores (16-bit products are exact in fp32, so
    this equals an fp32 GEMM on the same values up to the order of the sums), the rest by
    a segment of lanes per token, in the logits' launch where one tile holds every expert
    (from 512 tokens), else in a second.

    Args:
        x: ``[T, H]`` (bf16/fp16 on the GPU; also fp32 on the CPU), rows of unit column
           stride; on the GPU ``H`` and the row stride multiples of 8.
        w: ``[E, H]`` contiguous, x's dtype; ``E <= 512``.
        k: experts per token, ``1 <= k <= min(E, 32)``.
        bias: ``[E]``, float32 or x's dtype.
        mode: ``"softmax_topk"``, ``"topk_softmax"`` or ``"sigmoid_topk"``.
        n_group, topk_group: group-limited selection (not with ``topk_softmax``; ``n_group``
           at most 32 and dividing E; ``sigmoid_topk``: at least two experts per group).
        choice_bias: ``[E]``, float32 or x's dtype, added to the scores to choose
           (``sigmoid_topk`` only; None: zeros).
        logits_dtype, weights_dtype: ``"float32"`` or x's dtype (default: x's dtype for
           the logits, float32 for the weights).
        out: ``(logits [T, E], weights [T, k], ids [T, k] int64)`` to write; allocated if None.
        stream: CUDA stream; None uses the producer's current stream.
    Returns:
        ``(logits, weights, ids)``.
    """
    if mode not in ROUTER_MODES:
        raise ValueError(f"mode: expected one of {sorted(ROUTER_MODES)}, got {mode!r}")
    x, w, bias = tensor_arg(x, "x"), tensor_arg(w, "w"), tensor_arg(bias, "bias", optional=True)
    choice_bias = tensor_arg(choice_bias, "choice_bias", optional=True)
    if out is None:
        check_ndim(x, "x", 2)
        check_ndim(w, "w", 2)
        T, E = x.shape[0], w.shape[0]
        out = (empty(x, (T, E), logits_dtype or dtype_name(x)), empty(x, (T, k), weights_dtype or "float32"),
               empty(x, (T, k), "int64"))
    elif not isinstance(out, (tuple, list)) or len(out) != 3:
        raise TypeError("out: expected a tuple (logits, weights, ids)")
    _C.router(out[0], out[1], out[2], x, w, int(k), bias, mode=ROUTER_MODES[mode], n_group=int(n_group),
              topk_group=int(topk_group), renorm=bool(renorm), scale=float(scale), choice_bias=choice_bias,
              stream=stream if stream is not None else current_stream(x))
    return tuple(out)


def _check_routing(x: Any, offsets: Any, token_ids: Optional[Any], out: Any, forced: bool) -> None:
    import torch
    if not forced and torch.cuda.is_current_stream_capturing():
        return
    if not isinstance(offsets, torch.Tensor) or offsets.ndim != 1 or offsets.numel() < 2:
        return  # the extension reports the shape problem
    S, T = int(out.shape[0]), int(x.shape[0])
    off = offsets.to(torch.int64)
    stats = [(off[1:] < off[:-1]).any(), off[0] < 0, off[-1] > S]
    if token_ids is not None and isinstance(token_ids, torch.Tensor) and token_ids.numel():
        ids = token_ids.to(torch.int64)
        live = (torch.arange(ids.numel(), device=ids.device) >= off[0]) & \
               (torch.arange(ids.numel(), device=ids.device) < off[-1])
        stats += [(live & ((ids < 0) | (ids >= T))).any()]
    flags = torch.stack(stats).tolist()
    if flags[0] or flags[1] or flags[2]:
        raise ValueError(f"offsets: expected non-decreasing values in [0, {S}] (out's rows), got "
                         f"{offsets.tolist() if offsets.numel() <= 16 else 'other values'}")
    if len(flags) > 3 and flags[3]:
        raise ValueError(f"token_ids: expected values in [0, {T}) (x's rows) for the sorted rows "
                         "the offsets cover")


@dataclass
class Routing:
    """Routing metadata of one MoE call (all on the device of the router output).

    offsets   ``[E+1]`` int32: expert e owns sorted rows [offsets[e], offsets[e+1]).
    token_ids ``[T*K]`` int32: token of each sorted row.
    perm      ``[T*K]`` int32: flat (t, k) of each sorted row (-1 past offsets[E]).
    pos       ``[T, K]`` int32: sorted row of (t, k), -1 for skipped expert ids.
    """

    offsets: Any
    token_ids: Any
    perm: Any
    pos: Any

    @property
    def num_experts(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def __repr__(self) -> str:
        # shapes, dtypes and the device: printing the tensors would read them back (a sync) and fill screens
        parts = ", ".join(f"{k}={_summary(getattr(self, k))}" for k in ("offsets", "token_ids", "perm", "pos"))
        return f"Routing(num_experts={self.num_experts}, {parts})"


def _summary(t: Any) -> str:
    """``int32[8, 2] cuda:0``: what a repr says of a tensor, without reading it."""
    dev = getattr(t, "device", "cpu")
    return f"{dtype_name(t)}[{', '.join(str(int(d)) for d in t.shape)}] {dev}"


def route(top_k_index: Any, num_experts: int, stream: Optional[int] = None) -> Routing:
    """Stable counting sort of ``top_k_index [T, K]`` (int32/int64) by expert,
    without a host sync.  Ids outside ``[0, num_experts)`` are skipped (expert
    parallelism placeholders)."""
    top_k_index = tensor_arg(top_k_index, "top_k_index")
    if isinstance(num_experts, bool) or not hasattr(num_experts, "__index__"):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    num_experts = num_experts.__index__()
    check_ndim(top_k_index, "top_k_index", 2)
    if not 1 <= num_experts < 2**31 - 1:
        raise ValueError(f"num_experts: expected 1 <= num_experts < 2**31 - 1 (int32 offsets), got {num_experts}")
    T, K = top_k_index.shape
    offsets = empty(top_k_index, (num_experts + 1,), "int32")
    token_ids = empty(top_k_index, (T * K,), "int32")
    perm = empty(top_k_index, (T * K,), "int32")
    pos = empty(top_k_index, (T, K), "int32")
    _C.moe_route(offsets, token_ids, perm, pos, top_k_index,
                 stream=stream if stream is not None else current_stream(top_k_index))
    return Routing(offsets, token_ids, perm, pos)


def gather_weights(top_k_weights: Any, routing: Routing, stream: Optional[int] = None) -> Any:
    """``[T*K]`` float32 routing weight of every sorted row (0 past offsets[E])."""
    if not isinstance(routing, Routing):
        raise TypeError(f"routing: expected a Routing (from route()), got {type(routing).__name__}")
    w = tensor_arg(top_k_weights, "top_k_weights")
    S = int(routing.perm.shape[0])
    if math.prod(w.shape) != S:
        raise ValueError(f"top_k_weights: expected {S} entries (the routing's [T, K]), got shape {tuple(w.shape)}")
    out = empty(w, (S,), "float32")
    _C.moe_gather_weights(out, w, routing.perm, routing.offsets,
                          stream=stream if stream is not None else current_stream(w))
    return out


def combine(y: Any, pos: Any, out: Optional[Any] = None, *, dtype: Optional[str] = None,
            stream: Optional[int] = None) -> Any:
    """``out[t] = sum_k y[pos[t, k]]`` (fp32 accumulation, fixed order, no atomics)."""
    y, pos = tensor_arg(y, "y"), tensor_arg(pos, "pos")
    if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"dtype: expected 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    if out is None:
        check_ndim(y, "y", 2)
        check_ndim(pos, "pos", 2)
        out = empty(y, (pos.shape[0], y.shape[1]), dtype or dtype_name(y))
    _C.moe_combine(out, y, pos, stream=stream if stream is not None else current_stream(y))
    return out
