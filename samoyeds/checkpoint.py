"""Packed checkpoints: a patched ``transformers`` model saved with its experts in
the Samoyeds format, and rebuilt from them without ever creating dense expert
weights (docs/CHECKPOINT.md).

A checkpoint is a directory:

* ``config.json`` (and ``generation_config.json``): transformers' own files;
* ``model.safetensors``: every tensor of the model's ``state_dict`` except the
  packed experts, under its transformers name (tied weights once);
* ``samoyeds_experts.safetensors``: the packed experts (values, metadata, row
  indices, GLU biases) under their module's buffer names, the model's
  non-persistent buffers under ``buffers/<name>``, and the header metadata: the
  checkpoint and packed-layout versions, the format and every experts module's
  layout.

Reading builds the model on the meta device (no storage), installs the packed
arrays and loads the rest; every array is checked (names, shapes, dtypes, the
row indices and 2:4 codes) before the model is returned, and any problem raises
:class:`CheckpointError` naming the file and the tensor.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from . import _C
from . import hf as _hf
from .hf import experts as _experts, llama4 as _llama4
from .format import SparseFormat
from .packed import PackedWeight

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "EXPERTS_FILE", "MODEL_FILE", "checkpoint_sizes",
           "from_pretrained", "save_pretrained"]

#: Version of the checkpoint's file schema (file names, tensor names, metadata keys).
CHECKPOINT_VERSION = 1
EXPERTS_FILE = "samoyeds_experts.safetensors"
MODEL_FILE = "model.safetensors"
_BUFFERS = "buffers/"
_LAYOUT_FIELDS = ("num_experts", "hidden", "intermediate", "act", "alpha", "limit", "transposed", "interleaved",
                  "bias")
_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the six 2:4 codes i0 | i1 << 2 with i0 < i1
_VALID_NIBBLES = torch.zeros(16, dtype=torch.bool)
_VALID_NIBBLES[[0x4, 0x8, 0xC, 0x9, 0xD, 0xE]] = True

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(ValueError):
    """A samoyeds checkpoint is corrupt, of another version, or does not match its model."""


def _expert_keys(name: str, p: "_experts.ExpertsPatch") -> Dict[str, str]:
    """Buffer name -> state_dict key of one patched experts module's arrays."""
    names = [f"samoyeds_{proj}_{a}" for proj in _experts.PROJS for a in _experts.ARRAYS]
    names.append("samoyeds_gate_up_bias")
    return {n: f"{name}.{n}" if name else n for n in names}


def _storage_key(t: torch.Tensor) -> Tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def save_pretrained(model: nn.Module, path: PathLike) -> None:
    """Writes a model patched by :func:`samoyeds.patch_model` (or
    :func:`samoyeds.sparsify_model`) to the directory ``path``.

    Args:
        model: a transformers model whose experts modules are all patched.  Its
            tensors may be on any device; they are written from host copies.
        path: the directory (created if needed; files of the same names are replaced).
    Raises:
        ValueError: the model is not patched (or only partly).
        NotImplementedError: its shared experts are packed too (``patch_model(...,
            shared_experts=True)``): checkpoints hold packed routed experts only.
    """
    from safetensors.torch import save_file

    shared = _hf.packed_shared(model)
    if shared:
        raise NotImplementedError(
            f"{type(model).__name__}: shared experts {[n for n, _, _ in shared][:2]} are packed "
            "(patch_model(..., shared_experts=True)); samoyeds checkpoints hold packed routed experts only: "
            "save the model patched without shared_experts=True")

    targets = _experts.find_experts(model)
    patched = [t for t in targets if getattr(t.experts, "_samoyeds", None) is not None]
    if not patched:
        raise ValueError(f"{type(model).__name__} has no experts module packed by samoyeds; call "
                         "samoyeds.patch_model(model) or samoyeds.sparsify_model(model, ...) first")
    if len(patched) != len(targets):
        missing = [t.name for t in targets if t not in patched]
        raise ValueError(f"{type(model).__name__}: experts modules {missing} are not packed")
    fmts = {t.experts._samoyeds.fmt for t in patched}
    if len(fmts) != 1:
        raise ValueError(f"{type(model).__name__}: experts modules use several formats {sorted(f.name for f in fmts)}")
    fmt = fmts.pop()
    os.makedirs(path, exist_ok=True)

    state = model.state_dict()
    experts: Dict[str, torch.Tensor] = {}
    modules: List[dict] = []
    for t in patched:
        p: _experts.ExpertsPatch = t.experts._samoyeds
        keys = _expert_keys(t.name, p)
        for key in keys.values():
            if key in state:
                experts[key] = state.pop(key)
        info = {f: getattr(p, f) for f in _LAYOUT_FIELDS}
        info.update(name=t.name, dtype=str(t.experts.samoyeds_gate_up_values.dtype).replace("torch.", ""))
        modules.append(info)

    rest: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    seen: Dict[Tuple, str] = {}
    for key, tensor in state.items():
        sk = _storage_key(tensor)
        if sk in seen:
            aliases[key] = seen[sk]
            continue
        seen[sk] = key
        rest[key] = tensor
    persistent = set(state) | set(experts)
    buffers = {f"{_BUFFERS}{n}": b for n, b in model.named_buffers() if n not in persistent and b is not None}

    def host(d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu").contiguous() for k, v in d.items()}

    meta = {
        "samoyeds_checkpoint_version": str(CHECKPOINT_VERSION),
        "samoyeds_layout_version": str(_C.LAYOUT_VERSION),
        "samoyeds_version": str(_C.__version__),
        "format": fmt.name,
        "model_class": type(model).__name__,
        "modules": json.dumps(modules),
        "aliases": json.dumps(aliases),
    }
    save_file(host(rest), os.path.join(path, MODEL_FILE), metadata={"format": "pt"})
    save_file({**host(experts), **host(buffers)}, os.path.join(path, EXPERTS_FILE), metadata=meta)
    model.config.save_pretrained(path)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(model, "can_generate") and model.can_generate():
        gen.save_pretrained(path)


# --- reading --------------------------------------------------------------------------------------

def _open(file: str, device: str):
    from safetensors import safe_open

    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: no such file (is this a samoyeds checkpoint directory?)")
    try:
        return safe_open(file, framework="pt", device=device)
    except Exception as e:  # safetensors raises its own error type for a bad header
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def _read(f, file: str, key: str) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except Exception as e:
        raise CheckpointError(f"{file}: tensor {key!r} cannot be read ({type(e).__name__}: {e})") from e


def _header(f, file: str) -> dict:
    meta = f.metadata() or {}
    version = meta.get("samoyeds_checkpoint_version")
    if version is None:
        raise CheckpointError(f"{file}: no 'samoyeds_checkpoint_version' in the header; not written by "
                              "samoyeds.save_pretrained")
    if version != str(CHECKPOINT_VERSION):
        raise CheckpointError(f"{file}: checkpoint version {version}; this samoyeds reads version "
                              f"{CHECKPOINT_VERSION}")
    layout = meta.get("samoyeds_layout_version")
    if layout != str(_C.LAYOUT_VERSION):
        raise CheckpointError(f"{file}: packed with layout version {layout}; this samoyeds reads layout version "
                              f"{_C.LAYOUT_VERSION} (repack the model from dense weights)")
    try:
        out = {"format": SparseFormat.parse(meta["format"]), "model_class": meta["model_class"],
               "modules": json.loads(meta["modules"]), "aliases": json.loads(meta["aliases"])}
        for m in out["modules"]:
            for k in _LAYOUT_FIELDS + ("name", "dtype"):
                m[k]  # noqa: B018 (presence check)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: malformed samoyeds metadata ({type(e).__name__}: {e})") from e
    return out


def _check_codes(pw: PackedWeight, file: str, key: str) -> None:
    """Row indices below m and valid 2:4 codes: what the kernels index with."""
    fmt = pw.fmt
    if pw.idx is not None:
        bad = pw.idx >= fmt.m
        if bool(bad.any()):
            e, j, r = (int(i) for i in bad.nonzero()[0])
            raise CheckpointError(f"{file}: {key}_idx[{e}, {j}, {r}] = {int(pw.idx[e, j, r])}; expected a row "
                                  f"index below m = {fmt.m}")
    table = _VALID_NIBBLES.to(pw.meta.device)
    shifts = torch.arange(0, 32, 4, device=pw.meta.device, dtype=torch.int32)
    for e in range(pw.meta.shape[0]):
        words = pw.meta[e].view(torch.int32)
        nib = (words[..., None] >> shifts) & 0xF
        ok = table[nib.long()]
        if not bool(ok.all()):
            where = tuple(int(i) for i in (~ok).nonzero()[0])
            raise CheckpointError(f"{file}: {key}_meta[{e}, {', '.join(map(str, where[:-1]))}] holds the invalid "
                                  f"2:4 code 0x{int(nib[where]):x} in nibble {where[-1]}")


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, file: str) -> None:
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        raise CheckpointError(f"{file}: tensor {name!r} names no module of {type(model).__name__}") from None
    if attr in mod._parameters and mod._parameters[attr] is not None:
        old = mod._parameters[attr]
        kind = "parameter"
    elif attr in mod._buffers and mod._buffers[attr] is not None:
        old = mod._buffers[attr]
        kind = "buffer"
    else:
        raise CheckpointError(f"{file}: tensor {name!r} is not a parameter or buffer of {type(model).__name__}")
    if tuple(old.shape) != tuple(value.shape):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(value.shape)}; the model built from "
                              f"config.json expects {tuple(old.shape)}")
    if kind == "parameter":
        mod._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        mod._buffers[attr] = value


def from_pretrained(path: PathLike, *, device: Union[str, torch.device, None] = None,
                    model_class: Optional[type] = None, router: bool = True, shared_stream: bool = True,
                    shared_stream_min_rows: int = 4096) -> nn.Module:
    """Rebuilds a model written by :func:`save_pretrained`, its experts packed.

    The model is built from ``config.json`` on the meta device; the packed arrays
    are read straight into the experts modules' buffers and the other tensors
    into their Parameters, so no dense expert weight is ever created.

    Args:
        path: the checkpoint directory.
        device: where the tensors are read to (default CPU).
        model_class: the transformers class to build (default: the class that was
            saved, looked up in ``transformers``).
        router, shared_stream, shared_stream_min_rows: as :func:`samoyeds.patch_model`'s.
    Returns:
        The model in eval mode, patched (``experts_implementation="samoyeds"``; unpruned
        shared experts on the dense decode path, as :func:`samoyeds.patch_model` leaves them).
    Raises:
        FileNotFoundError: a file of the checkpoint is missing.
        CheckpointError: a file is corrupt or truncated, of another checkpoint or
            layout version, or does not match the model its config builds.
    """
    import transformers

    _hf.check_options(router, shared_stream, shared_stream_min_rows)
    path = os.fspath(path)
    dev = str(torch.device(device)) if device is not None else "cpu"
    efile, mfile = os.path.join(path, EXPERTS_FILE), os.path.join(path, MODEL_FILE)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json (is this a samoyeds checkpoint directory?)")
    with _open(efile, dev) as ef:
        head = _header(ef, efile)
        fmt: SparseFormat = head["format"]
        config = transformers.AutoConfig.from_pretrained(path)
        cls = model_class or getattr(transformers, head["model_class"], None)
        if cls is None:
            raise CheckpointError(f"{efile}: model class {head['model_class']!r} is not in transformers "
                                  f"{transformers.__version__}; pass model_class=")
        with torch.device("meta"):
            model = cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
        model.eval()

        targets = _experts.find_experts(model)
        stored = {m["name"]: m for m in head["modules"]}
        names = [t.name for t in targets]
        if sorted(names) != sorted(stored):
            raise CheckpointError(f"{efile}: holds experts modules {sorted(stored)}; the model built from "
                                  f"config.json has {sorted(names)}")
        layouts: Dict[str, _experts.ExpertsPatch] = {}
        arrays: Dict[str, Dict[str, Optional[torch.Tensor]]] = {}
        keys = set(ef.keys())
        for t in targets:
            try:
                layout = _experts.experts_layout(t, model, fmt, allow_meta=True)
            except _hf.UnsupportedModelError as e:
                raise CheckpointError(f"{efile}: {e}") from e
            s = stored[t.name]
            for f in _LAYOUT_FIELDS:
                want, got = getattr(layout, f), s[f]
                if (f in ("alpha", "limit") and abs(float(want) - float(got)) > 1e-6) or \
                        (f not in ("alpha", "limit") and want != got):
                    raise CheckpointError(f"{efile}: experts module {t.name!r} was saved with {f} = {got!r}; the model "
                                          f"built from config.json has {f} = {want!r}")
            layouts[t.name] = layout
            got: Dict[str, Optional[torch.Tensor]] = {}
            for attr, key in _expert_keys(t.name, layout).items():
                optional = ((attr.endswith("_idx") and not fmt.selects_rows)
                            or (attr == "samoyeds_gate_up_bias" and not layout.bias))
                if key not in keys:
                    if optional:
                        got[attr] = None
                        continue
                    raise CheckpointError(f"{efile}: tensor {key!r} is missing")
                if optional:
                    raise CheckpointError(f"{efile}: tensor {key!r} is unexpected for format {fmt.name}"
                                          + ("" if fmt.selects_rows else " (plain 2:4 has no row indices)"))
                got[attr] = _read(ef, efile, key)
            E, H, I = layout.num_experts, layout.hidden, layout.intermediate
            for proj, shape, glu in (("gate_up", (E, 2 * I, H), True), ("down", (E, H, I), False)):
                key = f"{t.name}.samoyeds_{proj}"
                v, m, ix = (got[f"samoyeds_{proj}_{a}"] for a in _experts.ARRAYS)
                if v.dtype not in _VALUE_DTYPES or m.dtype != torch.uint32 or (ix is not None and ix.dtype != torch.uint8):
                    raise CheckpointError(
                        f"{efile}: {key}: expected values float32/bfloat16/float16, meta uint32, idx uint8; got "
                        f"{v.dtype}, {m.dtype}, {None if ix is None else ix.dtype}")
                try:
                    pw = PackedWeight(v, m, ix, fmt, shape, glu=glu)
                except ValueError as e:
                    raise CheckpointError(f"{efile}: {key}: {e}") from e
                _check_codes(pw, efile, key)
            if got["samoyeds_gate_up_bias"] is not None and tuple(got["samoyeds_gate_up_bias"].shape) != (E, 2 * I):
                raise CheckpointError(f"{efile}: {t.name}.samoyeds_gate_up_bias has shape "
                                      f"{tuple(got['samoyeds_gate_up_bias'].shape)}; expected {(E, 2 * I)}")
            arrays[t.name] = got
        buffers = {k[len(_BUFFERS):]: _read(ef, efile, k) for k in keys if k.startswith(_BUFFERS)}
        expected = {key for t in targets for key in _expert_keys(t.name, layouts[t.name]).values()}
        stray = sorted(k for k in keys if not k.startswith(_BUFFERS) and k not in expected)
        if stray:
            raise CheckpointError(f"{efile}: unexpected tensors {stray[:5]}")

    for t in targets:
        mod, layout = t.experts, layouts[t.name]
        for proj in _experts.PROJS:
            delattr(mod, f"{proj}_proj")
        if layout.bias:
            delattr(mod, "gate_up_proj_bias")
        for attr, value in arrays[t.name].items():
            mod.register_buffer(attr, value)
        mod._samoyeds = layout
        if t.block is not None:
            t.block.__class__ = _llama4.patched_class(type(t.block))

    with _open(mfile, dev) as mf:
        for key in mf.keys():
            _set_tensor(model, key, _read(mf, mfile, key), mfile)
    for name, value in buffers.items():
        _set_tensor(model, name, value, efile)
    for alias, source in head["aliases"].items():
        try:
            src = model.get_parameter(source)
        except AttributeError:
            try:
                src = model.get_buffer(source)
            except AttributeError:
                raise CheckpointError(f"{efile}: alias {alias!r} -> {source!r}: no such tensor") from None
        mod_name, _, attr = alias.rpartition(".")
        try:
            mod = model.get_submodule(mod_name) if mod_name else model
        except AttributeError:
            raise CheckpointError(f"{efile}: alias {alias!r} names no module") from None
        if attr in mod._parameters:
            mod._parameters[attr] = src
        elif attr in mod._buffers:
            mod._buffers[attr] = src
        else:
            raise CheckpointError(f"{efile}: alias {alias!r} is not a tensor of the model")
    left = [n for n, x in list(model.named_parameters()) + list(model.named_buffers()) if x.device.type == "meta"]
    if left:
        raise CheckpointError(f"{path}: the checkpoint holds no value for {left[:5]}"
                              + (f" and {len(left) - 5} more" if len(left) > 5 else ""))

    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file) and hasattr(model, "generation_config"):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    _experts.register()
    _hf.install(model, targets, dense_shared=True, router=router, shared_stream=shared_stream,
                shared_stream_min_rows=shared_stream_min_rows)
    _experts.set_implementation(model, [t.experts for t in targets if t.block is None], _experts.IMPLEMENTATION)
    return model


def checkpoint_sizes(path: PathLike) -> Dict[str, Any]:
    """Bytes of a checkpoint: its files, the packed expert arrays, and the dense
    expert weights they replace (``E * R * C`` in the packed values' dtype, for
    gate_up and down).  ``packed_fraction``: packed arrays / dense experts;
    ``file_fraction``: the whole experts file (header and non-persistent buffers
    included) / dense experts."""
    path = os.fspath(path)
    efile = os.path.join(path, EXPERTS_FILE)
    with _open(efile, "cpu") as ef:
        head = _header(ef, efile)
        arrays = 0
        for k in ef.keys():
            if not k.startswith(_BUFFERS):
                t = ef.get_slice(k)
                n = 1
                for s in t.get_shape():
                    n *= s
                arrays += n * {"F32": 4, "BF16": 2, "F16": 2, "U32": 4, "U8": 1}.get(t.get_dtype(), 4)
    dense = 0
    for m in head["modules"]:
        es = 4 if m["dtype"] == "float32" else 2
        dense += m["num_experts"] * 3 * m["hidden"] * m["intermediate"] * es
    files = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))
             if os.path.isfile(os.path.join(path, f))}
    return {"format": head["format"].name, "files": files, "experts_file_bytes": files[EXPERTS_FILE],
            "packed_arrays_bytes": arrays, "dense_experts_bytes": dense,
            "packed_fraction": arrays / dense if dense else None,
            "file_fraction": files[EXPERTS_FILE] / dense if dense else None}
