"""_C.format_gather (csrc/format_ref.c, cuda/format.cu): out[i] = values.flat[src[i]], 0 where
src[i] falls outside values -- the refresh of PackedWeight.unglued() after an optimizer
step.  Against torch indexing on fresh random inputs, outputs poisoned, every dtype, the
16-byte path and the element path, out-of-range sources both ways; bad arguments name
themselves."""
from __future__ import annotations

import pytest
import torch

from samoyeds import _C

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _want(values, src):
    flat = values.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(src.shape, dtype=values.dtype, device=values.device)
    s = src.long()
    ok = (s >= 0) & (s < flat.numel())
    return torch.where(ok, flat[s.clamp(0, flat.numel() - 1)], torch.zeros((), dtype=values.dtype,
                                                                     device=values.device))


def _case(n, count, dtype, device, gen):
    values = torch.randn(n, generator=gen).to(dtype).to(device).reshape(-1, 1) if n else \
        torch.empty(0, 1, dtype=dtype, device=device)
    src = torch.randint(-3, n + 4, (count,), generator=gen, dtype=torch.int32)
    src[: count // 4] = torch.randint(0, max(n, 1), (count // 4,), generator=gen, dtype=torch.int32)
    if count:
        src[-1] = 2**31 - 1
    return values, src.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,count", [(37, 64), (37, 61), (1, 9), (0, 8), (100, 0)])
def test_ref_matches_indexing(dtype, n, count):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    values, src = _case(n, count, dtype, "cpu", gen)
    out = torch.full((count,), float("nan"), dtype=dtype)
    _C.format_gather(out, values, src)
    assert torch.equal(out, _want(values, src))


def test_errors_name_the_argument():
    v = torch.randn(10)
    src = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^out: expected 8 elements"):
        _C.format_gather(torch.empty(7), v, src)
    with pytest.raises(TypeError, match=r"^out: "):
        _C.format_gather(torch.empty(8, dtype=torch.float64), v, src)
    with pytest.raises(TypeError, match=r"^src: "):
        _C.format_gather(torch.empty(8), v, src.long())
    with pytest.raises(ValueError, match=r"^out: .*shares no memory"):
        _C.format_gather(v[:8], v, src)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,count", [(4099, 8 * 1000), (4099, 8 * 1000 + 3), (1, 8), (0, 16), (10, 0)])
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_matches_indexing(dtype, n, count, offset):
    """offset 1 shifts out and src off 16-byte alignment: the element path."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    values, src = _case(n, count + offset, dtype, "cuda", gen)
    src = src[offset:]
    outw = torch.full((count + offset,), float("nan"), dtype=dtype, device="cuda")
    out = outw[offset:]
    _C.format_gather(out, values, src)
    torch.cuda.synchronize()
    assert torch.equal(out, _want(values, src))
    ref = torch.full((count,), float("nan"), dtype=dtype)
    _C.format_gather(ref, values.cpu(), src.cpu())
    assert torch.equal(out.cpu(), ref)
    if offset:
        assert torch.isnan(outw[:offset].float()).all()
