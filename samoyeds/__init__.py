"""samoyeds: Mixture-of-Experts on Sparse Tensor Cores.

Expert weights are pruned to the Samoyeds format (vector-wise N:M row
selection + 2:4) and multiplied on sparse tensor cores against only the tokens
routed to each expert, read by index from the unpermuted activations.

What stays tunable (kernel tile and token rows, decode thresholds, PDL) is one
:class:`Config` in force, read with :func:`get_config` and changed with
``samoyeds.config(...)``: for the process, or for a scope as ``with samoyeds.config(...)``
(samoyeds/_config.py).
"""
from __future__ import annotations

try:
    from . import _C
except ImportError as _exc:  # the source tree, not the installed package, is first on sys.path
    import os as _os

    if not any(f.startswith("_C.") for f in _os.listdir(_os.path.dirname(__file__))):
        raise ImportError(
            f"samoyeds: {_os.path.dirname(__file__)} has no compiled extension (_C): this is the source "
            "tree, which shadows the installed package. Run the 'samoyeds' command or import samoyeds "
            "from another folder, or build in place with 'pip install -e .'") from _exc
    raise
from ._C import CudaError
from ._config import Config, get as get_config, override as config
from .format import PRESETS, SparseFormat
from .ops import Routing, combine, dense_decode, gather_weights, glu, route, router, ssmm
from .packed import PackedWeight, mask, pack, unpack
from .token_rounding import token_rounding

from ._hf_hook import install as _install_hf_hook

__version__ = _C.__version__
_install_hf_hook()  # transformers finds quant_method "samoyeds" once it loads its quantizers

__all__ = [
    "Config", "CudaError", "PRESETS", "PackedWeight", "PatchedModelError", "Routing", "SamoyedsConfig", "SparseFormat", "__version__", "build_info",
    "combine", "config", "cuda_available", "dense_decode", "finetune", "freeze_experts", "from_pretrained",
    "gather_weights", "get_config", "glu",
    "is_patched", "mask", "moe_forward", "pack", "patch_model", "route", "router", "save_pretrained", "sparsify_model",
    "ssmm", "to_dense", "token_rounding", "unpack", "unpatch_model",
]

# Loaded on first use, so that ``import samoyeds`` imports neither torch nor transformers.
_LAZY = {
    "patch_model": "hf", "unpatch_model": "hf", "to_dense": "hf", "is_patched": "hf", "freeze_experts": "hf",
    "finetune": "finetuning",
    "sparsify_model": "sparsify", "save_pretrained": "checkpoint", "from_pretrained": "checkpoint",
    "moe_forward": "moe", "SamoyedsConfig": "hf.quantizer", "PatchedModelError": "hf",
    "hf": None, "moe": None, "torch_ops": None, "sparsify": None, "checkpoint": None, "finetuning": None,
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
        return mod if _LAZY[name] is None else getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cuda_available() -> bool:
    """True when the CUDA kernels are compiled in and a CUDA device is usable."""
    return bool(_C.WITH_CUDA) and _C.cuda_device_count() > 0


def build_info() -> dict:
    """How this build was made: version, CUDA kernels, architectures, CUDA runtime,
    packed layout version, DLPack version, and whether a GPU is usable now."""
    info = dict(_C.build_info())
    info["cuda_available"] = cuda_available()
    info["cuda_devices"] = _C.cuda_device_count()
    return info
