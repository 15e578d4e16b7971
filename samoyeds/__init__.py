"""samoyeds: Mixture-of-Experts on Sparse Tensor Cores.

Expert weights are pruned to the Samoyeds format (vector-wise N:M row
selection + 2:4) and multiplied on sparse tensor cores against only the tokens
routed to each expert, read by index from the unpermuted activations.
"""
from __future__ import annotations

from . import _C
from ._C import CudaError
from .format import PRESETS, SparseFormat
from .ops import Routing, combine, dense_decode, gather_weights, glu, route, router, ssmm
from .packed import PackedWeight, mask, pack, unpack
from .routing import token_rounding

__version__ = _C.__version__

__all__ = [
    "CudaError", "PRESETS", "PackedWeight", "Routing", "SparseFormat", "__version__", "build_info",
    "combine", "cuda_available", "dense_decode", "from_pretrained", "gather_weights", "glu", "mask", "moe_forward", "pack",
    "patch_model", "route", "router", "save_pretrained", "shared_fill_rate", "sparsify_model", "ssmm", "tensor_core_rate", "to_dense", "unpack",
    "unpatch_model",
]

# Loaded on first use, so that ``import samoyeds`` imports neither torch nor transformers.
_LAZY = {
    "patch_model": "hf", "unpatch_model": "hf", "to_dense": "hf",
    "sparsify_model": "sparsify", "save_pretrained": "checkpoint", "from_pretrained": "checkpoint",
    "moe_forward": "moe",
    "hf": None, "hf_families": None, "moe": None, "torch_ops": None, "sparsify": None, "checkpoint": None,
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
    packed layout version, DLPack version, whether the Hopper kernel reads the
    measurement switch SAMOYEDS_WS_DROP (``ws_drop``, docs/PERFORMANCE.md), and whether
    a GPU is usable now."""
    info = dict(_C.build_info())
    info["cuda_available"] = cuda_available()
    info["cuda_devices"] = _C.cuda_device_count()
    return info


def tensor_core_rate(kind: str, device: int = 0) -> float:
    """The rate at which ``device`` issues one tensor-core instruction form, in
    dense-equivalent TFLOP/s (bf16 inputs, fp32 accumulation).

    This is the ceiling for a kernel built on that instruction, measured on
    this device: every SM is kept busy with register-resident operands and
    independent accumulators, so only the tensor pipe limits the rate.
    ``kind`` is one of ``_C.TENSOR_CORE_KINDS``:

    * ``"mma"``: ``mma.sync`` m16n8k16 (sm_80 and later)
    * ``"mma_sp"``: ``mma.sp`` m16n8k32, 2:4 sparse A (sm_80 and later)
    * ``"wgmma"``: ``wgmma.mma_async`` m64n128k16, A in registers, B in shared
      memory (an sm_90 device and a build with sm_90a)
    * ``"wgmma_sp"``: ``wgmma.mma_async.sp`` m64n128k32, as ``"wgmma"``
    * ``"wgmma_sp_n64"``: ``wgmma.mma_async.sp`` m64n64k32, as ``"wgmma"``
    * ``"wgmma_sp_ss"``, ``"wgmma_sp_ss_n96"``, ``"wgmma_sp_ss_n64"``:
      ``wgmma.mma_async.sp`` m64n128k32 / m64n96k32 / m64n64k32 with the packed
      A tile read from shared memory through a descriptor, the forms the
      warp-specialised kernels issue; each warpgroup alternates two A tiles
      over one B k slice, as a 256-row tile's consumer does

    A sparse instruction counts the flops of its dense shape (m16n8k32 sparse:
    2*16*8*32), so the sparse kinds compare directly with the dense ones and
    with a sparse kernel's dense-equivalent TFLOP/s.  Takes under a tenth of a
    second on the legacy default stream and blocks until done; run it while
    the device is otherwise idle.

    Raises:
        ValueError: an unknown ``kind`` or ``device``.
        NotImplementedError: the device or this build cannot run ``kind``.
        RuntimeError: samoyeds was built without CUDA, or (``CudaError``) the
            CUDA runtime failed, e.g. no usable GPU.
    """
    return _C.tensor_core_rate(kind, device)


def shared_fill_rate(kind: str, device: int = 0, ctas: int = 0, stages: int = 0) -> dict:
    """How fast every SM of ``device`` can fill its shared memory from L2 one
    way: the data ceiling of the ``wgmma.sp`` kernels, as ``tensor_core_rate``
    is their compute ceiling.

    One CTA per SM streams stages of 128 rows x 128 bytes (one k-tile of 128
    token rows) from a 16 MiB L2-resident source into a ring of ``stages``
    stages (0: 128 KB of them), each completing on an mbarrier and reissued as
    soon as it has landed; nothing computes on the data.  ``kind`` is one of ``_C.SHARED_FILL_KINDS``:

    * ``"tma"``: one 2-d TMA box per stage (128-byte swizzle), how the kernels
      load the packed weights, and token rows that need no row map
    * ``"cp_async"``: 16-byte ``cp.async`` by 128 threads, rows in order
    * ``"cp_async_gather"``: the same with each row chosen by index (random
      rows), how the kernels gather routed tokens
    * ``"tma_and_gather"``: stages of 32 KB, a TMA box and 128 gathered rows,
      as the kernels' stages hold weights and routed tokens
    * ``"tma_multicast"``: clusters of two CTAs, each loading half of every box
      by TMA multicast into both (half the L2 reads for the bytes that land)
    * ``"tma_rows"``: each row chosen by index as in ``"cp_async_gather"``, but
      loaded as its own one-row TMA box (128 threads issuing one box each per
      stage): the gather without ``cp.async``

    ``ctas`` SMs take part (0: every SM, less one of an odd count for the
    clusters of ``"tma_multicast"``, which needs an even ``ctas``): fewer show
    whether the limit is each SM's or the L2's.  Bytes count where they land
    (multicast: in both CTAs).  Returns ``{"tb_per_s", "bytes_per_clock_per_sm",
    "sm_clock_mhz", "ctas", "in_flight_bytes"}``: the rate over those SMs, the
    bytes each SM took in per clock of its own (``clock64``), the SMs' mean
    clock during the run, and the CTAs (one per SM) and bytes in flight per CTA
    that ran.  Under a tenth of a second, blocking, on the legacy default
    stream.

    Raises:
        ValueError: an unknown ``kind`` or ``device``, ``ctas`` not in
            ``[0, SMs]`` (or odd, for multicast), or more ``stages`` than 12 or
            192 KB.
        NotImplementedError: not an sm_90 device, or a build without sm_90a.
        RuntimeError: samoyeds was built without CUDA, or (``CudaError``) the
            CUDA runtime failed.
    """
    return _C.shared_fill_rate(kind, device, ctas, stages)
