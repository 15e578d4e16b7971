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
        """A format from a name, an ``(n, m, v)`` tuple or a format.

        Names (case and surrounding spaces ignored): ``"2:4"`` (plain 2:4), the
        :data:`PRESETS`, and ``"samoyeds-n:m:v"`` or the paper's ``"n:m:v"``
        (``n`` of every ``m`` rows kept per ``v``-column slice, 2:4 inside).  Refused,
        each with a message that says what to write: two numbers other than
        ``"2:4"`` (``"1:4"``: row selection needs a slice length ``v``) and a bare
        ``"2:4:v"`` (plain 2:4 has no ``v``; 2 of every 4 rows is ``"samoyeds-2:4:v"``).
        """
        if isinstance(spec, SparseFormat):
            return spec
        if isinstance(spec, (tuple, list)):
            if len(spec) != 3:
                raise ValueError(f"fmt: expected a tuple (n, m, v) (v None for plain 2:4), got {tuple(spec)!r}")
            return cls(*spec)
        if not isinstance(spec, str):
            raise TypeError(f"fmt: expected a format name, tuple or SparseFormat, got {type(spec).__name__}")
        key = spec.strip().lower()
        if key in PRESETS:
            return cls(*PRESETS[key])
        prefixed = key.startswith("samoyeds-")
        parts = (key[len("samoyeds-"):] if prefixed else key).split(":")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) == 3 and (prefixed or nums[:2] != [2, 4]):
            return cls(*nums)
        if len(nums) == 3:
            raise ValueError(f"fmt: expected '2:4' (plain 2:4 has no slice length) or 'samoyeds-{key}' "
                             f"(2 of every 4 rows kept per {nums[2]}-column slice, then 2:4 inside them), "
                             f"got the ambiguous {spec!r}")
        if len(nums) == 2:
            n, m = nums
            eg = f"samoyeds-{n}:{m}:128" if 1 <= n < m <= MAX_M else "samoyeds-1:4:128"
            raise ValueError(f"fmt: expected '2:4' or a format with row selection, 'samoyeds-n:m:v' (n of every m "
                             f"rows kept per v-column slice, then 2:4 inside them; e.g. {eg!r}), got {spec!r}")
        raise ValueError(f"fmt: expected one of {sorted(PRESETS)} or 'samoyeds-n:m:v' (e.g. 'samoyeds-1:4:64'), "
                         f"got {spec!r}")

    def __repr__(self) -> str:
        return f"SparseFormat({self.name!r})"
