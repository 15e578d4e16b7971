"""samoyeds' run-time configuration: one :class:`Config` in force for the process.

It holds what stays tunable once ``impl="auto"`` has decided everything else: the ssmm
kernel selection's overrides (``tile``, ``token_rows``, ``split_k``, the decode kernel's row limits),
programmatic dependent launch (``pdl``) and the Hugging Face integration's shared-MLP
decode limit (``dense_decode_max_rows``).  The ssmm fields live in the C extension's
module state (``_C.set_config``), which every ``ssmm`` and ``moe_forward`` call copies
into its kernel parameters; this module is their one writer and keeps the Python value
in step with it.

Tests and benchmarks change it for a scope::

    with samoyeds.config(tile="256x64", token_rows="tma"):
        ...

:func:`override` validates every field before anything changes and applies the new value;
as a ``with`` statement it restores the previous one on exit (also when the body raises),
and overrides nest.  Called alone (``samoyeds.config(split_k=1)``), the change stays.  The
configuration is process-wide, like the module state it writes: an override on one
thread is seen by every thread while it lasts.

Environment: read once, when this module is imported, and nowhere else at run time:
``SAMOYEDS_PDL=0`` starts the process with ``pdl=False`` (kernels launched one after
another: per-kernel profiler traces read cleanly; results are bit-identical).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from . import _C

__all__ = ["Config", "get", "override"]

# names -> the C ABI's enum values (cuda/samoyeds_cuda.h: sam_tile, sam_token_rows, sam_x_copy)
_TILES: Dict[str, int] = {"auto": 0, "128x128": 1, "256x64": 2, "256x96": 3}
_TOKEN_ROWS: Dict[str, int] = {"auto": 0, "gather": 1, "tma": 2}
_X_COPY: Dict[str, int] = {"auto": 0, "never": 1, "always": 2}
_DW_COPY: Dict[str, int] = {"ssmm_dw": 0, "glu_backward": 1}   # (Python only: torch_ops.DW_COPY_PATHS)
_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class Config:
    """The tunables in force.  Every field is checked when a Config is made.

    Attributes:
        tile: the ``wgmma.sp`` kernel's 1:2:V tile: ``"auto"`` (the selection rule),
            ``"128x128"``, ``"256x64"`` or ``"256x96"``.
        token_rows: how the ``wgmma.sp`` kernel reads token rows: ``"auto"``,
            ``"gather"`` (always by index) or ``"tma"`` (by TMA; unsupported where they
            cannot be).
        x_copy: where :func:`samoyeds.moe_forward`'s gate_up projection reads its token
            rows on the GPU: ``"auto"`` (the rule: a copy where it pays), ``"never"`` (by
            index from x) or ``"always"`` (x's routed rows copied in expert order into the
            workspace first, then read without a row map; same results to the bit).
        split_k: the ``wgmma.sp`` kernel's K splits: 0 the selection rule (splits where
            its work items are too few to fill the SMs), 1 never, n > 1 n splits (at most
            16 and the K range's slices or k-tile pairs).
        decode_max_rows: ``impl="auto"`` picks the decode kernel up to this many rows;
            None: the kernel's default rule.
        decode_rows_per_expert: ... or up to this many rows per expert; None: the default.
        pdl: programmatic dependent launch on sm_90 and later (each kernel starts while
            the one before it ends); False launches them one after another.
        dense_decode_max_rows: an unpruned shared-experts MLP of a patched Hugging Face
            model runs :func:`samoyeds.dense_decode` up to this many token rows on the GPU
            (0: never).
        save_preact: a differentiable MoE forward (:func:`samoyeds.moe_forward` with grad,
            a patched model in training mode) keeps the gate_up pre-activation
            ``[T*K, 2I]`` for the backward; ``"gate"`` keeps its gate half ``[T*K, I]`` and
            the backward recomputes the up half (half a gate_up matmul, on
            :meth:`PackedWeight.up_half`; in eager mode: under ``torch.compile`` it keeps the
            whole); False keeps only x and the routing and the backward recomputes it with one
            more gate_up matmul (less activation memory, more time; docs/TRAINING.md).
        dw_copy: who makes the gate_up weight gradient's transposed copy of the
            pre-activation's gradient in a GPU backward: ``"ssmm_dw"`` (its own copy kernel)
            or ``"glu_backward"`` (the GLU backward's pass writes it as well: the weight
            gradients the same to the bit, the routing weights' summed in another order;
            docs/TRAINING.md).
    """

    tile: str = "auto"
    token_rows: str = "auto"
    x_copy: str = "auto"
    split_k: int = 0
    decode_max_rows: Optional[int] = None
    decode_rows_per_expert: Optional[int] = None
    pdl: bool = True
    dense_decode_max_rows: int = 16
    save_preact: Union[bool, str] = True
    dw_copy: str = "ssmm_dw"

    def __post_init__(self) -> None:
        for name, names in (("tile", _TILES), ("token_rows", _TOKEN_ROWS), ("x_copy", _X_COPY),
                            ("dw_copy", _DW_COPY)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in names:
                raise ValueError(f"{name}: expected one of {sorted(names)}, got {value!r}")
        for name in ("split_k", "decode_max_rows", "decode_rows_per_expert", "dense_decode_max_rows"):
            value = getattr(self, name)
            if value is None and name not in ("split_k", "dense_decode_max_rows"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT_MAX:
                what = "an int" if name in ("split_k", "dense_decode_max_rows") else "None or an int"
                raise ValueError(f"{name}: expected {what} in [0, {_INT_MAX}], got {value!r}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"pdl: expected a bool, got {self.pdl!r}")
        if not (isinstance(self.save_preact, bool) or self.save_preact == "gate"):
            raise ValueError(f"save_preact: expected a bool or 'gate', got {self.save_preact!r}")


def _apply(cfg: Config) -> None:
    """Writes ``cfg`` to the extension's module state, then makes it the one in force."""
    global _current
    _C.set_config(decode_max_rows=-1 if cfg.decode_max_rows is None else cfg.decode_max_rows,
                  decode_rows_per_expert=-1 if cfg.decode_rows_per_expert is None else cfg.decode_rows_per_expert,
                  tile=_TILES[cfg.tile], token_rows=_TOKEN_ROWS[cfg.token_rows], pdl=cfg.pdl,
                  split_k=cfg.split_k, x_copy=_X_COPY[cfg.x_copy])
    _current = cfg


def get() -> Config:
    """The configuration in force (``samoyeds.get_config()``)."""
    return _current


class override:
    """Puts ``fields`` (names of :class:`Config`) in force, the others as they are
    (``samoyeds.config(...)``).  Called alone, the change stays for the process::

        samoyeds.config(split_k=1)

    As a ``with`` statement, the previous configuration comes back on exit, also when the
    body raises; overrides nest::

        with samoyeds.config(tile="256x64") as cfg:   # cfg: the configuration in force
            ...

    The change takes effect when ``config(...)`` is called (a ``with`` enters at once).

    Raises:
        ValueError: an unknown field, or a value it does not take (the message names
            the field); nothing has changed then.
    """

    def __init__(self, **fields: Any) -> None:
        known = {f.name for f in dataclasses.fields(Config)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: not a samoyeds config field; expected one of {sorted(known)}")
        self._previous = _current
        self._new = dataclasses.replace(self._previous, **fields)   # (validates: Config.__post_init__)
        _apply(self._new)

    def __enter__(self) -> Config:
        return self._new

    def __exit__(self, *exc: Any) -> None:
        _apply(self._previous)

    def __repr__(self) -> str:
        return f"samoyeds.config: {self._new!r}"


def _from_environment() -> Config:
    raw = os.environ.get("SAMOYEDS_PDL", "").strip()
    if not raw:
        return Config()
    try:
        pdl = int(raw) != 0
    except ValueError:
        raise ValueError(f"SAMOYEDS_PDL: expected 0 (off) or 1 (on), got {raw!r}") from None
    return Config(pdl=pdl)


_current: Config = Config()
_apply(_from_environment())
