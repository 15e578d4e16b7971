"""The DLPack consumer (csrc/dlpack_consumer.c) on the CPU: dtypes, strides and
byte offsets, the three ways in (torch's C exchange API, versioned and legacy
capsules), read-only tensors, capsule ownership (renaming, deleters called
exactly once, references released) and the refusals of non-tensors.

Besides numpy and torch, three producers written here reach the corners those
libraries never show: a legacy producer (``__dlpack__()`` without keywords), a
versioned one that records what it was asked, and a ctypes producer that
builds the DLPack structs by hand (byte_offset, NULL strides, flags, versions,
device types) and counts its deleter calls."""
from __future__ import annotations

import ctypes
import gc
import sys
import tracemalloc
import weakref

import numpy as np
import pytest
import torch

import samoyeds as sm
from samoyeds import _C

NUMPY_DTYPES = ["float32", "float16", "float64", "uint8", "uint16", "uint32", "int32", "int64", "bool"]
TORCH_DTYPES = NUMPY_DTYPES + ["bfloat16"]
N_CALLS = 10_000


# ---- producers ---------------------------------------------------------------------------------

class LegacyProducer:
    """A pre-1.0 producer: ``__dlpack__`` takes no keywords and returns a
    "dltensor" capsule.  Records the keywords it refused and the last capsule."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.refused: list = []
        self.capsule = None

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        if kwargs:
            if len(self.refused) < 4:
                self.refused.append(kwargs)
            raise TypeError(f"__dlpack__() got unexpected keyword arguments {sorted(kwargs)}")
        self.capsule = self.arr.__dlpack__()
        return self.capsule


class VersionedProducer:
    """A DLPack 1.x producer over a numpy array; records the keywords it got and
    the last capsule.  ``make`` (optional) builds a fresh array per export."""

    def __init__(self, arr=None, make=None) -> None:
        self.arr = arr
        self.make = make
        self.calls: list = []
        self.capsule = None

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, *, max_version=None, stream=None, dl_device=None, copy=None):
        self.calls.append({"max_version": max_version, "stream": stream})
        arr = self.make() if self.make is not None else self.arr
        self.capsule = arr.__dlpack__(max_version=max_version)
        return self.capsule


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]

_DL_CODES = {"f": 2, "i": 0, "u": 1, "b": 6}
_OWNER: dict = {}       # managed-tensor address -> (deleter counts of its producer, export number)
STRAY_DELETES: list = []  # deleter calls for addresses no producer handed out


@DELETER
def _deleter(address):
    owner = _OWNER.get(address)
    if owner is None:
        STRAY_DELETES.append(address)
    else:
        owner[0][owner[1]] += 1


def capsule_name(capsule) -> str:
    return _capsule_name(capsule).decode()


class CapsuleProducer:
    """Builds DLManagedTensor[Versioned] structs by hand around a numpy array.

    byte_offset: the struct's data points that many bytes before the array and
    byte_offset says how far to go.  Every field can be overridden to describe
    something a well-behaved producer would not.  The producer keeps every
    struct it handed out alive (so no address is reused while it lives) and
    counts the deleter calls of each export; ``calls`` records the keywords."""

    def __init__(self, arr: np.ndarray, *, versioned: bool = True, byte_offset: int = 0, strides: bool = True,
                 version=(1, 0), device=(1, 0), shape=None, flags: int = 0, code=None, bits=None,
                 reported_device=None) -> None:
        self.arr = arr
        self.versioned = versioned
        self.byte_offset = byte_offset
        self.strides = strides
        self.version = version
        self.device = device
        self.shape = shape
        self.flags = flags
        self.code = code
        self.bits = bits
        self.reported_device = reported_device or device
        self.counts: list = []
        self._keep: list = []
        self.calls: list = []
        self.capsule = None

    def __dlpack_device__(self):
        return self.reported_device

    def __dlpack__(self, *, max_version=None, stream=None, dl_device=None, copy=None):
        self.calls.append({"max_version": max_version, "stream": stream})
        a = self.arr
        shape = (ctypes.c_int64 * max(a.ndim, 1))(*(self.shape if self.shape is not None else a.shape))
        strides = (ctypes.c_int64 * max(a.ndim, 1))(*[s // a.itemsize for s in a.strides])
        dt = DLDataType(self.code if self.code is not None else _DL_CODES[a.dtype.kind],
                        self.bits if self.bits is not None else a.itemsize * 8, 1)
        dl = DLTensor(a.ctypes.data - self.byte_offset, DLDevice(*self.device), a.ndim, dt, shape,
                      strides if self.strides else None, self.byte_offset)
        if self.versioned:
            mt = DLManagedTensorVersioned(DLPackVersion(*self.version), None, _deleter, self.flags, dl)
            name = b"dltensor_versioned"
        else:
            mt = DLManagedTensor(dl, None, _deleter)
            name = b"dltensor"
        address = ctypes.addressof(mt)
        self._keep.append((mt, shape, strides))
        _OWNER[address] = (self.counts, len(self.counts))
        self.counts.append(0)
        self.capsule = _capsule_new(address, name, None)
        return self.capsule

    def deleter_counts(self) -> list:
        return list(self.counts)


@pytest.fixture
def versioned_only():
    """Disables the exchange-API fast path for the test (restored afterwards)."""
    old = _C.set_fast_dlpack(False)
    yield
    _C.set_fast_dlpack(old)


@pytest.fixture(params=["exchange_api", "versioned"])
def torch_path(request):
    """The way a torch tensor enters: torch's C exchange API or the protocol."""
    old = _C.set_fast_dlpack(request.param == "exchange_api")
    yield request.param
    _C.set_fast_dlpack(old)


def _np_random(rng, shape, dtype: str) -> np.ndarray:
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), shape, endpoint=True).astype(dtype)


def _routing(rng, T: int, K: int):
    """pos [T, K] int32: a random permutation of the T*K sorted rows, some -1."""
    pos = rng.permutation(T * K).astype(np.int32).reshape(T, K)
    pos[rng.random((T, K)) < 0.2] = -1
    return pos


def _combine_oracle(y: np.ndarray, pos: np.ndarray) -> np.ndarray:
    y64 = np.asarray(y, dtype=np.float64)
    out = np.zeros((pos.shape[0], y64.shape[1]))
    for t in range(pos.shape[0]):
        for s in pos[t]:
            if 0 <= s < y64.shape[0]:
                out[t] += y64[s]
    return out


# ---- dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_dtypes(dtype, rng):
    a = _np_random(rng, (3, 5), dtype)
    info = _C.tensor_info(a)
    assert info["dtype"] == dtype
    assert info["shape"] == (3, 5) and info["strides"] == (5, 1)
    assert info["device"] == "cpu" and info["device_id"] == 0 and info["readonly"] == 0
    assert info["data_ptr"] == a.ctypes.data
    assert info["path"] == "versioned" and info["stream"] == 0


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_dtypes(dtype, rng, torch_path):
    if dtype == "bfloat16":
        t = torch.from_numpy(rng.standard_normal((4, 6)).astype(np.float32)).to(torch.bfloat16)
    else:
        t = torch.from_numpy(_np_random(rng, (4, 6), dtype))
    info = _C.tensor_info(t)
    assert info["dtype"] == dtype
    assert info["shape"] == (4, 6) and info["strides"] == (6, 1)
    assert info["data_ptr"] == t.data_ptr()
    assert info["device"] == "cpu" and info["readonly"] == 0
    assert info["path"] == torch_path


@pytest.mark.parametrize("y_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
def test_float_dtypes_are_read_and_written(y_dtype, out_dtype, rng, torch_path):
    T, K, H = 9, 3, 12
    pos = _routing(rng, T, K)
    y32 = rng.standard_normal((T * K, H)).astype(np.float32)
    y = torch.from_numpy(y32).to(getattr(torch, y_dtype))
    out = torch.full((T, H), float("nan"), dtype=getattr(torch, out_dtype))
    sm.combine(y, torch.from_numpy(pos), out=out)
    ref = _combine_oracle(y.float().numpy(), pos)
    tol = 1e-6 if out_dtype == "float32" and y_dtype == "float32" else 1e-2
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=tol, atol=tol * 4)


UNSUPPORTED_NUMPY = ["complex64", "int16", "int8", "uint64"]


@pytest.mark.parametrize("dtype", UNSUPPORTED_NUMPY)
def test_unsupported_numpy_dtypes(dtype, rng):
    a = np.abs(rng.standard_normal((4, 4))).astype(dtype)
    with pytest.raises(TypeError, match=r"^t: expected dtype .*, got an unsupported one"):
        _C.tensor_info(a)
    out = np.zeros((4, 4), np.float32)
    with pytest.raises(TypeError, match=r"^y: expected dtype .*, got an unsupported one"):
        _C.moe_combine(out, a, np.zeros((4, 1), np.int32))
    assert not out.any()


def _unsupported_torch():
    dts = [torch.complex64, torch.int16, torch.int8, torch.uint64]
    dts += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
    return dts


@pytest.mark.parametrize("dtype", _unsupported_torch(), ids=str)
def test_unsupported_torch_dtypes(dtype, torch_path):
    t = torch.randn(4, 4).abs().to(dtype)
    with pytest.raises(TypeError, match=r"^t: expected dtype .*, got an unsupported one"):
        _C.tensor_info(t)
    with pytest.raises(TypeError, match=r"^y: expected dtype .*, got an unsupported one"):
        _C.moe_combine(torch.zeros(4, 4), t, torch.zeros(4, 1, dtype=torch.int32))


def test_unsupported_dtype_from_a_capsule(rng):
    a = rng.standard_normal(8).astype(np.float32)
    p = CapsuleProducer(a, code=5)  # kDLComplex
    with pytest.raises(TypeError, match=r"^t: expected dtype .*, got an unsupported one \(DLPack code 5, 32 bits"):
        _C.tensor_info(p)
    assert p.deleter_counts() == [1]


# ---- strides and byte offsets ------------------------------------------------------------------

def test_numpy_strided_views(rng):
    base = rng.standard_normal((6, 10)).astype(np.float32)
    for view, strides in [(base.T, (1, 10)), (base[1:5, 2:9:3], (10, 3)), (base[::-2, 1], (-20,)),
                          (base[2:3, 4:5], None), (base[None, 3], None)]:
        info = _C.tensor_info(view)
        assert info["shape"] == view.shape
        assert info["strides"] == (strides or tuple(s // 4 for s in view.strides))
        assert info["data_ptr"] == view.ctypes.data


def test_torch_strided_views(rng, torch_path):
    base = torch.from_numpy(rng.standard_normal((6, 10)).astype(np.float32))
    for view in [base.T, base[1:5, 2:9:3], base[4], base[:, 7], base.T[3:, 1:]]:
        info = _C.tensor_info(view)
        assert info["shape"] == tuple(view.shape)
        assert info["strides"] == view.stride()
        assert info["data_ptr"] == view.data_ptr()


def test_view_into_the_middle_of_a_buffer(rng, torch_path):
    buf = rng.standard_normal(101).astype(np.float32)
    view = buf[37:]
    assert _C.tensor_info(view)["data_ptr"] == buf.ctypes.data + 37 * 4
    tb = torch.from_numpy(buf)
    tv = tb[37:].view(8, 8)
    info = _C.tensor_info(tv)
    assert info["data_ptr"] == tb.data_ptr() + 37 * 4 == tv.data_ptr()
    # an op reads from there: combine sums rows of the view
    pos = _routing(rng, 8, 1)
    out = sm.combine(tv, torch.from_numpy(pos))
    np.testing.assert_array_equal(out.numpy(), _combine_oracle(buf[37:].reshape(8, 8), pos).astype(np.float32))


@pytest.mark.parametrize("versioned", [True, False])
def test_byte_offset_is_applied(rng, versioned):
    buf = rng.standard_normal(64).astype(np.float32)
    y = buf[8:8 + 28].reshape(7, 4)
    p = CapsuleProducer(y, versioned=versioned, byte_offset=24)
    info = _C.tensor_info(p)
    assert info["data_ptr"] == y.ctypes.data == buf.ctypes.data + 32
    assert info["path"] == ("versioned" if versioned else "legacy")
    pos = _routing(rng, 7, 1)
    out = np.full((7, 4), np.nan, np.float32)
    _C.moe_combine(out, CapsuleProducer(y, versioned=versioned, byte_offset=24), pos)
    np.testing.assert_array_equal(out, _combine_oracle(y, pos).astype(np.float32))


def test_null_strides_mean_c_order(rng):
    a = rng.standard_normal((3, 4, 5)).astype(np.float32)
    info = _C.tensor_info(CapsuleProducer(a, strides=False))
    assert info["strides"] == (20, 5, 1)
    assert info["shape"] == (3, 4, 5)


def test_ops_requiring_contiguity(rng, torch_path):
    y = rng.standard_normal((10, 6)).astype(np.float32)
    pos = _routing(rng, 10, 1)
    out_t = np.empty((6, 10), np.float32).T
    with pytest.raises(ValueError, match=r"^out: expected a C-contiguous tensor, got shape \(10, 6\) "
                                         r"with strides \(1, 10\)"):
        sm.combine(y, pos, out=out_t)
    with pytest.raises(ValueError, match=r"^pos: expected a C-contiguous tensor"):
        sm.combine(y, np.repeat(pos, 2, axis=1)[:, ::2])
    w = torch.from_numpy(rng.standard_normal((64, 32)).astype(np.float32))
    with pytest.raises(ValueError, match=r"^w: expected a C-contiguous tensor"):
        sm.mask(w.T, "2:4")
    topk = torch.from_numpy(rng.integers(0, 4, (8, 4)))
    with pytest.raises(ValueError, match=r"^top_k_index: expected a C-contiguous tensor"):
        sm.route(topk[:, ::2], 4)


def test_row_strided_input_is_read_in_place(rng, torch_path):
    """ssmm and combine take inputs whose rows are apart (a column slice)."""
    T, C, R = 12, 64, 32
    wide = torch.from_numpy(rng.standard_normal((T, C + 24)).astype(np.float32))
    x = wide[:, 5:5 + C]
    p = sm.pack(torch.from_numpy(rng.standard_normal((2, R, C)).astype(np.float32)), "2:4")
    offsets = torch.tensor([0, 5, T], dtype=torch.int32)
    a = sm.ssmm(x, p, offsets)
    b = sm.ssmm(x.contiguous(), p, offsets)
    assert torch.equal(a, b)
    pos = torch.from_numpy(_routing(rng, T, 1))
    assert torch.equal(sm.combine(x, pos), sm.combine(x.contiguous(), pos))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_empty_tensors_count_as_contiguous(lib):
    """A tensor without elements is C-contiguous whatever strides it reports."""
    topk = np.empty((5, 0), np.int64)
    y = np.empty((6, 0), np.float32)
    pos = np.zeros((6, 1), np.int32)
    if lib == "torch":
        topk, y, pos = torch.from_numpy(topk), torch.empty(6, 0), torch.from_numpy(pos)
    r = sm.route(topk, 3)
    assert list(r.offsets) == [0, 0, 0, 0]
    assert tuple(r.pos.shape) == (5, 0)
    assert tuple(sm.combine(y, pos).shape) == (6, 0)


# ---- the ways in -------------------------------------------------------------------------------

def test_paths(rng, versioned_only):
    a = rng.standard_normal((4, 4)).astype(np.float32)
    t = torch.from_numpy(a)
    assert _C.tensor_info(a)["path"] == "versioned"
    assert _C.tensor_info(t)["path"] == "versioned"
    assert _C.tensor_info(LegacyProducer(a))["path"] == "legacy"
    assert _C.tensor_info(VersionedProducer(a))["path"] == "versioned"
    old = _C.set_fast_dlpack(True)
    try:
        assert old is False
        assert _C.tensor_info(t)["path"] == "exchange_api"
        assert _C.tensor_info(a)["path"] == "versioned"  # numpy offers no exchange API
    finally:
        _C.set_fast_dlpack(False)


def test_versioned_producer_is_asked_for_dlpack_1(rng):
    a = rng.standard_normal((3, 8)).astype(np.float32)
    p = VersionedProducer(a)
    info = _C.tensor_info(p)
    assert p.calls == [{"max_version": (1, 0), "stream": None}]  # no stream for a CPU tensor
    assert info["data_ptr"] == a.ctypes.data and info["shape"] == (3, 8)


def test_legacy_producer_gets_a_call_without_keywords(rng):
    a = rng.standard_normal((3, 8)).astype(np.float32)
    p = LegacyProducer(a)
    info = _C.tensor_info(p)
    assert p.refused[0] == {"max_version": (1, 0)}
    assert info["path"] == "legacy" and info["data_ptr"] == a.ctypes.data
    y = rng.standard_normal((9, 5)).astype(np.float32)
    pos = _routing(rng, 9, 1)
    out = np.full((9, 5), np.nan, np.float32)
    _C.moe_combine(out, LegacyProducer(y), pos)
    np.testing.assert_array_equal(out, _combine_oracle(y, pos).astype(np.float32))


def test_fake_cuda_tensor_gets_the_stream(rng):
    """A CUDA tensor is asked for the launch stream (1: legacy default stream,
    or the caller's); nothing is read from it by tensor_info."""
    a = rng.standard_normal((2, 4)).astype(np.float32)
    p = CapsuleProducer(a, device=(2, 3))
    info = _C.tensor_info(p)
    assert p.calls[-1] == {"max_version": (1, 0), "stream": 1}
    assert info["device"] == "cuda" and info["device_id"] == 3 and info["stream"] == 0
    info = _C.tensor_info(p, stream=0x1234)
    assert p.calls[-1]["stream"] == 0x1234 and info["stream"] == 0x1234
    assert p.deleter_counts() == [1, 1]


# ---- read-only ---------------------------------------------------------------------------------

def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def test_readonly_input_accepted(rng):
    y = _readonly(rng.standard_normal((8, 6)).astype(np.float32))
    pos = _readonly(_routing(rng, 8, 1))
    info = _C.tensor_info(y)
    assert info["readonly"] == 1 and info["path"] == "versioned"
    out = sm.combine(y, pos)
    np.testing.assert_array_equal(out, _combine_oracle(y, pos).astype(np.float32))


def test_readonly_flag_from_a_capsule(rng):
    a = rng.standard_normal(6).astype(np.float32)
    assert _C.tensor_info(CapsuleProducer(a, flags=1))["readonly"] == 1
    assert _C.tensor_info(CapsuleProducer(a, flags=2))["readonly"] == 0  # IS_COPIED only
    out = np.full((6, 1), np.nan, np.float32)
    with pytest.raises(ValueError, match=r"^out: expected a writable tensor \(an output\), got a read-only one"):
        _C.moe_combine(CapsuleProducer(out, flags=1), a.reshape(6, 1), np.zeros((6, 1), np.int32))
    assert np.isnan(out).all()


def test_readonly_output_refused(rng):
    y = rng.standard_normal((8, 6)).astype(np.float32)
    pos = _routing(rng, 8, 1)
    out = _readonly(np.full((8, 6), np.nan, np.float32))
    with pytest.raises(ValueError, match=r"^out: expected a writable tensor \(an output\), got a read-only one"):
        sm.combine(y, pos, out=out)
    assert np.isnan(out).all()
    w = rng.standard_normal((1, 8, 64)).astype(np.float32)
    mask = np.full(w.shape, 7, np.uint8)
    mask.flags.writeable = False
    with pytest.raises(ValueError, match=r"^mask: expected a writable tensor \(an output\), got a read-only one"):
        _C.format_mask(mask, w, None, 1, 2, 32)
    assert (mask == 7).all()


def test_readonly_array_refused_by_legacy_export(rng):
    """numpy cannot flag read-only in a legacy capsule and refuses to export."""
    a = _readonly(rng.standard_normal(5).astype(np.float32))
    with pytest.raises(BufferError, match=r"^t: the producer refused DLPack export"):
        _C.tensor_info(LegacyProducer(a))


# ---- ownership: capsule names, deleters, references --------------------------------------------

@pytest.mark.parametrize("kind", ["versioned", "legacy"])
def test_consumed_capsule_is_renamed(rng, kind):
    a = rng.standard_normal((4, 3)).astype(np.float32)
    p = VersionedProducer(a) if kind == "versioned" else LegacyProducer(a)
    _C.tensor_info(p)
    expect = "used_dltensor_versioned" if kind == "versioned" else "used_dltensor"
    assert capsule_name(p.capsule) == expect
    assert f'"{expect}"' in repr(p.capsule)
    # the op path renames too
    y = rng.standard_normal((4, 3)).astype(np.float32)
    p = VersionedProducer(y) if kind == "versioned" else LegacyProducer(y)
    _C.moe_combine(np.empty((4, 3), np.float32), p, _routing(rng, 4, 1))
    assert capsule_name(p.capsule) == expect


def test_used_capsule_cannot_be_consumed_again(rng):
    a = rng.standard_normal(4).astype(np.float32)
    p = VersionedProducer(a)
    _C.tensor_info(p)

    class Replay:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kwargs):
            return p.capsule

    with pytest.raises(BufferError, match=r"^t: __dlpack__ returned PyCapsule, not a DLPack capsule"):
        _C.tensor_info(Replay())


@pytest.mark.parametrize("versioned", [True, False])
def test_deleter_called_exactly_once(rng, versioned):
    y = rng.standard_normal((5, 4)).astype(np.float32)
    pos = _routing(rng, 5, 1)
    p = CapsuleProducer(y, versioned=versioned)
    _C.tensor_info(p)
    assert p.deleter_counts() == [1]
    assert capsule_name(p.capsule) == ("used_dltensor_versioned" if versioned else "used_dltensor")
    out = np.full((5, 4), np.nan, np.float32)
    _C.moe_combine(out, p, pos)
    assert p.deleter_counts() == [1, 1]
    np.testing.assert_array_equal(out, _combine_oracle(y, pos).astype(np.float32))
    # failures after the tensor was taken release it too
    with pytest.raises(TypeError, match=r"^pos: expected dtype int32, got int64"):
        _C.moe_combine(out, p, pos.astype(np.int64))
    with pytest.raises(TypeError, match=r"^pos: expected a tensor supporting DLPack .*, got NoneType"):
        _C.moe_combine(out, p, None)
    with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with y"):
        _C.moe_combine(CapsuleProducer(y, versioned=versioned), p, pos)
    assert p.deleter_counts() == [1, 1, 1, 1, 1]
    assert not STRAY_DELETES


@pytest.mark.parametrize("kw,exc,match", [
    (dict(version=(2, 0)), BufferError, r"^t: DLPack version 2\.0 is not supported"),
    (dict(version=(0, 8)), BufferError, r"^t: DLPack version 0\.8 is not supported"),
    (dict(shape=(4, -1)), BufferError, r"^t: producer reported a negative extent"),
    (dict(device=(7, 0)), ValueError, r"^t: expected a tensor on the CPU or a CUDA device, got DLPack device type 7"),
    (dict(code=2, bits=8), TypeError, r"^t: expected dtype .*, got an unsupported one \(DLPack code 2, 8 bits"),
])
def test_refused_capsule_is_still_deleted(rng, kw, exc, match):
    p = CapsuleProducer(rng.standard_normal((4, 2)).astype(np.float32), **kw)
    with pytest.raises(exc, match=match):
        _C.tensor_info(p)
    assert p.deleter_counts() == [1]


def test_too_many_dimensions(rng):
    a = rng.standard_normal((1,) * 9).astype(np.float32)
    with pytest.raises(ValueError, match=r"^t: expected at most 8 dimensions, got 9"):
        _C.tensor_info(a)
    p = CapsuleProducer(a)
    with pytest.raises(ValueError, match=r"^t: expected at most 8 dimensions"):
        _C.tensor_info(p)
    assert p.deleter_counts() == [1]
    assert _C.tensor_info(a.reshape((1,) * 8))["shape"] == (1,) * 8


def _assert_no_leak(watched, fn, n=N_CALLS, slack=16 * 1024):
    """n calls of fn leave the reference counts of the watched objects as they
    were, and tracemalloc's traced memory grows by less than a constant slack.
    A window that grows past it is followed by a second one, which must not: a
    leak grows in every window, the interpreter's one-time caches (type caches,
    free lists filled by the first raised exceptions) in one."""
    for _ in range(50):
        fn()
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        gc.collect()
        refs = [sys.getrefcount(o) for o in watched]
        grown = []
        for _ in range(2):
            start = tracemalloc.get_traced_memory()[0]
            for _ in range(n):
                fn()
            gc.collect()
            grown.append(tracemalloc.get_traced_memory()[0] - start)
            if grown[-1] < slack:
                break
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(o) for o in watched] == refs
    assert grown[-1] < slack, f"{grown} bytes more after each window of {n} calls"


def _raises(exc, fn):
    def call():
        try:
            fn()
        except exc:
            return
        raise AssertionError("expected an exception")
    return call


PATHS = ["numpy", "numpy-legacy", "torch-exchange_api", "torch-versioned"]


def _wrap(path, arr):
    """(object to pass, object whose refcount to watch) for a path."""
    if path == "numpy":
        return arr, arr
    if path == "numpy-legacy":
        return LegacyProducer(arr), arr
    t = torch.from_numpy(arr)
    return t, t


@pytest.fixture
def fast_dlpack_for():
    """set_for(path) turns the exchange-API fast path on or off for a path of
    PATHS; the old setting comes back after the test."""
    def set_for(path):
        _C.set_fast_dlpack(path != "torch-versioned")
    old = _C.set_fast_dlpack(True)
    yield set_for
    _C.set_fast_dlpack(old)


@pytest.mark.parametrize("path", PATHS)
def test_no_reference_leak_tensor_info(rng, path, fast_dlpack_for):
    fast_dlpack_for(path)
    arr = rng.standard_normal((6, 4)).astype(np.float32)
    obj, watched = _wrap(path, arr)
    expect = {"numpy": "versioned", "numpy-legacy": "legacy"}.get(path, path.split("-")[-1])
    assert _C.tensor_info(obj)["path"] == expect
    _assert_no_leak([watched], lambda: _C.tensor_info(obj))


@pytest.mark.parametrize("path", PATHS)
def test_no_reference_leak_ops(rng, path, fast_dlpack_for):
    fast_dlpack_for(path)
    T, K, H = 5, 2, 4
    y_arr = rng.standard_normal((T * K, H)).astype(np.float32)
    pos_arr = _routing(rng, T, K)
    y, watched = _wrap(path, y_arr)
    pos, pos_watched = _wrap(path, pos_arr)
    out = torch.empty(T, H) if path.startswith("torch") else np.empty((T, H), np.float32)
    call = lambda: _C.moe_combine(out, y, pos)  # noqa: E731
    call()
    np.testing.assert_allclose(np.asarray(out), _combine_oracle(y_arr, pos_arr), rtol=1e-6, atol=1e-6)
    _assert_no_leak([watched, pos_watched, out], call)
    # a failing call (dtype check after every tensor was taken) releases everything too
    bad = np.zeros((T, K), np.int64) if path.startswith("numpy") else torch.zeros(T, K, dtype=torch.int64)
    fail = _raises(TypeError, lambda: _C.moe_combine(out, y, bad))
    _assert_no_leak([watched, pos_watched, bad], fail)


@pytest.mark.parametrize("path", ["torch-exchange_api"])
def test_no_reference_leak_route(rng, path, fast_dlpack_for):
    fast_dlpack_for(path)
    topk_arr = rng.integers(0, 4, (6, 2))
    topk, watched = _wrap(path, topk_arr)
    call = lambda: sm.route(topk, 4)  # noqa: E731
    assert list(np.asarray(call().offsets))[-1] == 12
    _assert_no_leak([watched], call)


def test_deleter_exactly_once_over_many_calls(rng):
    a = rng.standard_normal(3).astype(np.float32)
    p = CapsuleProducer(a)
    for _ in range(1000):
        _C.tensor_info(p)
    assert p.deleter_counts() == [1] * 1000
    assert not STRAY_DELETES


@pytest.mark.parametrize("path", ["torch-exchange_api", "torch-versioned", "numpy"])
def test_tensor_released_when_op_returns(rng, path, fast_dlpack_for):
    fast_dlpack_for(path)
    y = _wrap(path, rng.standard_normal((6, 3)).astype(np.float32))[0]
    pos = _routing(rng, 6, 1)
    out = sm.combine(y, pos)
    ref = weakref.ref(y)
    del y
    assert ref() is None
    assert tuple(out.shape) == (6, 3)


def test_capsule_keeps_data_alive_during_the_op(rng):
    """A producer whose only reference to the data is the capsule it returns:
    the op reads valid data, and the data dies once the op returned."""
    y = rng.standard_normal((7, 5)).astype(np.float32)
    pos = _routing(rng, 7, 1)
    refs = []

    def make():
        fresh = y.copy()
        refs.append(weakref.ref(fresh))
        return fresh

    out = np.full((7, 5), np.nan, np.float32)
    _C.moe_combine(out, VersionedProducer(make=make), pos)
    np.testing.assert_array_equal(out, _combine_oracle(y, pos).astype(np.float32))
    assert len(refs) == 1 and refs[0]() is None


# ---- objects that are no tensors ---------------------------------------------------------------

class OnlyDevice:
    def __dlpack_device__(self):
        return (1, 0)


class BadDevice:
    def __dlpack_device__(self):
        return "cpu"

    def __dlpack__(self, **kwargs):
        raise AssertionError("never asked")


class Refuses:
    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        raise BufferError("no export today")


class NotACapsule:
    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        return 42


@pytest.mark.parametrize("obj,exc,match", [
    ([1.0, 2.0], TypeError, r"expected a tensor supporting DLPack .* got list"),
    (None, TypeError, r"expected a tensor supporting DLPack .* got NoneType"),
    (3.5, TypeError, r"expected a tensor supporting DLPack .* got float"),
    (np.float32(1.0), TypeError, r"expected a tensor supporting DLPack .* got numpy.float32"),
    (OnlyDevice(), TypeError, r"expected a tensor supporting DLPack .* got OnlyDevice"),
    (BadDevice(), BufferError, r"__dlpack_device__ did not return \(type, id\)"),
    (Refuses(), BufferError, r"the producer refused DLPack export: no export today"),
    (NotACapsule(), BufferError, r"__dlpack__ returned int, not a DLPack capsule"),
], ids=["list", "None", "float", "numpy-scalar", "only-device", "bad-device", "refuses", "not-a-capsule"])
def test_non_tensors_refused(obj, exc, match, rng):
    with pytest.raises(exc, match="^t: " + match):
        _C.tensor_info(obj)
    out = np.full((3, 2), np.nan, np.float32)
    with pytest.raises(exc, match="^y: " + match):
        _C.moe_combine(out, obj, np.zeros((3, 1), np.int32))
    assert np.isnan(out).all()
    with pytest.raises(exc, match="^top_k_index: " + match):
        _C.moe_route(np.empty(3, np.int32), np.empty(2, np.int32), np.empty(2, np.int32),
                     np.empty((2, 1), np.int32), obj)


def test_optional_tensor_may_be_none(rng):
    w = rng.standard_normal((1, 8, 32)).astype(np.float32)
    mask = np.full(w.shape, 9, np.uint8)
    _C.format_mask(mask, w, None, 1, 2, 32)
    assert mask.sum() == 8 * 32 // 4
