"""samoyeds: Mixture-of-Experts on Sparse Tensor Cores.

Expert weights are pruned to the Samoyeds format (vector-wise N:M row
selection + 2:4) and multiplied on sparse tensor cores against only the tokens
routed to each expert, read by index from the unpermuted activations.
"""
from __future__ import annotations

from . import _C
from ._C import CudaError
from .format import PRESETS, SparseFormat
from .ops import Routing, combine, gather_weights, route, ssmm
from .packed import PackedWeight, mask, pack, unpack

__version__ = _C.__version__

__all__ = [
    "CudaError", "PRESETS", "PackedWeight", "Routing", "SparseFormat", "__version__", "build_info",
    "combine", "cuda_available", "gather_weights", "mask", "pack", "route", "ssmm", "unpack",
]


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
