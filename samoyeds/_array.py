"""Framework-neutral helpers: the ops allocate outputs in the framework (and on
the device) of their inputs.  torch, numpy and cupy are recognised; torch is
never imported unless the caller already uses it."""
from __future__ import annotations

import sys
from typing import Any, Sequence

_NP_NAMES = {
    "bfloat16": None, "float16": "float16", "float32": "float32", "float64": "float64",
    "uint8": "uint8", "uint32": "uint32", "int32": "int32", "int64": "int64", "bool": "bool",
}


def framework(t: Any) -> str:
    mod = type(t).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod == "numpy":
        return "numpy"
    if mod == "cupy":
        return "cupy"
    raise TypeError(f"expected a torch, numpy or cupy array (the Python API allocates its outputs in the "
                    f"input's framework; samoyeds._C takes any DLPack producer), got {type(t).__name__}")


def dtype_name(t: Any) -> str:
    """'bfloat16', 'float16', 'float32', 'int32', ... for any supported array."""
    if not hasattr(t, "dtype"):
        framework(t)  # a TypeError naming what is accepted
    return str(t.dtype).replace("torch.", "")


def is_cuda(t: Any) -> bool:
    fw = framework(t)
    if fw == "torch":
        return t.is_cuda
    return fw == "cupy"


def empty(like: Any, shape: Sequence[int], dtype: str) -> Any:
    """An uninitialised array in like's framework and on like's device."""
    fw = framework(like)
    shape = tuple(int(s) for s in shape)
    if fw == "torch":
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if fw == "cupy":
        import cupy
        with like.device:
            return cupy.empty(shape, dtype=_np_dtype(dtype))
    import numpy as np
    return np.empty(shape, dtype=_np_dtype(dtype))


def zeros(like: Any, shape: Sequence[int], dtype: str) -> Any:
    out = empty(like, shape, dtype)
    out[...] = 0
    return out


def _np_dtype(name: str) -> str:
    np_name = _NP_NAMES.get(name)
    if np_name is None:
        raise TypeError(f"numpy has no {name}; use torch tensors for {name}")
    return np_name


_warned_no_backward = False


def warn_no_backward() -> None:
    """Warns once per process that a tensor requiring grad went into one of samoyeds'
    low-level ops (ssmm, glu, router, ...), which have no backward: the result carries no
    gradient.  (samoyeds.moe_forward and patched models train: docs/TRAINING.md.)"""
    global _warned_no_backward
    if _warned_no_backward:
        return
    _warned_no_backward = True
    import os
    import warnings
    # the warning points at the caller's line, not at samoyeds' or torch's dispatch
    inside = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (sys.modules[__package__], sys.modules.get("torch")) if m is not None)
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn("samoyeds: an input requires grad, but this low-level op has no backward: no gradient "
                  "flows through it (samoyeds.moe_forward and patched models have one; see docs/TRAINING.md). "
                  "Run under torch.no_grad() or torch.inference_mode(), or pass detached tensors, to silence "
                  "this warning (shown once).", UserWarning, stacklevel=level + 1)


def for_c(t: Any) -> Any:
    """What the C extension should receive: torch tensors detached (a Parameter
    refuses DLPack export otherwise; with grad enabled, warn_no_backward says so
    once); everything else as is."""
    if t is not None and type(t).__module__.startswith("torch") and getattr(t, "requires_grad", False):
        import torch
        if torch.is_grad_enabled():
            warn_no_backward()
        return t.detach()
    return t


def check_dtype(t: Any, name: str, allowed: Sequence[str]) -> None:
    """A TypeError worded as the extension words it when t's dtype is not one of
    ``allowed`` (for a wrapper whose first call into the extension takes more dtypes
    than a later one)."""
    got = dtype_name(t)
    if got not in allowed:
        want = allowed[0] if len(allowed) == 1 else ", ".join(allowed[:-1]) + " or " + allowed[-1]
        raise TypeError(f"{name}: expected dtype {want}, got {got}")


def tensor_arg(t: Any, name: str, optional: bool = False) -> Any:
    """for_c(t) for an argument whose shape the Python layer reads: a TypeError
    naming the argument (worded as the extension words it) when t is no tensor."""
    if t is None and optional:
        return None
    if not (hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__") and hasattr(t, "shape")):
        raise TypeError(f"{name}: expected a tensor supporting DLPack (__dlpack__ and __dlpack_device__), "
                        f"got {type(t).__name__}")
    return for_c(t)


def check_model(model: Any, name: str = "model") -> None:
    """A TypeError naming ``name`` unless ``model`` is a torch ``nn.Module`` (a model function
    handed something else would fail later with an AttributeError that names no argument)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name}: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")


def check_ndim(t: Any, name: str, ndim: int) -> None:
    """A ValueError worded as the extension words it when t is not ndim-d: for the
    wrappers that read a shape to allocate an output before the extension sees t."""
    if len(t.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got {len(t.shape)}-d with shape {tuple(t.shape)}")


def check_shape(t: Any, name: str, shape: Sequence[int], why: str = "") -> None:
    """A ValueError worded as the extension words it when t's shape is not shape
    (for relations the extension cannot see: logical shapes of packed weights)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}{why}, got {tuple(t.shape)}")


def expand3(t: Any) -> Any:
    """A 3-d view [1, R, C] of a 2-d array (3-d arrays unchanged)."""
    return t[None] if t.ndim == 2 else t


def current_stream(t: Any) -> int | None:
    """The stream the op should launch on for t: None lets the extension ask
    the producer (torch); cupy's current stream otherwise."""
    if framework(t) == "cupy":
        import cupy
        return cupy.cuda.get_current_stream().ptr or None
    return None


def torch_loaded() -> bool:
    return "torch" in sys.modules
