"""Choosing which expert weights survive: calibrated masks for the Samoyeds format
and for the baseline sparsity patterns it is compared with.

Methods (each chooses every level of a pattern: for the Samoyeds format which
``n`` of every ``m`` rows survive in each ``v``-slice *and* the 2:4 inside them):

* ``"magnitude"``: saliency ``|w|``; no calibration.
* ``"activation"`` (Wanda): saliency ``|w[r, c]| * ||x[:, c]||_2`` where ``x`` are the
  inputs *this expert* receives on calibration data (only the tokens routed to it;
  rows scaled by their routing weight, see ``routing_weighted``).  For ``down_proj``
  the inputs are the expert's gated activations ``act(gate) * up``, computed with
  its already pruned ``gate_up_proj``.
* ``"sparsegpt"`` (second order, after SparseGPT / Optimal Brain Surgeon): per expert,
  the Hessian ``H = X^T X`` of its inputs.  For the Samoyeds format the rows of
  every slice are chosen first by group-OBS cost (the output error of dropping a
  row's whole slice with the rest of the row re-fitted; with few slices, jointly
  over all slices of a row group: :func:`_row_selection`); then columns are pruned
  left to right in blocks, the 2:4 (or the baseline pattern's mask) chosen for the
  OBS saliency ``w^2 / [H^-1]_cc^2`` on the updated weights, and the error of every
  pruned weight compensated on the columns not yet visited.  Finally the kept
  weights of every row are re-fitted exactly (least squares under ``H``, by
  conjugate gradients).  ``down_proj`` is first re-fitted so that the activations
  of the *pruned* ``gate_up_proj`` reproduce the *dense* expert's output, which
  repairs most of the first projection's error.  The surviving weights change.

Every method here chooses a GLU weight's rows jointly: gate row ``i`` and up
row ``i`` are kept or dropped together in each slice (their product is the
activation; keeping one without the other wastes it).  ``glu_joint=False`` gives
the per-half choice that ``samoyeds.patch_model``'s magnitude rule makes.

Patterns (:func:`pattern`, samoyeds/sparsity_patterns.py): a Samoyeds
:class:`~samoyeds.SparseFormat` and the baselines it is compared with.

Calibration runs layer by layer: for MoE layer ``l`` the calibration batches go
through the model, already pruned up to layer ``l - 1`` (so each layer is fitted to
the inputs it will really see), with a hook on that layer's experts module that
records its inputs and routing and then stops the forward.  Only one layer's
inputs (calibration tokens x hidden size, the model's dtype) and one expert
chunk's statistics are held at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import hf as _hf
from .hf import experts as _experts
from .format import PRESETS, SparseFormat
from ._array import check_model
from .sparsity_patterns import FormatPattern, Pattern, PatternLike, Unstructured, Venom, pattern

__all__ = ["METHODS", "Pattern", "FormatPattern", "Unstructured", "Venom", "pattern", "prune_model",
           "sparsify_model", "prune_weight"]

#: Mask selection methods.
METHODS = ("magnitude", "activation", "sparsegpt")

# --- pruning one stack of expert weights ----------------------------------------------------------

def _damped(H: torch.Tensor, damp: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(H + lambda I)`` with ``lambda = damp * mean(diag H)`` per expert (dead inputs,
    zero on the diagonal, get 1 there), and ``lambda`` / mean diag."""
    H = H.clone()
    diag = H.diagonal(dim1=1, dim2=2)
    diag[diag <= 0] = 1.0
    mean = diag.mean(dim=1)                                   # [E]
    diag += (damp * mean)[:, None]
    return H, mean


def _inverse(H: torch.Tensor, damp: float) -> torch.Tensor:
    """``(H + lambda I)^-1`` per expert, ``[E, C, C]`` float32; damping grows tenfold
    until the Cholesky factorisation succeeds."""
    d = damp
    for _ in range(7):
        Hd, _ = _damped(H, d)
        L, info = torch.linalg.cholesky_ex(Hd)
        if not bool((info > 0).any()):
            return torch.cholesky_inverse(L)
        d = max(d, 1e-6) * 10.0
    raise RuntimeError("sparsegpt: the calibration Hessian could not be factorised even with strong damping")


def _upper(Hinv: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of ``Hinv`` (SparseGPT's sequential OBS coefficients)."""
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if bool((info > 0).any()):
        eye = torch.eye(Hinv.shape[1], dtype=Hinv.dtype, device=Hinv.device)
        U = torch.linalg.cholesky(Hinv + 1e-6 * Hinv.diagonal(dim1=1, dim2=2).mean(1)[:, None, None] * eye,
                                  upper=True)
    return U


#: Joint row selection over all slices (see :func:`_row_selection`) up to this many slices.
JOINT_MAX_SLICES = 6


def _drop_costs(W: torch.Tensor, Hinv: torch.Tensor, spans: List[Tuple[int, int]], sets: List[int]) -> torch.Tensor:
    """Group-OBS cost ``w_D [(H^-1)_DD]^-1 w_D^T`` of dropping, in every row, the columns
    ``D`` of the slices in each bit set of ``sets`` (the rest of the row re-fitted):
    ``[E, R, len(sets)]``."""
    E, R, _ = W.shape
    out = torch.zeros(E, R, len(sets), dtype=W.dtype, device=W.device)
    for k, bits in enumerate(sets):
        cols = torch.cat([torch.arange(c0, c1, device=W.device) for j, (c0, c1) in enumerate(spans) if bits >> j & 1])
        L = torch.linalg.cholesky(Hinv[:, cols][:, :, cols].contiguous())        # (H^-1)_DD is SPD
        Wd = W[:, :, cols].contiguous()
        sol = torch.cholesky_solve(Wd.transpose(1, 2), L)                          # [E, |D|, R]
        out[:, :, k] = (Wd * sol.transpose(1, 2)).sum(-1)
    return out


def _row_selection(W: torch.Tensor, Hinv: torch.Tensor, fmt: SparseFormat, glu: bool) -> torch.Tensor:
    """The vector-wise N:M row choice by group-OBS cost (bool ``[E, R, C]``, True on
    the whole slice of a kept row).

    Dropping columns ``D`` of a row costs, with the rest of the row re-fitted,
    ``w_D [(H^-1)_DD]^-1 w_D^T``.  With ``n = 1`` and at most :data:`JOINT_MAX_SLICES`
    slices, every group of ``m`` rows gets the assignment of slices to rows with the
    least total cost, each row's cost taken for the exact set of slices it loses (so
    a row losing all its slices costs its whole output, which the sum of per-slice
    costs underestimates).  Otherwise, slice by slice, the ``n`` rows that would cost
    most to drop are kept.  For a GLU weight, gate row ``i`` and up row ``i`` are
    chosen together, for the sum of their costs."""
    E, R, C = W.shape
    spans = [(c0, min(c0 + fmt.v, C)) for c0 in range(0, C, fmt.v)]
    S, m = len(spans), fmt.m
    Rs = R // 2 if glu else R

    def halves(cost: torch.Tensor) -> torch.Tensor:
        return cost[:, :Rs] + cost[:, Rs:] if glu else cost

    keep_rows = torch.zeros(E, Rs, S, dtype=torch.bool, device=W.device)     # row r kept in slice j
    if fmt.n == 1 and S <= JOINT_MAX_SLICES and m ** S <= 4096:
        full = (1 << S) - 1
        cost = halves(_drop_costs(W, Hinv, spans, list(range(1, full + 1))))
        cost = torch.cat([torch.zeros_like(cost[..., :1]), cost], dim=-1)          # [E, Rs, 2^S], set 0 free
        assign = torch.cartesian_prod(*[torch.arange(m, device=W.device)] * S).view(-1, S)   # [A, S] slice -> row
        pos = (1 << torch.arange(S, device=W.device))
        kept_bits = torch.stack([((assign == r) * pos).sum(-1) for r in range(m)], dim=1)  # [A, m]
        dropped = full - kept_bits                                                    # [A, m]
        g = cost.view(E, Rs // m, m, 1 << S)
        total = torch.stack([g[:, :, r, dropped[:, r]] for r in range(m)], dim=-1).sum(-1)   # [E, G, A]
        best = assign[total.argmin(-1)]                                               # [E, G, S]
        rows = best[:, :, None, :] == torch.arange(m, device=W.device)[None, None, :, None]
        keep_rows = rows.reshape(E, Rs, S)
    else:
        for j in range(S):
            cost = halves(_drop_costs(W, Hinv, spans, [1 << j])[..., 0])
            top = cost.view(E, Rs // m, m).topk(fmt.n, dim=-1).indices
            rows = torch.zeros(E, Rs // m, m, dtype=torch.bool, device=W.device)
            rows.scatter_(-1, top, True)
            keep_rows[:, :, j] = rows.view(E, Rs)
    if glu:
        keep_rows = torch.cat([keep_rows, keep_rows], dim=1)
    keep = torch.zeros(E, R, C, dtype=torch.bool, device=W.device)
    for j, (c0, c1) in enumerate(spans):
        keep[:, :, c0:c1] = keep_rows[:, :, j:j + 1]
    return keep


def _venom_columns(W: torch.Tensor, Hinv: torch.Tensor, pat: Venom) -> torch.Tensor:
    """VENOM's column choice by group-OBS cost, the counterpart of :func:`_row_selection`
    (bool ``[E, R, C]``, True on the 4 kept columns of every ``v``-row block and
    ``m``-column group).

    Dropping the other ``m - 4`` columns ``D`` of a group in a row costs, with the rest of
    the row re-fitted, ``w_D [(H^-1)_DD]^-1 w_D^T`` (the cost the Samoyeds row selection
    takes for a row's slice); for every block of rows and every group of columns, of the
    C(m, 4) subsets the one with the least total cost over the block's rows is kept."""
    E, R, C = W.shape
    m = pat.m
    subsets = pat._subsets.to(W.device)                                          # [S, 4]
    allc = torch.arange(m, device=W.device)
    comp = torch.stack([allc[~torch.isin(allc, s)] for s in subsets])           # [S, m - 4]
    keep = torch.zeros(E, R, C, dtype=torch.bool, device=W.device)
    for c0 in range(0, C, m):
        Hg = Hinv[:, c0:c0 + m, c0:c0 + m]
        Hdd = Hg[:, comp[:, :, None], comp[:, None, :]]                          # [E, S, d, d]
        L, info = torch.linalg.cholesky_ex(Hdd)
        if bool((info > 0).any()):
            eye = torch.eye(comp.shape[1], dtype=Hdd.dtype, device=Hdd.device)
            L = torch.linalg.cholesky(Hdd + 1e-6 * Hdd.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye)
        Wd = W[:, :, c0 + comp]                                                  # [E, R, S, d]
        sol = torch.cholesky_solve(Wd.permute(0, 2, 3, 1), L)                    # [E, S, d, R]
        cost = (Wd.permute(0, 2, 3, 1) * sol).sum(2)                             # [E, S, R]
        for r0 in range(0, R, pat.v):
            r1 = min(r0 + pat.v, R)
            best = cost[:, :, r0:r1].sum(-1).argmin(-1)                          # [E]
            cols = c0 + subsets[best]                                            # [E, 4]
            blk = torch.zeros(E, C, dtype=torch.bool, device=W.device)
            blk.scatter_(1, cols, True)
            keep[:, r0:r1, c0:c0 + m] = blk[:, None, c0:c0 + m]
    return keep


def _top2_within(scores: torch.Tensor, allowed: torch.Tensor, m: int) -> torch.Tensor:
    """In every row and group of ``m`` columns, the 2 largest scores among the allowed places."""
    E, R, C = scores.shape
    s = scores.float().masked_fill(~allowed, float("-inf")).reshape(E, R, C // m, m)
    keep = torch.zeros_like(s, dtype=torch.bool)
    keep.scatter_(-1, s.topk(2, dim=-1).indices, True)
    return keep.reshape(E, R, C) & allowed


def _obs_prune(W: torch.Tensor, H: torch.Tensor, pat: Pattern, damp: float,
               glu: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT on a stack ``W [E, R, C]`` (float32) with Hessians ``H [E, C, C]``.

    Columns are visited in blocks of ``pat.block``; each block's mask is chosen for
    the OBS saliency ``w^2 / [H^-1]_cc^2`` and refined ``pat.lazy`` columns at a time
    with the updated weights; the error of every pruned weight is spread over the
    row's columns not yet visited.  For a format with row selection, the rows of
    every slice are chosen first, by group-OBS cost (:func:`_row_selection`), and
    the 2:4 inside them as the columns are visited; likewise VENOM's kept columns with
    ``Venom(..., columns="obs")`` (:func:`_venom_columns`).  Returns the updated weights
    (zero where pruned) and the bool mask."""
    E, R, C = W.shape
    Hinv = _inverse(H, damp)
    fixed = None
    refine = pat.refine
    if pat.fmt is not None and pat.fmt.selects_rows:
        fixed = _row_selection(W, Hinv, pat.fmt, glu)
    elif isinstance(pat, Venom) and pat.columns == "obs":
        fixed = _venom_columns(W, Hinv, pat)
        refine = lambda s, allowed: _top2_within(s, allowed, pat.m)  # noqa: E731
    W = W.clone()
    U = _upper(Hinv)
    del Hinv
    keep = torch.zeros(E, R, C, dtype=torch.bool, device=W.device)
    B = pat.block
    g = pat.lazy
    for i1 in range(0, C, B):
        i2 = min(i1 + B, C)
        cnt = i2 - i1
        W1 = W[:, :, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[:, i1:i2, i1:i2]
        d = U1.diagonal(dim1=1, dim2=2)                      # [E, cnt]
        M1 = fixed[:, :, i1:i2].clone() if fixed is not None else pat.block_mask(W1 ** 2 / d[:, None, :] ** 2, glu)
        for i in range(cnt):
            if g and i % g == 0 and i + g <= cnt:
                M1[:, :, i:i + g] = refine(W1[:, :, i:i + g] ** 2 / d[:, None, i:i + g] ** 2, M1[:, :, i:i + g])
            w = W1[:, :, i]
            err = (w - w * M1[:, :, i]) / d[:, None, i]
            W1[:, :, i:] -= err[:, :, None] * U1[:, None, i, i:]
            Err1[:, :, i] = err
        W1 *= M1                                             # exact zeros where pruned
        W[:, :, i1:i2] = W1
        keep[:, :, i1:i2] = M1
        if i2 < C:
            W[:, :, i2:] -= torch.bmm(Err1, U[:, i1:i2, i2:])
    return W, keep


def _refit(W: torch.Tensor, target: torch.Tensor, keep: torch.Tensor, H: torch.Tensor, damp: float,
           iters: int) -> torch.Tensor:
    """The kept weights re-fitted to the target: per row, ``min (w - t) H (w - t)^T`` over
    ``w`` supported on the mask, by conjugate gradients started from ``W`` (batched
    over experts and rows; each row is its own system)."""
    Hd, _ = _damped(H, damp)
    m = keep.to(W.dtype)
    w = W * m
    r = -torch.bmm(w - target, Hd) * m                          # minus the gradient, projected
    p = r.clone()
    rr = (r * r).sum(-1, keepdim=True)
    for _ in range(iters):
        Ap = torch.bmm(p, Hd) * m
        alpha = rr / (p * Ap).sum(-1, keepdim=True).clamp_min(1e-30)
        w = w + alpha * p
        r = r - alpha * Ap
        rr_new = (r * r).sum(-1, keepdim=True)
        p = r + (rr_new / rr.clamp_min(1e-30)) * p
        rr = rr_new
    return w * m


def prune_weight(w: torch.Tensor, pat: PatternLike, method: str = "magnitude", *,
                 inputs: Optional[Sequence[Optional[torch.Tensor]]] = None, damp: float = 0.01,
                 glu: bool = False, dense_inputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 refit_iters: int = 30, reconstruct: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prunes a stack of expert weights ``w [E, R, C]`` (output rows, input columns).

    Args:
        w: float weights (any float dtype; work is done in float32).
        pat: the pattern (see :func:`pattern`).
        method: ``"magnitude"``, ``"activation"`` or ``"sparsegpt"``.
        inputs: for the calibrated methods, expert ``e``'s inputs ``[N_e, C]``
            (rows already scaled by whatever weighting is wanted), or None / empty
            for an expert without tokens (it falls back to magnitude).
        damp: sparsegpt's Hessian damping, relative to the mean diagonal.
        glu: ``w`` is a fused gate_up weight (gate rows, then up rows): with row
            selection, gate row ``i`` and up row ``i`` are kept or dropped together.
        dense_inputs: sparsegpt only: the inputs ``[N_e, C]`` the *unpruned* model gives
            for the same tokens (rows matching ``inputs``).  The weights are then first
            re-fitted so that the pruned inputs reproduce the dense outputs
            (``w <- w Xd^T X (X^T X)^-1``), which corrects an earlier pruning's error,
            and pruned from there.
        refit_iters: sparsegpt only: conjugate-gradient steps that then re-fit the
            kept weights of every row exactly to the (re-fitted) dense ones under
            the calibration Hessian, mask fixed (0: SparseGPT's weights as they come).
        reconstruct: sparsegpt only: False keeps SparseGPT's mask and returns the
            original weights under it (``w * mask``: no error compensation, no
            ``dense_inputs`` or ``refit_iters`` re-fit), the mask-only variant.
    Returns:
        ``(pruned, mask)``: ``pruned [E, R, C]`` in w's dtype (``w * mask`` except for
        sparsegpt, whose kept weights are updated) and the bool ``mask``.
    """
    pat = pattern(pat)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if w.dim() != 3:
        raise ValueError(f"w: expected [E, R, C], got shape {tuple(w.shape)}")
    E, R, C = w.shape
    pat.check(R, C, "w")
    wf = w.detach().float()
    if method != "magnitude":
        if inputs is None or len(inputs) != E:
            raise ValueError(f"inputs: method {method!r} needs a list of {E} per-expert input matrices [N_e, {C}]")
        for e, x in enumerate(inputs):
            if x is not None and (x.dim() != 2 or x.shape[1] != C):
                raise ValueError(f"inputs[{e}]: expected [N, {C}], got shape {tuple(x.shape)}")
    if method == "magnitude":
        keep = pat.mask(wf.abs(), glu)
        return (wf * keep).to(w.dtype), keep
    has = [x is not None and x.shape[0] > 0 for x in inputs]
    if method == "activation":
        norms = torch.stack([x.float().pow(2).sum(0).sqrt() if h else torch.ones(C, device=w.device)
                             for x, h in zip(inputs, has)])                            # [E, C]
        keep = pat.mask(wf.abs() * norms[:, None, :], glu)
        return (wf * keep).to(w.dtype), keep
    Hs = torch.stack([x.float().T @ x.float() if h else torch.eye(C, device=w.device)
                      for x, h in zip(inputs, has)])                                   # [E, C, C]
    if not reconstruct:
        _, keep = _obs_prune(wf, Hs, pat, damp, glu)
        return (wf * keep).to(w.dtype), keep
    if dense_inputs is not None and any(has):
        Hinv = _inverse(Hs, damp)
        wf = wf.clone()
        for e in range(E):
            if has[e]:
                wf[e] = wf[e] @ (dense_inputs[e].float().T @ inputs[e].float()) @ Hinv[e]
        del Hinv
    pruned, keep = _obs_prune(wf, Hs, pat, damp, glu)
    if refit_iters > 0:
        pruned = _refit(pruned, wf, keep, Hs, damp, refit_iters)
    return pruned.to(w.dtype), keep


# --- calibration through a transformers model ------------------------------------------------------

class _Stop(Exception):
    """Raised by the capture hook: the rest of the forward is not needed."""


@dataclass
class _Captured:
    x: List[torch.Tensor]        # [N, H] expert inputs
    idx: List[torch.Tensor]      # [N, K] expert ids
    w: List[torch.Tensor]        # [N, K] routing weights


def _capture_hook(t: "_experts.Target", store: _Captured):
    E = t.layout.num_experts

    def hook(mod, args, kwargs):
        if t.block is None:
            names = ("hidden_states", "top_k_index", "top_k_weights")
            vals = list(args) + [kwargs[n] for n in names[len(args):]]
            x, idx, w = (v.detach() for v in vals[:3])
            store.x.append(x.reshape(-1, x.shape[-1]))
            store.idx.append(idx.reshape(x.shape[0], -1))
            store.w.append(w.reshape(x.shape[0], -1).float())
        else:
            # Llama 4: rows [e*T, (e+1)*T) are every token scaled by its score for expert e (0 if not routed)
            x = (args[0] if args else kwargs["hidden_states"]).detach()
            x = x.reshape(E, -1, x.shape[-1])
            live = x.abs().amax(-1) > 0                                    # [E, T]
            e_ids, tok = live.nonzero(as_tuple=True)
            store.x.append(x[e_ids, tok])
            store.idx.append(e_ids[:, None])
            store.w.append(torch.ones(e_ids.shape[0], 1, device=x.device))
        raise _Stop

    return hook


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _run_batch(model: torch.nn.Module, batch: Any, device: torch.device) -> None:
    if isinstance(batch, torch.Tensor):
        model(input_ids=batch.to(device), use_cache=False)
    elif isinstance(batch, Mapping):
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        kw.setdefault("use_cache", False)
        model(**kw)
    else:
        raise TypeError(f"calibration: expected batches of input_ids tensors or dicts of model inputs, "
                        f"got {type(batch).__name__}")


def _capture(model: torch.nn.Module, t: "_experts.Target", calibration: Sequence[Any]) -> _Captured:
    store = _Captured([], [], [])
    handle = t.experts.register_forward_pre_hook(_capture_hook(t, store), with_kwargs=True)
    device = _device_of(model)
    try:
        with torch.no_grad():
            for batch in calibration:
                try:
                    _run_batch(model, batch, device)
                except _Stop:
                    pass
                else:
                    raise RuntimeError(f"calibration: experts module {t.name!r} was not called by the forward")
    finally:
        handle.remove()
    return store


def _per_expert(store: _Captured, E: int, weighted: bool) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """For every expert: (its tokens' inputs [N_e, H] in the stored dtype, routing weights [N_e] float32)."""
    x = torch.cat(store.x)
    idx = torch.cat(store.idx)
    w = torch.cat(store.w)
    out = []
    for e in range(E):
        tok, k = (idx == e).nonzero(as_tuple=True)
        r = w[tok, k] if weighted else torch.ones(tok.shape[0], device=w.device)
        out.append((x[tok], r))
    return out


def _gated(x: torch.Tensor, w_gate_up: torch.Tensor, bias: Optional[torch.Tensor], p: "_experts.ExpertsPatch") -> torch.Tensor:
    """An expert's down_proj input ``[N, I]``: its gated activation for inputs ``x [N, H]``
    (``w_gate_up [2I, H]`` in packing layout, gate rows first; ``bias [2I]`` or None)."""
    y = x.float() @ w_gate_up.float().T
    if bias is not None:
        y = y + bias.float()
    I = y.shape[1] // 2
    g, u = y[:, :I], y[:, I:]
    if p.act == "gptoss":
        g = g.clamp(max=p.limit)
        u = u.clamp(-p.limit, p.limit)
        return (u + 1) * g * torch.sigmoid(p.alpha * g)
    return torch.nn.functional.silu(g) * u


def _chunks(E: int, C: int, method: str, budget: int) -> Iterable[Tuple[int, int]]:
    per = C * C * 4 * 3 if method == "sparsegpt" else 1
    step = max(1, min(E, budget // max(1, per))) if method == "sparsegpt" else E
    for e0 in range(0, E, step):
        yield e0, min(E, e0 + step)


def _prune_module(model: torch.nn.Module, t: "_experts.Target", pat: Pattern, method: str,
                  calibration: Optional[Sequence[Any]], weighted: bool, damp: float,
                  budget: int, glu_joint: bool, refit_iters: int, reconstruct: bool = True) -> Dict[str, torch.Tensor]:
    p = t.layout
    mod = t.experts
    E = p.num_experts
    per = None
    if method != "magnitude":
        per = _per_expert(_capture(model, t, calibration), E, weighted)
    masks: Dict[str, torch.Tensor] = {}
    gu_bias = None
    if p.bias:
        b = mod._parameters["gate_up_proj_bias"].detach()
        gu_bias = _experts.split_gate_up(b, 1) if p.interleaved else b
    for proj in _experts.PROJS:
        param = mod._parameters[f"{proj}_proj"]
        w = _experts.to_pack(param, p, proj)                                    # [E, R, C]
        C = w.shape[2]
        pat.check(w.shape[1], C, f"{t.name}.{proj}_proj")
        dense_in = None
        if proj == "down" and per is not None:
            wgu = _experts.to_pack(mod._parameters["gate_up_proj"], p, "gate_up")   # already pruned
            bias = (lambda e: None) if gu_bias is None else (lambda e: gu_bias[e])
            if method == "sparsegpt" and reconstruct:
                dense_in = [_gated(x, wgu_dense[e], bias(e), p) for e, (x, r) in enumerate(per)]
                del wgu_dense
            per = [(_gated(x, wgu[e], bias(e), p), r) for e, (x, r) in enumerate(per)]
        elif proj == "gate_up" and method == "sparsegpt" and reconstruct:
            wgu_dense = w.clone()      # the dense activations are the down_proj's target
        new = torch.empty_like(w)
        keep = torch.empty(w.shape, dtype=torch.bool, device=w.device)
        for e0, e1 in _chunks(E, C, method, budget):
            inputs = dense = None
            if per is not None:
                inputs = [x.float() * r[:, None] for x, r in per[e0:e1]]
            if dense_in is not None:
                dense = [xd * r[:, None] for xd, (x, r) in zip(dense_in[e0:e1], per[e0:e1])]
            new[e0:e1], keep[e0:e1] = prune_weight(w[e0:e1], pat, method, inputs=inputs, damp=damp,
                                                   glu=glu_joint and proj == "gate_up", dense_inputs=dense,
                                                   refit_iters=refit_iters, reconstruct=reconstruct)
            del inputs, dense
        del dense_in
        with torch.no_grad():
            param.copy_(_experts.from_pack(new, p, proj))
        masks[f"{proj}_proj"] = _experts.from_pack(keep, p, proj)
        del w, new
    return masks


def prune_model(model: torch.nn.Module, pattern_: PatternLike = "samoyeds-1:2:128", method: str = "activation",
                calibration: Optional[Iterable[Any]] = None, *, progress: bool = True,
                routing_weighted: bool = True, damp: float = 0.01, glu_joint: bool = True,
                refit_iters: int = 30, memory_budget: int = 1 << 30,
                reconstruct: bool = True) -> Dict[str, Dict[str, torch.Tensor]]:
    """Prunes the experts of a transformers MoE model in place, as masked dense weights.

    Every experts module's ``gate_up_proj``/``down_proj`` Parameter then holds its
    pruned weights (exact zeros where masked; for ``"sparsegpt"`` the kept weights
    are updated too); the model stays a dense transformers model (trainable, any
    pattern, including the baselines the kernels do not run).

    Args:
        model: a transformers model with experts modules :func:`samoyeds.patch_model`
            supports (not patched), on the CPU or a GPU, any float dtype.
        pattern_: a format or baseline pattern (:func:`pattern`).
        method: ``"magnitude"``, ``"activation"`` (Wanda) or ``"sparsegpt"``.
        calibration: for the calibrated methods, the batches to run: ``input_ids``
            tensors ``[B, T]`` (int64) or dicts of model inputs; iterated once per
            MoE layer (a generator is read into a list first).
        progress: a tqdm bar over the MoE layers.
        routing_weighted: scale each token's inputs by its routing weight for the
            expert (the weight its output gets) in the saliency / Hessian.
        damp: sparsegpt's Hessian damping relative to its mean diagonal.
        glu_joint: with row selection, keep or drop gate row ``i`` and up row ``i``
            of ``gate_up_proj`` together (their product is the expert's activation).
        refit_iters: sparsegpt's exact re-fit of the kept weights (see :func:`prune_weight`).
        memory_budget: bytes of Hessians (sparsegpt) held at once; experts are
            processed in chunks that fit.
        reconstruct: sparsegpt only: False keeps the original weights under SparseGPT's
            masks (the mask-only variant; later layers are calibrated on it).
    Returns:
        Bool masks ``{experts module name: {"gate_up_proj": m, "down_proj": m}}``, each
        shaped like the module's Parameter (:func:`samoyeds.patch_model`'s ``masks``).
    """
    pat = pattern(pattern_)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if method != "magnitude":
        if calibration is None:
            raise ValueError(f"calibration: method {method!r} needs calibration batches (input_ids tensors)")
        if not isinstance(calibration, (list, tuple)):
            calibration = list(calibration)
        if not calibration:
            raise ValueError("calibration: got no batches")
    targets = _experts.find_experts(model)
    if not targets:
        raise _experts.UnsupportedModelError(f"{type(model).__name__}: no Mixture-of-Experts experts module found")
    patched = [t.name for t in targets if getattr(t.experts, "_samoyeds", None) is not None]
    if patched:
        raise ValueError(f"{type(model).__name__} is already patched ({patched[0]!r}, ...); prune the dense model")
    # a pattern whose fmt is a row-selection spec but no SparseFormat (mask only) fits the 2:4 layout checks
    check_fmt = pat.fmt if isinstance(pat.fmt, SparseFormat) else SparseFormat(*PRESETS["2:4"])
    for t in targets:
        t.layout = _experts.experts_layout(t, model, check_fmt)
    was_training = model.training
    model.eval()
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")      # Hessians and their factors need full fp32 (no TF32)
    masks: Dict[str, Dict[str, torch.Tensor]] = {}
    try:
        for t in _experts.progress(targets, progress, f"samoyeds: pruning experts ({pat.name}, {method})"):
            masks[t.name] = _prune_module(model, t, pat, method, calibration, routing_weighted, damp,
                                          memory_budget, glu_joint, refit_iters, reconstruct)
    finally:
        model.train(was_training)
        torch.set_float32_matmul_precision(precision)
    return masks


def sparsify_model(model: torch.nn.Module, fmt: Union[str, SparseFormat, tuple] = "samoyeds-1:2:128",
                   method: str = "activation", calibration: Optional[Iterable[Any]] = None, *,
                   progress: bool = True, router: bool = True, shared_stream: bool = True,
                   shared_stream_min_rows: int = 4096, **kwargs: Any) -> torch.nn.Module:
    """Prunes every expert of ``model`` for ``fmt`` with ``method`` and packs it (in place).

    :func:`prune_model` (calibration batches through the model, layer by layer,
    hooks on the experts modules; a tqdm bar over the layers), then
    :func:`samoyeds.patch_model` with the masks found.  ``fmt`` must be a Samoyeds
    format (``"samoyeds-1:2:128"``, ``"2:4"``, ...); ``kwargs`` go to
    :func:`prune_model` (``routing_weighted``, ``damp``, ``memory_budget``); ``router``,
    ``shared_stream`` and ``shared_stream_min_rows`` to :func:`samoyeds.patch_model`.

    Returns ``model``, patched: its experts run from packed weights.
    """
    check_model(model)
    fmt = SparseFormat.parse(fmt)
    _hf.check_options(router, shared_stream, shared_stream_min_rows)
    masks = prune_model(model, fmt, method, calibration, progress=progress, **kwargs)
    return _hf.patch_model(model, fmt, progress=False, masks=masks, router=router, shared_stream=shared_stream,
                           shared_stream_min_rows=shared_stream_min_rows)
