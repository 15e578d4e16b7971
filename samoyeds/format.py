"""The Samoyeds sparse format: vector-wise N:M row selection + 2:4 inside rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

MAX_M = 8

#: Named formats.  Density is the fraction of weights kept.
PRESETS = {
    "2:4": (1, 1, None),                # 50 %: plain 2:4 (the cuSPARSELt format)
    "samoyeds-1:2:128": (1, 2, 128),    # 75 %: the paper's setting
    "samoyeds-1:2:64": (1, 2, 64),      # 75 %, finer row selection
    "samoyeds-1:2:256": (1, 2, 256),    # 75 %, coarser row selection
}


@dataclass(frozen=True)
class SparseFormat:
    """Vector-wise N:M + 2:4.

    For every group of ``m`` consecutive rows (output features) and every
    ``v``-long slice of the columns (input features), ``n`` rows are kept; in a
    kept row, 2 of every 4 columns are kept.  ``n == m`` is plain 2:4 (``v`` is
    then irrelevant and stored as None).  Density = n/m * 1/2.
    """

    n: int = 1
    m: int = 2
    v: Optional[int] = 128

    def __post_init__(self) -> None:
        n, m, v = self.n, self.m, self.v
        if not isinstance(n, int) or not isinstance(m, int):
            raise TypeError(f"n, m: expected ints, got n={n!r}, m={m!r}")
        if not 1 <= m <= MAX_M:
            raise ValueError(f"m: expected 1 <= m <= {MAX_M}, got {m}")
        if not 1 <= n <= m:
            raise ValueError(f"n: expected 1 <= n <= m = {m}, got {n}")
        if n == m:
            object.__setattr__(self, "n", 1)
            object.__setattr__(self, "m", 1)
            object.__setattr__(self, "v", None)
            return
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise TypeError(f"v: expected an int (or None for plain 2:4), got {v!r}")
        if v is None or v < 32 or v % 32:
            raise ValueError("v: expected a positive multiple of 32 (the slice length of a format with row selection: "
                             f"a sparse tensor-core k-step), got {v!r}")

    @property
    def selects_rows(self) -> bool:
        return self.n < self.m

    @property
    def density(self) -> float:
        return self.n / self.m * 0.5

    @property
    def sparsity(self) -> float:
        return 1.0 - self.density

    @property
    def name(self) -> str:
        if not self.selects_rows:
            return "2:4"
        return f"samoyeds-{self.n}:{self.m}:{self.v}"

    def c_args(self) -> tuple:
        """(n, m, v) as the C extension takes them."""
        return (self.n, self.m, self.v or 0)

    @classmethod
    def parse(cls, spec: Union[str, "SparseFormat", tuple]) -> "SparseFormat":
        """A format from a preset name, an ``"n:m:v"`` string, a tuple or a format."""
        if isinstance(spec, SparseFormat):
            return spec
        if isinstance(spec, tuple):
            return cls(*spec)
        if isinstance(spec, str):
            key = spec.strip().lower()
            if key in PRESETS:
                return cls(*PRESETS[key])
            body = key[len("samoyeds-"):] if key.startswith("samoyeds-") else key
            parts = body.split(":")
            try:
                nums = [int(p) for p in parts]
            except ValueError:
                nums = None
            if nums and len(nums) == 3:
                return cls(*nums)
            raise ValueError(f"fmt: expected one of {sorted(PRESETS)} or 'n:m:v' (e.g. '1:2:128'), got {spec!r}")
        raise TypeError(f"fmt: expected a format name, tuple or SparseFormat, got {type(spec).__name__}")

    def __repr__(self) -> str:
        return f"SparseFormat({self.name!r})"
