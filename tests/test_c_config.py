"""_C.set_config / _C.get_config: the ssmm selection's tunables and PDL live in the
module's state (samoyeds/_config.py fills them; tests and benchmarks override them there),
every value is checked, and the peak probes are gone from the extension (dev/peak/)."""
from __future__ import annotations

import pytest

from samoyeds import _C

KEYS = ("decode_max_rows", "decode_rows_per_expert", "tile", "token_rows", "pdl")


@pytest.fixture
def restore_config():
    old = _C.get_config()
    yield
    _C.set_config(*(old[k] for k in KEYS))


def test_round_trip(restore_config):
    _C.set_config(64, 8, 2, 1, False)
    assert _C.get_config() == dict(decode_max_rows=64, decode_rows_per_expert=8, tile=2, token_rows=1, pdl=False)
    _C.set_config(decode_max_rows=-1, decode_rows_per_expert=-1, tile=0, token_rows=0, pdl=True)
    assert _C.get_config() == dict(decode_max_rows=-1, decode_rows_per_expert=-1, tile=0, token_rows=0, pdl=True)


@pytest.mark.parametrize("args,match", [
    ((-2, -1, 0, 0, True), r"^decode_max_rows, decode_rows_per_expert: expected -1 .*, got -2, -1"),
    ((-1, -5, 0, 0, True), r"^decode_max_rows, decode_rows_per_expert: expected -1 .*, got -1, -5"),
    ((-1, -1, 4, 0, True), r"^tile: expected 0 \(auto\), 1 \(128x128\), 2 \(256x64\) or 3 \(256x96\), got 4"),
    ((-1, -1, -1, 0, True), r"^tile: .*, got -1"),
    ((-1, -1, 0, 3, True), r"^token_rows: expected 0 \(auto\), 1 \(gather\) or 2 \(tma\), got 3"),
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
