"""Sparsity patterns: which weights of an ``[..., R, C]`` stack a mask may keep, and how a
saliency score becomes such a mask (used by :mod:`samoyeds.sparsify`).

Patterns (:func:`pattern`): a Samoyeds :class:`~samoyeds.SparseFormat` (``"2:4"``,
``"samoyeds-1:2:128"``, ... — packable, the kernels run them) and two baselines that
only exist as masked dense weights: ``"unstructured-75"`` (any 75 % of each output
row) and VENOM-style ``"venom-128:2:8"`` (``V:N:M``: in every block of ``V`` rows by
``M`` columns the same 4 columns are kept for all ``V`` rows, with ``N``:4 = 2:4 inside:
25 % density at ``M = 8``).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .format import SparseFormat
from .packed import mask as _format_mask

__all__ = ["FormatPattern", "Pattern", "PatternLike", "Unstructured", "Venom", "pattern"]

PatternLike = Union[str, SparseFormat, tuple, "Pattern"]


def _top2of4(scores: torch.Tensor) -> torch.Tensor:
    """Bool mask keeping the 2 largest of every 4 consecutive columns (last dim % 4 == 0)."""
    s = scores.reshape(*scores.shape[:-1], scores.shape[-1] // 4, 4)
    keep = torch.zeros_like(s, dtype=torch.bool)
    keep.scatter_(-1, s.topk(2, dim=-1).indices, True)
    return keep.reshape(scores.shape)


def _glu_joint(gate: torch.Tensor, up: torch.Tensor, v: int) -> torch.Tensor:
    """``[E, I, C]`` gate and up -> ``[E, I, 2C]``: slice j of gate, then slice j of up, for every j."""
    E, I, C = gate.shape
    parts = []
    for c0 in range(0, C, v):
        c1 = min(c0 + v, C)
        parts += [gate[:, :, c0:c1], up[:, :, c0:c1]]
    return torch.cat(parts, dim=2).contiguous()


def _glu_split(joint: torch.Tensor, C: int, v: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_glu_joint`."""
    gate, up = [], []
    pos = 0
    for c0 in range(0, C, v):
        w = min(c0 + v, C) - c0
        gate.append(joint[:, :, pos:pos + w])
        up.append(joint[:, :, pos + w:pos + 2 * w])
        pos += 2 * w
    return torch.cat(gate, dim=2), torch.cat(up, dim=2)


class Pattern:
    """A sparsity pattern: the rule choosing a mask for a saliency.

    ``mask(scores)`` takes float scores ``[E, R, C]`` and returns the bool mask
    ``[E, R, C]`` of the pattern with the largest total saliency the rule finds.
    For the second-order method, ``block`` is the column block whose mask is chosen
    at once (its start is a multiple of ``block``), and ``lazy`` (> 0) the width of
    column groups inside a block whose choice is refined with the updated weights
    (``refine``) just before they are pruned.
    """

    name: str = "?"
    density: float = 1.0
    block: int = 128
    lazy: int = 0
    fmt: Optional[SparseFormat] = None      # set when the kernels can run the pattern

    def mask(self, scores: torch.Tensor, glu: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def block_mask(self, scores: torch.Tensor, glu: bool = False) -> torch.Tensor:
        return self.mask(scores, glu)

    def refine(self, scores: torch.Tensor, block_mask: torch.Tensor) -> torch.Tensor:
        return block_mask

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density

    def check(self, R: int, C: int, what: str) -> None:
        """Raises ValueError when an ``[R, C]`` weight does not fit the pattern."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FormatPattern(Pattern):
    """A Samoyeds format (vector-wise N:M rows + 2:4, or plain 2:4): ``samoyeds.mask``."""

    def __init__(self, fmt: SparseFormat) -> None:
        self.fmt = fmt
        self.name = fmt.name
        self.density = fmt.density
        self.block = max(128, fmt.v or 0) // (fmt.v or 4) * (fmt.v or 4)
        self.lazy = 4

    def mask(self, scores: torch.Tensor, glu: bool = False) -> torch.Tensor:
        s = scores.float().contiguous()
        if not (glu and self.fmt.selects_rows):
            return _format_mask(s, self.fmt, scores=s)
        # Gate row i and up row i feed one product silu(gate_i) * up_i: they are kept or
        # dropped together, for the sum of their 2:4-pruned saliencies.  Laying gate and
        # up slices side by side as slices of length 2v makes samoyeds.mask choose that.
        E, R, C = s.shape
        I, v = R // 2, self.fmt.v
        joint = _glu_joint(s[:, :I], s[:, I:], v)
        keep = _format_mask(joint, SparseFormat(self.fmt.n, self.fmt.m, 2 * v), scores=joint)
        gate, up = _glu_split(keep, C, v)
        return torch.cat([gate, up], dim=1)

    def refine(self, scores: torch.Tensor, block_mask: torch.Tensor) -> torch.Tensor:
        # the rows kept in this slice stay; the 2:4 inside them is chosen afresh
        rows = block_mask.any(dim=-1, keepdim=True)
        return _top2of4(scores) & rows

    def check(self, R: int, C: int, what: str) -> None:
        if C % 4 or R % self.fmt.m:
            raise ValueError(f"{what}: a [{R}, {C}] weight does not fit {self.name} (columns must be a multiple "
                             f"of 4 and rows of m = {self.fmt.m})")


class Unstructured(Pattern):
    """Any ``density`` fraction of each output row (no structure: a quality bound, no speed-up).

    The second-order method chooses per block of 128 columns across all rows of the
    block (SparseGPT's adaptive mask), so rows may keep different counts there.
    """

    def __init__(self, density: float) -> None:
        if not 0.0 < density < 1.0:
            raise ValueError(f"Unstructured: density must be in (0, 1), got {density}")
        self.density = float(density)
        self.name = f"unstructured-{round(100 * (1 - density))}"
        self.block = 128

    def mask(self, scores: torch.Tensor, glu: bool = False) -> torch.Tensor:
        k = max(1, round(self.density * scores.shape[-1]))
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep.scatter_(-1, scores.topk(k, dim=-1).indices, True)
        return keep

    def block_mask(self, scores: torch.Tensor, glu: bool = False) -> torch.Tensor:
        E = scores.shape[0]
        flat = scores.reshape(E, -1)
        k = max(1, round(self.density * flat.shape[1]))
        keep = torch.zeros_like(flat, dtype=torch.bool)
        keep.scatter_(-1, flat.topk(k, dim=-1).indices, True)
        return keep.reshape(scores.shape)


class Venom(Pattern):
    """VENOM-style V:N:M (Castro et al., SC'23): in every block of ``v`` rows by ``m``
    columns, the same 4 columns are kept for all rows of the block, and ``n`` = 2 of
    those 4 in each row.  Density ``2 / m``.  The choice is exact: for each block, of
    the C(m, 4) column subsets the one with the largest sum of every row's two largest
    scores.  A last block of fewer than ``v`` rows is a smaller block.

    ``columns="obs"``: the second-order method (sparsegpt) chooses each block's columns by
    group-OBS cost, as it chooses the Samoyeds format's rows (``samoyeds.sparsify``); the
    default ``"saliency"`` takes them from the per-weight OBS saliency of the block."""

    def __init__(self, v: int = 128, n: int = 2, m: int = 8, columns: str = "saliency") -> None:
        if n != 2:
            raise ValueError(f"Venom: n must be 2 (2:4 inside the kept columns), got {n}")
        if m < 4 or m % 4 or m > 16:
            raise ValueError(f"Venom: m must be a multiple of 4 in [4, 16], got {m}")
        if v < 1:
            raise ValueError(f"Venom: v must be positive, got {v}")
        if columns not in ("saliency", "obs"):
            raise ValueError(f"Venom: columns must be 'saliency' or 'obs', got {columns!r}")
        self.v, self.n, self.m = int(v), int(n), int(m)
        self.columns = columns
        self.name = f"venom-{v}:{n}:{m}"
        self.density = 2.0 / m
        self.block = 128 // m * m or m
        self.lazy = m
        import itertools

        self._subsets = torch.tensor(list(itertools.combinations(range(m), 4)), dtype=torch.long)   # [S, 4]

    def mask(self, scores: torch.Tensor, glu: bool = False) -> torch.Tensor:
        E, R, C = scores.shape
        if C % self.m:
            raise ValueError(f"{self.name}: {C} columns are not a multiple of m = {self.m}")
        keep = torch.zeros_like(scores, dtype=torch.bool)
        subsets = self._subsets.to(scores.device)
        g = C // self.m
        for r0 in range(0, R, self.v):
            r1 = min(r0 + self.v, R)
            s = scores[:, r0:r1].float().reshape(E, r1 - r0, g, self.m)                 # [E, v, g, m]
            cand = s[..., subsets]                                                       # [E, v, g, S, 4]
            top2 = cand.topk(2, dim=-1).values.sum(-1)                                   # [E, v, g, S]
            best = top2.sum(1).argmax(-1)                                                # [E, g]
            cols = subsets[best]                                                         # [E, g, 4]
            sel = torch.gather(s, -1, cols[:, None].expand(E, r1 - r0, g, 4))             # [E, v, g, 4]
            k2 = sel.topk(2, dim=-1).indices                                             # [E, v, g, 2]
            pos = torch.gather(cols[:, None].expand(E, r1 - r0, g, 4), -1, k2)           # [E, v, g, 2]
            blk = torch.zeros(E, r1 - r0, g, self.m, dtype=torch.bool, device=scores.device)
            blk.scatter_(-1, pos, True)
            keep[:, r0:r1] = blk.reshape(E, r1 - r0, C)
        return keep

    def refine(self, scores: torch.Tensor, block_mask: torch.Tensor) -> torch.Tensor:
        return self.mask(scores)

    def check(self, R: int, C: int, what: str) -> None:
        if C % self.m:
            raise ValueError(f"{what}: a [{R}, {C}] weight does not fit {self.name} (columns must be a multiple "
                             f"of m = {self.m})")


def pattern(spec: PatternLike) -> Pattern:
    """A pattern from a format (``"samoyeds-1:2:128"``, ``"2:4"``, ``"n:m:v"``, a
    :class:`SparseFormat`), ``"unstructured-75"`` (percent sparsity) or
    ``"venom-V:N:M"`` (e.g. ``"venom-128:2:8"``), or a :class:`Pattern` (returned)."""
    if isinstance(spec, Pattern):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key.startswith("unstructured-"):
            try:
                pct = float(key[len("unstructured-"):])
            except ValueError:
                pct = -1.0
            if not 0 < pct < 100:
                raise ValueError(f"unknown pattern {spec!r}; expected 'unstructured-P' with P the percent "
                                 "sparsity in (0, 100), e.g. 'unstructured-75'")
            return Unstructured(1.0 - pct / 100.0)
        if key.startswith("venom-"):
            try:
                v, n, m = (int(p) for p in key[len("venom-"):].split(":"))
            except ValueError:
                raise ValueError(f"unknown pattern {spec!r}; expected 'venom-V:N:M', e.g. 'venom-128:2:8'") from None
            return Venom(v, n, m)
    return FormatPattern(SparseFormat.parse(spec))
