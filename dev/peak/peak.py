"""The tensor-core issue-rate and shared-memory fill-rate probes (dev/peak/peak.cu).

Measurement instruments for the benchmarks, not part of the library: on first use
``peak.cu`` and ``cuda/device.cu`` are built with nvcc into a shared library cached
under ``build/peak/`` (keyed by the sources, the nvcc version and the architecture),
then loaded with ctypes.  Benchmarks import it with::

    sys.path.insert(0, str(REPO / "dev" / "peak")); import peak

``SAMOYEDS_CUDA_ARCHS`` (e.g. ``90a``; the build variable of setup.py) sets the
architecture; by default it is the device's (``90a`` on sm_90, for wgmma and TMA).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SOURCES = (HERE / "peak.cu", REPO / "cuda" / "device.cu")
HEADERS = tuple(sorted((REPO / "cuda").glob("*.cuh"))) + tuple(sorted((REPO / "cuda").glob("*.h"))) + (
    HERE / "peak.h", HERE / "peak_ptx.cuh")

# in enum order (dev/peak/peak.h: SAM_TC_KIND_NAMES, SAM_FILL_KIND_NAMES)
TENSOR_CORE_KINDS: tuple[str, ...] = (
    "mma", "mma_sp", "wgmma", "wgmma_sp", "wgmma_sp_n64", "wgmma_sp_ss", "wgmma_sp_ss_n96", "wgmma_sp_ss_n64")
FILL_KINDS: tuple[str, ...] = ("tma", "cp_async", "cp_async_gather", "tma_and_gather", "tma_multicast", "tma_rows")

_lib: ctypes.CDLL | None = None


def _arch() -> str:
    """The architecture to build for: SAMOYEDS_CUDA_ARCHS's first entry, else the device's."""
    env = os.environ.get("SAMOYEDS_CUDA_ARCHS", "").replace(";", " ").replace(",", " ").split()
    if env:
        return env[0].replace("sm_", "").replace(".", "")
    out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout.split()
    cc = out[0].replace(".", "")
    return "90a" if cc == "90" else cc


def available() -> bool:
    """Whether the probes can run here: nvcc on PATH and an NVIDIA GPU."""
    return shutil.which("nvcc") is not None and shutil.which("nvidia-smi") is not None and _has_gpu()


def _has_gpu() -> bool:
    try:
        return bool(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
    except OSError:
        return False


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    arch = _arch()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("peak: nvcc is not on PATH (the probes are built on first use)")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256((arch + version).encode())
    for f in SOURCES + HEADERS:
        h.update(f.read_bytes())
    out_dir = REPO / "build" / "peak"
    lib = out_dir / f"libsampeak-{arch}-{h.hexdigest()[:16]}.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [nvcc, "-shared", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
               "-I", str(REPO / "cuda"), "-I", str(HERE),
               f"-gencode=arch=compute_{arch},code=sm_{arch}", f'-DSAM_ARCHS="sm_{arch}"',
               *map(str, SOURCES), "-o", str(tmp)]
        subprocess.run(cmd, check=True)
        tmp.replace(lib)
    _lib = ctypes.CDLL(str(lib))
    _lib.sam_tc_rate_cuda.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    _lib.sam_tc_rate_cuda.restype = ctypes.c_int
    _lib.sam_fill_rate_cuda.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_double)]
    _lib.sam_fill_rate_cuda.restype = ctypes.c_int
    _lib.sam_cuda_last_error.restype = ctypes.c_char_p
    return _lib


def _check(lib: ctypes.CDLL, status: int, fn: str) -> None:
    if status == 0:
        return
    msg = f"{fn}: {lib.sam_cuda_last_error().decode()}"
    # sam_status: 1 invalid argument, 2 unsupported, 3 CUDA error
    raise {1: ValueError, 2: NotImplementedError}.get(status, RuntimeError)(msg)


def _kind(kind: str, names: tuple[str, ...], fn: str) -> int:
    if not isinstance(kind, str):
        raise TypeError(f"{fn}: kind: expected a str, got {type(kind).__name__}")
    if kind not in names:
        raise ValueError(f"{fn}: kind: expected one of {names!r}, got {kind!r}")
    return names.index(kind)


def tensor_core_rate(kind: str, device: int = 0) -> float:
    """The issue rate of one tensor-core instruction form on ``device``, in dense-equivalent
    TFLOP/s (a sparse m16n8k32 counts 2*16*8*32 flop): the ceiling of a kernel built on
    that instruction.  ``kind`` is one of ``TENSOR_CORE_KINDS``.  Blocks for under a tenth
    of a second; NotImplementedError for a kind the device or build cannot run."""
    k = _kind(kind, TENSOR_CORE_KINDS, "tensor_core_rate")
    if not isinstance(device, int):
        raise TypeError(f"tensor_core_rate: device: expected an int, got {type(device).__name__}")
    lib = _load()
    out = ctypes.c_double(0.0)
    _check(lib, lib.sam_tc_rate_cuda(k, device, ctypes.byref(out)), "tensor_core_rate")
    return out.value


def shared_fill_rate(kind: str, device: int = 0, ctas: int = 0, stages: int = 0) -> dict:
    """How fast ``ctas`` SMs (0: every SM) of ``device`` fill their shared memory from L2
    one way (``kind``, one of ``FILL_KINDS``) with ``stages`` in flight (0: 128 KB of them):
    ``tb_per_s``, ``bytes_per_clock_per_sm``, ``sm_clock_mhz``, and the ``ctas`` and
    ``in_flight_bytes`` (per CTA) that ran.  sm_90 with sm_90a code only."""
    k = _kind(kind, FILL_KINDS, "shared_fill_rate")
    for name, v in (("device", device), ("ctas", ctas), ("stages", stages)):
        if not isinstance(v, int):
            raise TypeError(f"shared_fill_rate: {name}: expected an int, got {type(v).__name__}")
    lib = _load()
    out = (ctypes.c_double * 5)()
    _check(lib, lib.sam_fill_rate_cuda(k, device, ctas, stages, out), "shared_fill_rate")
    return {"tb_per_s": out[0], "bytes_per_clock_per_sm": out[1], "sm_clock_mhz": out[2], "ctas": int(out[3]),
            "in_flight_bytes": int(out[4])}
