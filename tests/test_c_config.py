"""_C.set_config / _C.get_config: the ssmm selection's tunables and PDL live in the
module's state (samoyeds/_config.py fills them; tests and benchmarks override them there),
every value is checked, and the peak probes are gone from the extension (dev/peak/)."""
from __future__ import annotations

import pytest

from samoyeds import _C

KEYS = ("decode_max_rows", "decode_rows_per_expert", "tile", "token_rows", "pdl", "split_k", "x_copy")


@pytest.fixture
def restore_config():
    old = _C.get_config()
    yield
    _C.set_config(*(old[k] for k in KEYS))


def test_round_trip(restore_config):
    _C.set_config(64, 8, 2, 1, False, 3, 2)
    assert _C.get_config() == dict(decode_max_rows=64, decode_rows_per_expert=8, tile=2, token_rows=1, pdl=False,
                                   split_k=3, x_copy=2)
    _C.set_config(decode_max_rows=-1, decode_rows_per_expert=-1, tile=0, token_rows=0, pdl=True)  # split_k, x_copy: 0
    assert _C.get_config() == dict(decode_max_rows=-1, decode_rows_per_expert=-1, tile=0, token_rows=0, pdl=True,
                                   split_k=0, x_copy=0)


@pytest.mark.parametrize("args,match", [
    ((-2, -1, 0, 0, True), r"^decode_max_rows, decode_rows_per_expert: expected -1 .*, got -2, -1"),
    ((-1, -5, 0, 0, True), r"^decode_max_rows, decode_rows_per_expert: expected -1 .*, got -1, -5"),
    ((-1, -1, 4, 0, True), r"^tile: expected 0 \(auto\), 1 \(128x128\), 2 \(256x64\) or 3 \(256x96\), got 4"),
    ((-1, -1, -1, 0, True), r"^tile: .*, got -1"),
    ((-1, -1, 0, 3, True), r"^token_rows: expected 0 \(auto\), 1 \(gather\) or 2 \(tma\), got 3"),
    ((-1, -1, 0, 0, True, -1), r"^split_k: expected 0 \(auto\), 1 \(off\) or a count of splits, got -1"),
    ((-1, -1, 0, 0, True, 0, 3), r"^x_copy: expected 0 \(auto\), 1 \(never\) or 2 \(always\), got 3"),
    ((-1, -1, 0, 0, True, 0, -1), r"^x_copy: .*, got -1"),
])
def test_bad_values_name_the_field(restore_config, args, match):
    before = _C.get_config()
    with pytest.raises(ValueError, match=match):
        _C.set_config(*args)
    assert _C.get_config() == before


def test_the_peak_probes_left_the_extension():
    for name in ("tensor_core_rate", "shared_fill_rate", "TENSOR_CORE_KINDS", "SHARED_FILL_KINDS"):
        assert not hasattr(_C, name), name
    assert "ws_drop" not in _C.build_info()


# (units, unit_tiles, items, sms, split_k) -> splits: sam_ssmm_split_k (cuda/samoyeds_cuda.h)
@pytest.mark.parametrize("args,want", [
    ((128, 2, 2, 132, 0), 16),   # 2:4, K = 16384, M = N = 256: 2 items, capped at 16 splits
    ((32, 2, 1, 132, 0), 4),     # 1:2:128, K = 4096: 32 slices of 2 k-tiles, 8 slices a split at least
    ((8, 2, 2, 132, 0), 1),      # 2:4, K = 1024: 16 k-tiles, one split's least
    ((32, 2, 2, 132, 0), 4),     # 2:4, K = 4096: every split at least 16 k-tiles
    ((2, 2, 2, 132, 0), 1),      # 2:4, K = 256: too short to split
    ((16, 4, 1, 132, 0), 4),     # 1:2:256, K = 4096: four slices (16 k-tiles) a split at least
    ((128, 2, 16, 132, 0), 8),   # an eighth of the SMs: eight splits fit one wave
    ((128, 2, 17, 132, 0), 7),   # a quarter and K = 16384 (256 k-tiles): still split
    ((32, 2, 17, 132, 0), 1),    # a quarter and K = 4096: no split
    ((128, 2, 34, 132, 0), 1),   # more than a quarter of the SMs: no split
    ((128, 2, 2, 0, 0), 1),      # SM count unknown
    ((128, 2, 500, 132, 5), 5),  # forced, whatever the items
    ((3, 2, 1, 132, 5), 3),      # forced, clamped to the units
    ((128, 2, 1, 132, 40), 16),  # forced, clamped to SAM_SPLIT_K_MAX
    ((128, 2, 1, 132, 1), 1),    # off
])
def test_split_k_rule(args, want):
    assert _C.ssmm_split_k(*args) == want


def test_split_k_rule_checks_its_arguments():
    with pytest.raises(ValueError, match=r"^ssmm_split_k: expected units >= 1"):
        _C.ssmm_split_k(0, 2, 1, 132, 0)
