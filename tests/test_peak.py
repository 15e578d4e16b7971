"""dev/peak's probes (peak.tensor_core_rate, peak.shared_fill_rate): argument errors
everywhere, and on a GPU with nvcc rates that are finite, positive, below the hardware's
peak and ordered the way Hopper's tensor cores are.  peak.py builds dev/peak/peak.cu on
first use (build/peak/)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

import samoyeds
from samoyeds import _C

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dev" / "peak"))
import peak  # noqa: E402

KINDS = ("mma", "mma_sp", "wgmma", "wgmma_sp", "wgmma_sp_n64", "wgmma_sp_ss", "wgmma_sp_ss_n96", "wgmma_sp_ss_n64")


def _hopper_build() -> bool:
    """An sm_90 device (peak.py then builds sm_90a code): the wgmma kinds can run."""
    return samoyeds.cuda_available() and _C.cuda_device_capability(0) == (9, 0)


@pytest.fixture(autouse=True)
def _probes_built(request):
    if request.node.get_closest_marker("gpu") and not peak.available():
        pytest.skip("the probes need nvcc and an NVIDIA GPU")


def test_kinds():
    assert peak.TENSOR_CORE_KINDS == KINDS


@pytest.mark.parametrize("fn", [peak.tensor_core_rate])
def test_unknown_kind_is_a_value_error_naming_it(fn):
    with pytest.raises(ValueError, match=r"kind: expected one of .*'wgmma_sp'.*got 'hgmma'"):
        fn("hgmma")
    with pytest.raises(ValueError, match="got 'MMA'"):  # names are exact
        fn("MMA", 0)
    with pytest.raises(TypeError):
        fn(2)
    with pytest.raises(TypeError):
        fn("mma", "0")


@pytest.mark.gpu
def test_bad_device_is_a_value_error():
    with pytest.raises(ValueError, match="device = -1"):
        peak.tensor_core_rate("mma", -1)
    with pytest.raises(ValueError, match=f"device = {_C.cuda_device_count()}"):
        peak.tensor_core_rate("mma", _C.cuda_device_count())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_rate_is_finite_and_positive(kind):
    if kind.startswith("wgmma") and not _hopper_build():
        with pytest.raises(NotImplementedError, match=kind):
            peak.tensor_core_rate(kind)
        return
    rate = peak.tensor_core_rate(kind)
    assert math.isfinite(rate) and rate > 0, rate
    if _C.cuda_device_capability(0) == (9, 0):
        # 132 SMs x 4096 dense bf16 flop per SM and clock x 1.98 GHz (H100 SXM / H200 at
        # their top clock), doubled for sparse: more means flops counted that were never issued
        dense_peak = 132 * 4096 * 1.98e9 / 1e12
        assert rate < (2 if "_sp" in kind else 1) * dense_peak * 1.05, (kind, rate)
    # the device is usable afterwards
    assert peak.tensor_core_rate("mma") > 0


@pytest.mark.gpu
def test_hopper_ordering():
    if not _hopper_build():
        pytest.skip("needs an sm_90 device and a build with sm_90a")
    r = {k: peak.tensor_core_rate(k) for k in KINDS}
    assert r["wgmma_sp"] > 1.5 * r["wgmma"], r
    assert r["wgmma"] > r["mma"], r
    # every sparse warpgroup form issues faster than the warp-level sparse MMA
    for k in KINDS[4:]:
        assert r[k] > r["mma_sp"], (k, r)


# ---- shared_fill_rate ----
FILL_KINDS = ("tma", "cp_async", "cp_async_gather", "tma_and_gather", "tma_multicast", "tma_rows")


def test_fill_kinds():
    assert peak.FILL_KINDS == FILL_KINDS


@pytest.mark.parametrize("fn", [peak.shared_fill_rate])
def test_fill_unknown_kind_is_a_value_error_naming_it(fn):
    with pytest.raises(ValueError, match=r"shared_fill_rate: kind: expected one of .*'cp_async_gather'.*got 'ldgsts'"):
        fn("ldgsts")
    with pytest.raises(ValueError, match="got 'TMA'"):
        fn("TMA", 0)
    with pytest.raises(TypeError):
        fn(0)
    with pytest.raises(TypeError):
        fn("tma", "0")


@pytest.mark.gpu
def test_fill_bad_device_is_a_value_error():
    with pytest.raises(ValueError, match="device = -1"):
        peak.shared_fill_rate("tma", -1)
    with pytest.raises(ValueError, match=f"device = {_C.cuda_device_count()}"):
        peak.shared_fill_rate("tma", _C.cuda_device_count())
    if _hopper_build():
        with pytest.raises(ValueError, match=r"ctas = -1; expected 0 \(every SM\)"):
            peak.shared_fill_rate("tma", 0, -1)
        with pytest.raises(ValueError, match="ctas = 100000"):
            peak.shared_fill_rate("cp_async", ctas=100000)
        with pytest.raises(ValueError, match=r"stages = 13; expected 0 .* 1 <= stages <= 12 \(stages of 16 KB\)"):
            peak.shared_fill_rate("tma", stages=13)
        with pytest.raises(ValueError, match=r"stages = 7; .* <= 6 \(stages of 32 KB\)"):
            peak.shared_fill_rate("tma_and_gather", stages=7)
        with pytest.raises(ValueError, match="stages = -1"):
            peak.shared_fill_rate("cp_async_gather", stages=-1)
        with pytest.raises(ValueError, match="ctas = 1; tma_multicast runs clusters of 2 CTAs and needs an even"):
            peak.shared_fill_rate("tma_multicast", ctas=1)
        with pytest.raises(ValueError, match="ctas = 33; tma_multicast"):  # never silently 32
            peak.shared_fill_rate("tma_multicast", ctas=33)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FILL_KINDS)
def test_fill_rate_is_finite_and_below_the_hardware(kind):
    if not _hopper_build():
        with pytest.raises(NotImplementedError, match=kind):
            peak.shared_fill_rate(kind)
        return
    r = peak.shared_fill_rate(kind)
    assert set(r) == {"tb_per_s", "bytes_per_clock_per_sm", "sm_clock_mhz", "ctas", "in_flight_bytes"}, r
    assert all(math.isfinite(v) and v > 0 for v in r.values()), r
    # what ran: one CTA per SM (an even count for clusters of 2), 128 KB of stages by default
    torch = pytest.importorskip("torch")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert r["ctas"] == (sms - sms % 2 if kind == "tma_multicast" else sms), (r, sms)
    assert r["in_flight_bytes"] == 128 * 1024, r
    # an SM clock between idle and the top boost clock of any Hopper part
    assert 500 < r["sm_clock_mhz"] < 2100, r
    # an SM takes in at most 128 bytes per clock from L2 (more: bytes counted that never
    # moved); the device rate and the per-SM rate agree through the SM count and clock
    assert r["bytes_per_clock_per_sm"] < 128, r
    implied = r["bytes_per_clock_per_sm"] * r["sm_clock_mhz"] * 1e6 * r["ctas"] / 1e12
    assert 0.8 < implied / r["tb_per_s"] < 1.25, (implied, sms, r)
    # fewer SMs, and one stage in flight: finite, below the hardware, and not above the full rate
    for few in (peak.shared_fill_rate(kind, ctas=8), peak.shared_fill_rate(kind, stages=1)):
        assert all(math.isfinite(v) and v > 0 for v in few.values()), few
        assert few["bytes_per_clock_per_sm"] < 128 and few["tb_per_s"] < r["tb_per_s"] * 1.05, (few, r)
    assert peak.shared_fill_rate(kind, ctas=8)["ctas"] == 8
    assert peak.shared_fill_rate(kind, stages=1)["in_flight_bytes"] == (32 if kind == "tma_and_gather" else 16) * 1024
    assert peak.tensor_core_rate("mma") > 0  # the device is usable afterwards
