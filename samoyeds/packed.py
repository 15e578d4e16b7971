"""Packing weights into the Samoyeds format (layout: docs/FORMAT.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from . import _C
from ._array import check_dtype, check_ndim, current_stream, dtype_name, empty, expand3, framework, tensor_arg
from .format import SparseFormat

FormatLike = Union[str, SparseFormat, tuple]

#: The dtypes a weight is packed in (format_mask also takes float64 saliencies).
PACK_DTYPES = ("float32", "float16", "bfloat16")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class PackedDims:
    """Storage shapes of a packed [E, R, C] weight (mirrors cuda/samoyeds_layout.h)."""

    E: int
    R: int
    C: int
    rp: int        # storage rows
    cp: int        # padded columns
    slices: int    # column slices (0 without row selection)

    @classmethod
    def of(cls, fmt: SparseFormat, E: int, R: int, C: int, glu: bool, name: str = "shape") -> "PackedDims":
        """The storage shapes; a ValueError naming ``name`` (worded as the extension's)
        for a shape the format cannot take."""
        if C % 4:
            raise ValueError(f"{name}: expected a column count that is a multiple of 4 (2:4 sparsity), got {C}")
        half = R // 2 if glu else R
        if glu and R % 2:
            raise ValueError(f"{name}: expected an even row count (gate rows, then up rows), got {R}")
        if half % fmt.m:
            where = " per gate/up half" if glu else ""
            raise ValueError(f"{name}: expected a row count that is a multiple of m = {fmt.m}{where}, got {half}")
        rc = half // fmt.m * fmt.n
        half_rp = _round_up(rc, _C.GLU_CHUNK if glu else _C.ROW_ALIGN)
        rp = 2 * half_rp if glu else half_rp
        cp = _round_up(C, _C.COL_ALIGN)
        slices = -(-C // fmt.v) if fmt.selects_rows else 0
        return cls(E, R, C, rp, cp, slices)


class PackedWeight:
    """A weight (or a stack of expert weights) in the Samoyeds format.

    Attributes:
        values: ``[E, rp, cp/2]`` kept values, dtype of the dense weight.
        meta:   ``[E, rp/16, cp/32, 16]`` uint32 2:4 metadata in mma.sp operand order.
        idx:    ``[E, slices, rp]`` uint8 row choices, or None for plain 2:4.
        fmt:    the :class:`SparseFormat`.
        shape:  logical dense shape, ``(R, C)`` or ``(E, R, C)``.
        glu:    True when gate rows [0, R/2) and up rows [R/2, R) are interleaved
                for a fused gated activation.
    """

    layout_version = _C.LAYOUT_VERSION

    def __init__(self, values: Any, meta: Any, idx: Optional[Any], fmt: SparseFormat,
                 shape: Tuple[int, ...], glu: bool = False) -> None:
        self.values = values
        self.meta = meta
        self.idx = idx
        self.fmt = fmt
        self.shape = tuple(int(s) for s in shape)
        self.glu = bool(glu)
        E, R, C = self.shape3
        self.dims = PackedDims.of(fmt, E, R, C, self.glu)
        d = self.dims
        want = {"values": (E, d.rp, d.cp // 2), "meta": (E, d.rp // 16, d.cp // 32, 16)}
        if fmt.selects_rows:
            want["idx"] = (E, d.slices, d.rp)
        elif idx is not None:
            raise ValueError(f"idx: expected None for plain 2:4, got {type(idx).__name__}")
        for name, shp in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shp:
                raise ValueError(f"{name}: expected shape {shp} for a {fmt.name} weight of shape "
                                 f"{self.shape}, got {got}")

    @property
    def shape3(self) -> Tuple[int, int, int]:
        return (1,) + self.shape if len(self.shape) == 2 else self.shape  # type: ignore[return-value]

    @property
    def num_experts(self) -> int:
        return self.shape3[0]

    @property
    def rows(self) -> int:
        return self.shape3[1]

    @property
    def cols(self) -> int:
        return self.shape3[2]

    @property
    def dtype(self) -> str:
        return dtype_name(self.values)

    @property
    def device(self) -> Any:
        return getattr(self.values, "device", "cpu")

    def tensors(self) -> dict:
        out = {"values": self.values, "meta": self.meta}
        if self.idx is not None:
            out["idx"] = self.idx
        return out

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) if hasattr(t, "nbytes") else t.numel() * t.element_size()
                   for t in self.tensors().values())

    @property
    def dense_nbytes(self) -> int:
        E, R, C = self.shape3
        es = 4 if self.dtype == "float32" else 2
        return E * R * C * es

    def c_args(self) -> tuple:
        n, m, v = self.fmt.c_args()
        return (n, m, v, self.glu)

    def unpack(self) -> Any:
        return unpack(self)

    def to(self, device: Any) -> "PackedWeight":
        """torch only: the same packed weight on another device."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedWeight(move(self.values), move(self.meta), move(self.idx), self.fmt, self.shape,
                            self.glu)

    def expert(self, e: int) -> "PackedWeight":
        """Expert e as a single [R, C] packed weight (views, no copy)."""
        idx = self.idx[e:e + 1] if self.idx is not None else None
        return PackedWeight(self.values[e:e + 1], self.meta[e:e + 1], idx, self.fmt,
                            (1,) + self.shape3[1:], self.glu)

    @property
    def transposable(self) -> bool:
        """Whether the transpose of every expert, ``W_e^T [C, R]``, is a plain 2:4 matrix
        (at most 2 kept of every 4 consecutive rows of W in every column, ``R`` a multiple
        of 4): formats with row selection and ``n/m <= 1/2`` (1:2:v, 1:4:v, 2:4:v, ...).
        Then :meth:`transposed` exists; plain 2:4 itself has none."""
        return _transposable(self.fmt, self.rows, self.glu)

    def transposed(self) -> "PackedWeight":
        """``W^T`` as a plain 2:4 :class:`PackedWeight` ``[E, C, R]`` (torch only), exactly
        ``pack(unpack(self).transpose(-1, -2), "2:4")`` (same mask, same values): what the
        backward's ``dX = dY @ W`` runs on with :func:`samoyeds.ssmm`.

        Built once per mask (cached with the ``meta`` tensor, weakly: it goes with the
        weight); when ``values`` changed since (an optimizer step in place, a new tensor,
        another dtype) the transposed values are refreshed in one pass over this weight's
        values and metadata (``_C.format_transpose_values``).  The cache holds the
        transposed values (``E * C * R / 2`` elements) and their metadata.

        Raises a ValueError for a weight that is not :attr:`transposable`."""
        return transposed_arrays(self.values, self.meta, self.idx, self.fmt, self.shape3, self.glu)

    def unglued(self) -> "PackedWeight":
        """A ``glu=True`` weight packed with ``glu=False`` (torch only): the same format,
        mask and values, the gate and up halves no longer interleaved, so that an ssmm without
        activation writes the pre-activation ``[S, 2I]`` (gate columns, then up columns) on
        the GPU, whose kernels pair glu-packed weights with a gated activation only.  Cached
        and refreshed as :meth:`transposed`; it holds a copy of the values and one int32 per
        value."""
        return unglued_arrays(self.values, self.meta, self.idx, self.fmt, self.shape3, self.glu)

    def up_half(self) -> "PackedWeight":
        """The up rows of a ``glu=True`` weight (``[E, 2I, C]``: gate rows, then up rows) as a
        weight of their own, ``[E, I, C]`` packed with ``glu=False`` (torch only): the same
        format, mask and values, so that an ssmm without activation writes the up half of the
        pre-activation alone (the backward of ``save_preact="gate"``).  Cached and refreshed as
        :meth:`transposed`; it holds a copy of half the values and one int32 per value."""
        if not self.glu:
            raise ValueError("glu: expected a weight packed with glu=True (gate rows, then up rows) for up_half()")
        return _relayout(self.values, self.meta, self.idx, self.fmt, self.shape3, self.glu, "up")

    @property
    def logical_nbytes(self) -> int:
        """Bytes the packed data would take without the padding to whole tiles: the kept
        values, their 2:4 metadata (2 bits each) and the row choices."""
        E, R, C = self.shape3
        f = self.fmt
        kept_rows = R // f.m * f.n
        es = self.values.element_size() if hasattr(self.values, "element_size") else self.values.itemsize
        values = E * kept_rows * (C // 2) * es
        meta = E * kept_rows * (C // 2) * 2 // 8
        idx = E * self.dims.slices * kept_rows if f.selects_rows else 0
        return values + meta + idx

    def __repr__(self) -> str:
        share = self.nbytes / max(1, self.dense_nbytes)
        size = f"{_bytes(self.nbytes)} = {share:.1%} of dense {_bytes(self.dense_nbytes)}"
        if self.nbytes > self.logical_nbytes:
            size += f", padded to tiles from {_bytes(self.logical_nbytes)}"
        return (f"PackedWeight(shape={self.shape}, fmt={self.fmt.name!r}, dtype={self.dtype}, "
                f"glu={self.glu}, device={self.device}, {size})")

    def __reduce__(self) -> tuple:
        # torch pickles a uint32 tensor but cannot unpickle it (its legacy storage loader
        # knows no uint32): the metadata travels as its int32 view (same bits).
        meta = self.meta
        if framework(meta) == "torch":
            import torch
            meta = meta.view(torch.int32)
        return (_rebuild, (self.values, meta, self.idx, self.fmt, self.shape, self.glu))


def _rebuild(values: Any, meta: Any, idx: Optional[Any], fmt: SparseFormat, shape: Tuple[int, ...],
             glu: bool) -> PackedWeight:
    """A PackedWeight from its pickle (PackedWeight.__reduce__): the metadata back to uint32."""
    if framework(meta) == "torch" and dtype_name(meta) == "int32":
        import torch
        meta = meta.view(torch.uint32)
    return PackedWeight(values, meta, idx, fmt, shape, glu)


def _transposable(fmt: SparseFormat, R: int, glu: bool) -> bool:
    """At most 2 kept rows in every aligned 4-row window of a weight with R logical rows."""
    if not fmt.selects_rows or R % 4:
        return False
    return _windows_ok(fmt.n, fmt.m, R // 2 if glu else R, 2 if glu else 1)


_WINDOWS: dict = {}


def _windows_ok(n: int, m: int, half: int, halves: int) -> bool:
    key = (n, m, half, halves)
    if key not in _WINDOWS:
        R = half * halves
        ok = True
        for a in range(0, R, 4):
            per_group: dict = {}
            for r in range(a, min(a + 4, R)):
                g = (r // half, (r % half) // m)
                per_group[g] = per_group.get(g, 0) + 1
            if sum(min(n, c) for c in per_group.values()) > 2:
                ok = False
                break
        _WINDOWS[key] = ok
    return _WINDOWS[key]


class _Relayout:
    """A cached repacking of one packed weight's values in another layout (keyed by its
    meta tensor and the layout's name)."""

    __slots__ = ("packed", "buf", "src", "stamp")

    def __init__(self, packed: "PackedWeight", buf: Any, src: Any) -> None:
        self.packed = packed   # the repacked PackedWeight; its values (a view of buf) refreshed in place
        self.buf = buf         # flat: the repacked values
        self.src = src         # int32/int64 [buf.numel()]: the flat index in values of each place's value,
        #                        values.numel() for a padding place (the zero appended to the values);
        #                        None for the transposed layout (refreshed by _C.format_transpose_values)
        self.stamp = None      # (data_ptr, _version, dtype) of the values last copied


_RELAYOUTS = None  # torch.utils.weak.WeakIdKeyDictionary: meta tensor -> {layout name: _Relayout}


def transposed_arrays(values: Any, meta: Any, idx: Optional[Any], fmt: SparseFormat,
                      shape3: Tuple[int, int, int], glu: bool) -> "PackedWeight":
    """:meth:`PackedWeight.transposed` of the packed arrays (what the autograd ops hold)."""
    E, R, C = shape3
    if not _transposable(fmt, R, glu):
        raise ValueError(f"fmt: expected a format whose transpose is 2:4 (row selection with n/m <= 1/2 and "
                         f"R a multiple of 4), got {fmt.name} with R = {R}; the backward uses the "
                         "masked dense weight instead")
    return _relayout(values, meta, idx, fmt, shape3, glu, "transposed")


def unglued_arrays(values: Any, meta: Any, idx: Optional[Any], fmt: SparseFormat,
                   shape3: Tuple[int, int, int], glu: bool) -> "PackedWeight":
    """:meth:`PackedWeight.unglued` of the packed arrays."""
    if not glu:
        raise ValueError("glu: expected a weight packed with glu=True (it has no other layout to leave)")
    return _relayout(values, meta, idx, fmt, shape3, glu, "unglued")


def _relayout(values: Any, meta: Any, idx: Optional[Any], fmt: SparseFormat, shape3: Tuple[int, int, int],
              glu: bool, layout: str) -> "PackedWeight":
    global _RELAYOUTS
    import torch
    from torch.utils.weak import WeakIdKeyDictionary
    if not isinstance(values, torch.Tensor) or not isinstance(meta, torch.Tensor):
        raise TypeError("values: expected torch tensors (the repacking is built with torch)")
    if _RELAYOUTS is None:
        _RELAYOUTS = WeakIdKeyDictionary()
    per_meta = _RELAYOUTS.get(meta)
    if per_meta is None:
        per_meta = _RELAYOUTS[meta] = {}
    key = (layout, tuple(shape3), glu, fmt)
    entry = per_meta.get(key)
    if entry is None or entry.buf.device != values.device:
        entry = per_meta[key] = _build_relayout(values, meta, idx, fmt, shape3, glu, layout)
    stamp = (values.data_ptr(), values._version, values.dtype)
    if entry.stamp != stamp:
        with torch.no_grad():
            if entry.buf.dtype != values.dtype:
                entry.buf = torch.zeros(entry.buf.shape, dtype=values.dtype, device=entry.buf.device)
                entry.packed.values = entry.buf.view(entry.packed.values.shape)
            if entry.src is None:
                # (transposed) one pass of _C.format_transpose_values: W's values read once,
                # every place of the transposed packing written once from the place its
                # metadata names, no index map
                _, R, C = shape3
                n, m, v = fmt.c_args()
                _C.format_transpose_values(entry.buf.view(entry.packed.values.shape), entry.packed.meta,
                                           values.detach().contiguous(), meta, idx, n, m, v, glu, R, C,
                                           stream=current_stream(values))
            elif entry.src.dtype == torch.int32:
                # one gather (_C.format_gather): every place reads its value (padding: a source
                # past the values, read as 0) and the places are written in order
                _C.format_gather(entry.buf.view(-1), values.detach().contiguous(), entry.src,
                                 stream=current_stream(values))
            else:   # (2**31 places or more: torch's gather with int64 indices)
                flat = torch.cat((values.detach().reshape(-1), values.new_zeros(1)))
                torch.index_select(flat, 0, entry.src, out=entry.buf)
        entry.stamp = stamp
    return entry.packed


def _build_relayout(values: Any, meta: Any, idx: Optional[Any], fmt: SparseFormat,
                    shape3: Tuple[int, int, int], glu: bool, layout: str) -> _Relayout:
    """The new layout's meta (and idx) and, but for the transposed layout, the index map,
    from the mask alone: every value slot of the weight gets its flat index (+1, in two exact
    fp32 parts of 12 and 19 bits; for the transposed layout a one), unpacked (and transposed)
    and packed in the new layout under the same mask."""
    import torch
    E, R, C = shape3
    dims = PackedDims.of(fmt, E, R, C, glu)
    nv = dims.rp * (dims.cp // 2)
    if layout == "transposed":
        tfmt, tshape, tglu = SparseFormat.parse("2:4"), (E, C, R), False
    elif layout == "up":   # the up half's rows alone (a GLU half is whole row groups)
        tfmt, tshape, tglu = fmt, (E, R // 2, C), False
    else:
        tfmt, tshape, tglu = fmt, (E, R, C), False
    tdims = PackedDims.of(tfmt, *tshape, tglu)
    dev = values.device
    ntv = tdims.rp * (tdims.cp // 2)
    itype = torch.int64 if max(E * nv, E * ntv) >= 2**31 - 1 else torch.int32
    # E * nv: the appended zero; the transposed packing needs no map (_C.format_transpose_values)
    src_of_place = None if layout == "transposed" else torch.full((E * ntv,), E * nv, dtype=itype, device=dev)
    tmeta = torch.empty((E, tdims.rp // 16, tdims.cp // 32, 16), dtype=torch.uint32, device=dev)
    tidx = torch.empty((E, tdims.slices, tdims.rp), dtype=torch.uint8, device=dev) if tfmt.selects_rows else None
    # what is unpacked and packed again: every value slot's flat index + 1 in two exact fp32
    # parts (12 and 19 bits) for the map, or, for the transposed packing (no map), ones: where
    # the slots are is all its metadata needs
    if src_of_place is None:
        parts = (torch.ones((1, dims.rp, dims.cp // 2), device=dev),)
    else:
        coord = torch.arange(1, nv + 1, device=dev, dtype=torch.int64).reshape(1, dims.rp, dims.cp // 2)
        parts = ((coord >> 12).float(), (coord & 4095).float())
    chunk = max(1, (256 << 20) // max(1, R * C * 4 * 6))  # about 256 MiB of dense fp32 temporaries
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        n = e1 - e0
        sub_idx = None if idx is None else idx[e0:e1]
        dense = []
        for part in parts:
            pw = PackedWeight(part.expand(n, -1, -1).contiguous(), meta[e0:e1], sub_idx, fmt, (n, R, C), glu)
            d = unpack(pw)
            if layout == "transposed":
                d = d.transpose(1, 2).contiguous()
            elif layout == "up":
                d = d[:, R // 2:].contiguous()
            dense.append(d)
        m = dense[0] != 0
        for d in dense[1:]:
            m |= d != 0
        thi, *rest = (pack(d, tfmt, mask=m, glu=tglu) for d in dense)
        if src_of_place is not None:
            src = ((thi.values.long() << 12) + rest[0].values.long() - 1).reshape(-1)   # value of each place, or -1
            expert = torch.arange(e0, e1, device=dev, dtype=torch.int64).repeat_interleave(ntv)
            live = src >= 0
            src_of_place[e0 * ntv:e1 * ntv][live] = (src + expert * nv)[live].to(itype)
        tmeta[e0:e1] = thi.meta
        if tidx is not None:
            tidx[e0:e1] = thi.idx
    buf = torch.zeros(E * ntv, dtype=values.dtype, device=dev)
    packed = PackedWeight(buf.view(E, tdims.rp, tdims.cp // 2), tmeta, tidx, tfmt, tshape, tglu)
    return _Relayout(packed, buf, src_of_place)


def _bytes(n: int) -> str:
    """1.5 KiB, 3.2 MiB, 640 B: what a repr says of a size."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def mask(w: Any, fmt: FormatLike, scores: Optional[Any] = None) -> Any:
    """The best mask of ``fmt`` for the saliency ``scores`` (default ``|w|``).

    ``w``: ``[R, C]`` or ``[E, R, C]`` float (torch, numpy or cupy; CPU or CUDA).
    For every ``v``-slice of every group of ``m`` rows, the ``n`` rows with the
    largest 2:4-pruned saliency are kept, and in each kept row the 2 largest of
    every 4.  Ties go to the lower index.  Returns a bool array shaped like w.
    """
    fmt = SparseFormat.parse(fmt)
    w = tensor_arg(w, "w")
    scores = tensor_arg(scores, "scores", optional=True)
    out = empty(w, w.shape, "bool")
    n, m, v = fmt.c_args()
    _C.format_mask(expand3(out), expand3(w), None if scores is None else expand3(scores), n, m, v,
                   stream=current_stream(w))
    return out


def pack(w: Any, fmt: FormatLike = "samoyeds-1:2:128", mask: Optional[Any] = None,
         glu: bool = False) -> PackedWeight:
    """Packs ``w`` (``[R, C]`` or ``[E, R, C]``, bf16/fp16/fp32) into the format.

    ``mask`` (bool/uint8, same shape) says which weights to keep; it must fit the
    format (at most n of every m rows per slice, at most 2 of every 4 columns);
    None computes the magnitude mask.  ``glu=True`` packs a fused gate_up matrix
    (gate rows first, then up rows) for the gated-activation epilogue.
    ``unpack(pack(w, fmt, mask))`` equals ``where(mask, w, 0)`` exactly.
    """
    fmt = SparseFormat.parse(fmt)
    w = tensor_arg(w, "w")
    check_dtype(w, "w", PACK_DTYPES)  # (before the mask, whose saliencies may also be float64)
    if mask is None:
        mask = globals()["mask"](w, fmt)
    mask = tensor_arg(mask, "mask")
    if len(w.shape) != 2:
        check_ndim(w, "w", 3)
    E, R, C = expand3(w).shape
    d = PackedDims.of(fmt, E, R, C, glu, "w")
    dt = dtype_name(w)
    values = empty(w, (E, d.rp, d.cp // 2), dt)
    meta = empty(w, (E, d.rp // 16, d.cp // 32, 16), "uint32")
    idx = empty(w, (E, d.slices, d.rp), "uint8") if fmt.selects_rows else None
    n, m, v = fmt.c_args()
    _C.format_pack(values, meta, idx, expand3(w), expand3(mask), n, m, v, glu, stream=current_stream(w))
    return PackedWeight(values, meta, idx, fmt, tuple(w.shape), glu)


def unpack(packed: PackedWeight) -> Any:
    """The masked dense weight held by ``packed`` (its logical shape and dtype)."""
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"packed: expected a PackedWeight, got {type(packed).__name__}")
    E, R, C = packed.shape3
    out = empty(packed.values, (E, R, C), packed.dtype)
    _C.format_unpack(out, packed.values, packed.meta, packed.idx, *packed.c_args(),
                     stream=current_stream(packed.values))
    return out[0] if len(packed.shape) == 2 else out
