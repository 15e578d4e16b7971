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
from ._array import check_model
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
    check_model(model)
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
#
# Every byte of a checkpoint is untrusted input: the header names no code to run (the model
# class comes from an allow-list), and every tensor is checked (name, kind, shape, dtype, and
# the values the kernels index with) before the model is returned, so nothing that reaches the
# C extension later can be out of range.  Any problem is a CheckpointError naming the file and
# the field.

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BOOL_FIELDS = ("transposed", "interleaved", "bias")
_INT_FIELDS = ("num_experts", "hidden", "intermediate")


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


def _json(meta: dict, file: str, key: str, kind: type) -> Any:
    try:
        out = json.loads(meta[key])
    except KeyError:
        raise CheckpointError(f"{file}: no {key!r} in the samoyeds metadata") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: metadata {key!r} is malformed JSON ({e})") from e
    if not isinstance(out, kind):
        raise CheckpointError(f"{file}: metadata {key!r}: expected a JSON {kind.__name__}, got "
                              f"{type(out).__name__}")
    return out


def _check_module_entry(m: Any, i: int, file: str) -> None:
    where = f"{file}: metadata 'modules'[{i}]"
    if not isinstance(m, dict):
        raise CheckpointError(f"{where}: expected an object, got {type(m).__name__}")
    for k in _LAYOUT_FIELDS + ("name", "dtype"):
        if k not in m:
            raise CheckpointError(f"{where}: no field {k!r}")
    checks = [("name", lambda v: isinstance(v, str), "a string"),
              ("act", lambda v: isinstance(v, str), "a string"),
              ("dtype", lambda v: v in _DTYPES, f"one of {sorted(_DTYPES)}")]
    checks += [(k, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0")
               for k in _INT_FIELDS]
    checks += [(k, lambda v: isinstance(v, bool), "a bool") for k in _BOOL_FIELDS]
    checks += [(k, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and
                abs(v) != float("inf"), "a finite number") for k in ("alpha", "limit")]
    for k, ok, what in checks:
        if not ok(m[k]):
            raise CheckpointError(f"{where}.{k}: expected {what}, got {m[k]!r}")


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
    for key in ("format", "model_class"):
        if key not in meta:
            raise CheckpointError(f"{file}: malformed samoyeds metadata: no {key!r}")
    try:
        fmt = SparseFormat.parse(meta["format"])
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{file}: malformed samoyeds metadata 'format' ({type(e).__name__}: {e})") from e
    modules = _json(meta, file, "modules", list)
    for i, m in enumerate(modules):
        _check_module_entry(m, i, file)
    names = [m["name"] for m in modules]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{file}: metadata 'modules' names an experts module twice")
    aliases = _json(meta, file, "aliases", dict)
    for k, v in aliases.items():
        if not isinstance(v, str):
            raise CheckpointError(f"{file}: metadata 'aliases'[{k!r}]: expected a tensor name, got {v!r}")
    return {"format": fmt, "model_class": meta["model_class"], "modules": modules, "aliases": aliases}


def _allowed_classes(config: Any) -> List[str]:
    """Names of the transformers classes registered in transformers' auto mappings for
    config's model_type: the only classes a checkpoint's header may name."""
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    names = set()
    for attr in dir(modeling_auto):
        table = getattr(modeling_auto, attr) if attr.endswith("_MAPPING_NAMES") else None
        if isinstance(table, dict) and isinstance(model_type, str):
            v = table.get(model_type)
            names.update(n for n in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(n, str))
    return sorted(names)


def _model_class(config: Any, name: Any, file: str) -> type:
    """The transformers model class the header names, resolved only through transformers'
    auto mappings for the config's model_type (never an arbitrary attribute)."""
    import transformers

    allowed = _allowed_classes(config)
    if not isinstance(name, str) or name not in allowed:
        raise CheckpointError(f"{file}: metadata 'model_class' = {name!r} is not a transformers model class for "
                              f"model_type {getattr(config, 'model_type', None)!r} of config.json in transformers "
                              f"{transformers.__version__} (expected one of {allowed}); pass model_class=")
    try:
        cls = getattr(transformers, name)
    except Exception as e:  # a lazy import of the model's module can fail on missing dependencies
        raise CheckpointError(f"{file}: metadata 'model_class' = {name!r} cannot be imported from transformers "
                              f"({type(e).__name__}: {e}); pass model_class=") from e
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
            and cls.__module__.startswith("transformers.models.")):
        raise CheckpointError(f"{file}: metadata 'model_class' = {name!r} is not a transformers PreTrainedModel")
    return cls


def _check_codes(pw: PackedWeight, file: str, key: str) -> None:
    """Row indices below m, increasing within a group, and valid 2:4 codes: what the
    kernels index with (the checks of csrc/format_ref.c's sam_format_check_ref)."""
    fmt = pw.fmt
    if pw.idx is not None:
        bad = pw.idx >= fmt.m
        if bool(bad.any()):
            e, j, r = (int(i) for i in bad.nonzero()[0])
            raise CheckpointError(f"{file}: {key}_idx[{e}, {j}, {r}] = {int(pw.idx[e, j, r])}; expected a row "
                                  f"index below m = {fmt.m}")
        d = pw.dims
        halves = 2 if pw.glu else 1
        rc = d.R // halves // fmt.m * fmt.n  # condensed (live) rows of a half
        if fmt.n > 1 and rc > 0 and d.slices > 0:
            q = torch.arange(rc, device=pw.idx.device)
            for h in range(halves):
                p = (q // _C.GLU_CHUNK * 2 + h) * _C.GLU_CHUNK + q % _C.GLU_CHUNK if pw.glu else q
                sel = pw.idx[:, :, p].reshape(d.E, d.slices, rc // fmt.n, fmt.n)
                bad = sel[..., 1:] <= sel[..., :-1]
                if bool(bad.any()):
                    e, j, g, s = (int(i) for i in bad.nonzero()[0])
                    p0, p1 = int(p[g * fmt.n + s]), int(p[g * fmt.n + s + 1])
                    raise CheckpointError(
                        f"{file}: {key}_idx[{e}, {j}, {p0}] = {int(pw.idx[e, j, p0])} and [{e}, {j}, {p1}] = "
                        f"{int(pw.idx[e, j, p1])}: the rows one group keeps must increase")
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


def _slot(model: nn.Module, name: str, file: str, what: str) -> Tuple[nn.Module, str, torch.Tensor, str]:
    """(module, attribute, current tensor, "parameter" | "buffer") of a tensor of the model."""
    mod_name, _, attr = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        raise CheckpointError(f"{file}: {what} {name!r} names no module of {type(model).__name__}") from None
    if attr in mod._parameters and mod._parameters[attr] is not None:
        return mod, attr, mod._parameters[attr], "parameter"
    if attr in mod._buffers and mod._buffers[attr] is not None:
        return mod, attr, mod._buffers[attr], "buffer"
    raise CheckpointError(f"{file}: {what} {name!r} is not a parameter or buffer of {type(model).__name__}")


def _check_value(old: torch.Tensor, value: torch.Tensor, name: str, file: str, what: str,
                 dtype: torch.dtype) -> None:
    """value may replace old: the same shape, and old's dtype or, for a floating tensor,
    the experts' dtype (the model's: the one config.json does not record)."""
    if tuple(old.shape) != tuple(value.shape):
        raise CheckpointError(f"{file}: {what} {name!r} has shape {tuple(value.shape)}; the model built from "
                              f"config.json expects {tuple(old.shape)}")
    if value.dtype != old.dtype and not (old.dtype.is_floating_point and value.dtype == dtype):
        raise CheckpointError(f"{file}: {what} {name!r} has dtype {value.dtype}; the model expects "
                              f"{old.dtype if not old.dtype.is_floating_point else f'{dtype} (that of the experts)'}")


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, file: str, dtype: torch.dtype,
                kind: Optional[str] = None) -> None:
    mod, attr, old, got = _slot(model, name, file, "tensor")
    if kind is not None and got != kind:
        raise CheckpointError(f"{file}: tensor {name!r} is a {got} of the model; expected a {kind}")
    _check_value(old, value, name, file, "tensor", dtype)
    if got == "parameter":
        mod._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad and value.is_floating_point())
    else:
        mod._buffers[attr] = value


def _check_config_size(config: Any, file: str, mfile: str, device: str) -> None:
    """Layers are built one by one (on the meta device, but each costs Python time): a
    config.json cannot ask for more layers than model.safetensors holds tensors (every
    layer has at least its norm's)."""
    with _open(mfile, device) as mf:
        stored = len(mf.keys())
    configs = [config]
    for attr in ("text_config", "vision_config"):
        sub = getattr(config, attr, None)
        if sub is not None and sub is not config:
            configs.append(sub)
    for c in configs:
        layers = getattr(c, "num_hidden_layers", None)
        if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 0
                                   or layers > stored):
            raise CheckpointError(f"{file}: num_hidden_layers = {layers!r}; expected an int between 0 and the "
                                  f"{stored} tensors of {MODEL_FILE}")


def _build(cls: type, config: Any, file: str) -> nn.Module:
    try:
        with torch.device("meta"):
            model = cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
    except Exception as e:  # transformers' own errors for a config its class cannot take
        raise CheckpointError(f"{file}: {cls.__name__} cannot be built from config.json "
                              f"({type(e).__name__}: {e})") from e
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"{file}: {cls.__name__}(config) is not a torch module")
    return model


def from_pretrained(path: PathLike, *, device: Union[str, torch.device, None] = None,
                    model_class: Optional[type] = None, router: bool = True, shared_stream: bool = True,
                    shared_stream_min_rows: int = 4096) -> nn.Module:
    """Rebuilds a model written by :func:`save_pretrained`, its experts packed.

    The model is built from ``config.json`` on the meta device; the packed arrays
    are read straight into the experts modules' buffers and the other tensors
    into their Parameters, so no dense expert weight is ever created.  The files
    are untrusted input: the header's model class must be one that transformers'
    auto mappings give for the config's ``model_type``, and every tensor is
    checked (name, shape, dtype, row indices and 2:4 codes) before the model is
    returned.

    Args:
        path: the checkpoint directory.
        device: where the tensors are read to (default CPU).
        model_class: the transformers class to build (default: the class that was
            saved, among those transformers maps the config's ``model_type`` to).
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
    if model_class is not None and not isinstance(model_class, type):
        raise TypeError(f"model_class: expected a class, got {type(model_class).__name__}")
    path = os.fspath(path)
    dev = str(torch.device(device)) if device is not None else "cpu"
    efile, mfile = os.path.join(path, EXPERTS_FILE), os.path.join(path, MODEL_FILE)
    cfile = os.path.join(path, "config.json")
    if not os.path.isfile(cfile):
        raise FileNotFoundError(f"{path}: no config.json (is this a samoyeds checkpoint directory?)")
    if not os.path.isfile(mfile):
        raise FileNotFoundError(f"{mfile}: no such file (is this a samoyeds checkpoint directory?)")
    with _open(efile, dev) as ef:
        head = _header(ef, efile)
        fmt: SparseFormat = head["format"]
        try:
            config = transformers.AutoConfig.from_pretrained(path)
        except Exception as e:  # json, unknown model_type, remote code: transformers' own error types
            raise CheckpointError(f"{cfile}: not a transformers config ({type(e).__name__}: {e})") from e
        cls = model_class or _model_class(config, head["model_class"], efile)
        _check_config_size(config, cfile, mfile, dev)
        model = _build(cls, config, cfile)
        model.eval()

        targets = _experts.find_experts(model)
        stored = {m["name"]: m for m in head["modules"]}
        names = [t.name for t in targets]
        if sorted(names) != sorted(stored):
            raise CheckpointError(f"{efile}: holds experts modules {sorted(stored)}; the model built from "
                                  f"config.json has {sorted(names)}")
        dtypes = {m["dtype"] for m in head["modules"]}
        if len(dtypes) > 1:
            raise CheckpointError(f"{efile}: metadata 'modules' gives experts modules several dtypes "
                                  f"{sorted(dtypes)}")
        dtype = _DTYPES[dtypes.pop()] if dtypes else torch.get_default_dtype()
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
                if v.dtype != dtype:
                    raise CheckpointError(f"{efile}: {key}_values has dtype {v.dtype}; the experts module's "
                                          f"metadata 'dtype' is {s['dtype']!r}")
                try:
                    pw = PackedWeight(v, m, ix, fmt, shape, glu=glu)
                except ValueError as e:
                    raise CheckpointError(f"{efile}: {key}: {e}") from e
                _check_codes(pw, efile, key)
            bias = got["samoyeds_gate_up_bias"]
            if bias is not None and (tuple(bias.shape) != (E, 2 * I) or bias.dtype != dtype):
                raise CheckpointError(f"{efile}: {t.name}.samoyeds_gate_up_bias is {bias.dtype} {tuple(bias.shape)}; "
                                      f"expected {dtype} {(E, 2 * I)} (the experts' dtype)")
            arrays[t.name] = got
        buffers = {k[len(_BUFFERS):]: _read(ef, efile, k) for k in sorted(keys) if k.startswith(_BUFFERS)}
        expected = {key for t in targets for key in _expert_keys(t.name, layouts[t.name]).values()}
        stray = sorted(k for k in keys if not k.startswith(_BUFFERS) and k not in expected)
        if stray:
            raise CheckpointError(f"{efile}: unexpected tensors {stray[:5]}")

    persistent = set(model.state_dict())
    for name in buffers:
        if name in persistent or name in expected:
            raise CheckpointError(f"{efile}: tensor {_BUFFERS + name!r} names a tensor of the model's state_dict; "
                                  "expected a non-persistent buffer")
    with _open(mfile, dev) as mf:
        dense = {k: _read(mf, mfile, k) for k in sorted(mf.keys())}
    for key in dense:
        if key in expected:
            raise CheckpointError(f"{mfile}: tensor {key!r} is a packed experts array; expected it in "
                                  f"{EXPERTS_FILE} only")
    for alias, source in head["aliases"].items():
        if alias in dense or alias in buffers:
            raise CheckpointError(f"{efile}: metadata 'aliases': {alias!r} is stored and aliased")
        if source not in dense:
            raise CheckpointError(f"{efile}: metadata 'aliases': {alias!r} -> {source!r}: expected a tensor of "
                                  f"{MODEL_FILE}")
        if alias in expected:
            raise CheckpointError(f"{efile}: metadata 'aliases': {alias!r} is a packed experts array")
    # every check that needs the meta model's own tensors, before any is replaced
    for key, value in dense.items():
        _, _, old, _ = _slot(model, key, mfile, "tensor")
        _check_value(old, value, key, mfile, "tensor", dtype)
    for name, value in buffers.items():
        _, _, old, kind = _slot(model, name, efile, "tensor")
        if kind != "buffer":
            raise CheckpointError(f"{efile}: tensor {_BUFFERS + name!r} names a {kind}; expected a buffer")
        _check_value(old, value, name, efile, "tensor", dtype)
    for alias, source in head["aliases"].items():
        _, _, old, kind = _slot(model, alias, efile, "alias")
        _, _, src_old, src_kind = _slot(model, source, efile, "alias source")
        if kind != src_kind:
            raise CheckpointError(f"{efile}: alias {alias!r} -> {source!r}: a {kind} cannot share a {src_kind}")
        _check_value(old, dense[source], alias, efile, "alias", dtype)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    if isinstance(emb_w, torch.Tensor):
        name = next((n for n, p in model.named_parameters(remove_duplicate=False) if p is emb_w), None)
        src = dense.get(name, dense.get(head["aliases"].get(name, "")))
        if src is not None and src.dtype != dtype:
            raise CheckpointError(f"{mfile}: tensor {name!r} (the input embeddings: the hidden states' dtype) "
                                  f"is {src.dtype}; the experts are {dtype}")

    for t in targets:
        mod, layout = t.experts, layouts[t.name]
        for proj in _experts.PROJS:
            delattr(mod, f"{proj}_proj")
        if layout.bias:
            delattr(mod, "gate_up_proj_bias")
        got = arrays[t.name]
        for proj in _experts.PROJS:
            _experts.set_arrays(mod, proj, *(got[f"samoyeds_{proj}_{a}"] for a in _experts.ARRAYS),
                                layout.requires_grad)
        _experts.set_bias(mod, got["samoyeds_gate_up_bias"], layout.requires_grad)
        mod._samoyeds = layout
        if t.block is not None:
            t.block.__class__ = _llama4.patched_class(type(t.block))

    for key, value in dense.items():
        _set_tensor(model, key, value, mfile, dtype)
    for name, value in buffers.items():
        _set_tensor(model, name, value, efile, dtype, kind="buffer")
    for alias, source in head["aliases"].items():
        mod, attr, _, kind = _slot(model, alias, efile, "alias")
        _, _, src, _ = _slot(model, source, efile, "alias source")
        (mod._parameters if kind == "parameter" else mod._buffers)[attr] = src
    left = [n for n, x in list(model.named_parameters()) + list(model.named_buffers()) if x.device.type == "meta"]
    if left:
        raise CheckpointError(f"{path}: the checkpoint holds no value for {left[:5]}"
                              + (f" and {len(left) - 5} more" if len(left) > 5 else ""))

    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file) and hasattr(model, "generation_config"):
        try:
            model.generation_config = transformers.GenerationConfig.from_pretrained(path)
        except Exception as e:  # transformers' own error types for a malformed file
            raise CheckpointError(f"{gen_file}: not a transformers generation config ({type(e).__name__}: {e})") \
                from e
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
