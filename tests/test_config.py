"""samoyeds.config / samoyeds.get_config: one configuration in force, written to the C
extension's module state, changed for the process or for a scope (restored on exit); SAMOYEDS_PDL read
once at import and no other environment variable read by the package."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

import samoyeds as sm
from samoyeds import _C, _config
from helpers import run_python

TILES = {"auto": 0, "128x128": 1, "256x64": 2, "256x96": 3}
TOKEN_ROWS = {"auto": 0, "gather": 1, "tma": 2}
X_COPY = {"auto": 0, "never": 1, "always": 2}


def _in_c(cfg: sm.Config) -> dict:
    """What the module state should hold for ``cfg``."""
    return {"decode_max_rows": -1 if cfg.decode_max_rows is None else cfg.decode_max_rows,
            "decode_rows_per_expert": -1 if cfg.decode_rows_per_expert is None else cfg.decode_rows_per_expert,
            "tile": TILES[cfg.tile], "token_rows": TOKEN_ROWS[cfg.token_rows], "pdl": cfg.pdl,
            "split_k": cfg.split_k, "x_copy": X_COPY[cfg.x_copy]}


def test_defaults_are_in_force():
    cfg = sm.get_config()
    assert cfg == sm.Config() or os.environ.get("SAMOYEDS_PDL", "").strip()
    assert dataclasses.replace(cfg, pdl=True) == sm.Config()
    assert _C.get_config() == _in_c(cfg)
    assert sm.config is _config.override and sm.get_config is _config.get
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tile = "256x64"


def test_override_applies_restores_and_nests():
    before = sm.get_config()
    with sm.config(tile="256x64", token_rows="tma", decode_max_rows=0) as outer:
        assert sm.get_config() is outer
        assert (outer.tile, outer.token_rows, outer.decode_max_rows) == ("256x64", "tma", 0)
        assert outer.decode_rows_per_expert == before.decode_rows_per_expert and outer.pdl == before.pdl
        assert _C.get_config() == _in_c(outer)
        with sm.config(tile="128x128", pdl=False, decode_rows_per_expert=3, dense_decode_max_rows=0,
                       x_copy="always") as inner:
            assert (inner.tile, inner.token_rows, inner.pdl, inner.x_copy) == ("128x128", "tma", False, "always")
            assert (inner.decode_rows_per_expert, inner.dense_decode_max_rows) == (3, 0)
            assert _C.get_config() == _in_c(inner)
        assert sm.get_config() is outer and _C.get_config() == _in_c(outer)
    assert sm.get_config() is before and _C.get_config() == _in_c(before)


def test_override_restores_when_the_body_raises():
    before = sm.get_config()
    with pytest.raises(KeyError, match="inside"):
        with sm.config(token_rows="gather", decode_max_rows=12):
            assert _C.get_config()["token_rows"] == 1
            raise KeyError("inside")
    assert sm.get_config() is before and _C.get_config() == _in_c(before)


def test_a_call_alone_stays_in_force_and_checks_at_once():
    """samoyeds.config(...) as a statement changes the configuration for the process (it
    used to do nothing outside a with); a bad value raises at the call."""
    before = sm.get_config()
    try:
        sm.config(split_k=1, pdl=False)
        now = sm.get_config()
        assert (now.split_k, now.pdl) == (1, False) and now.tile == before.tile
        assert _C.get_config() == _in_c(now)
        with pytest.raises(ValueError, match=r"^split_k: "):
            sm.config(split_k=-1)
        assert sm.get_config() is now
        with sm.config(tile="256x64"):
            assert sm.get_config().split_k == 1
        assert sm.get_config() is now
    finally:
        sm.config(**dataclasses.asdict(before))
    assert sm.get_config() == before and _C.get_config() == _in_c(before)


@pytest.mark.parametrize("fields,name", [
    ({"tiles": "auto"}, "tiles"),
    ({"tile": "64x64"}, "tile"), ({"tile": 1}, "tile"),
    ({"token_rows": "rows"}, "token_rows"), ({"x_copy": "sometimes"}, "x_copy"), ({"x_copy": 2}, "x_copy"),
    ({"decode_max_rows": -1}, "decode_max_rows"), ({"decode_max_rows": 1.0}, "decode_max_rows"),
    ({"decode_max_rows": True}, "decode_max_rows"), ({"decode_rows_per_expert": 2**31}, "decode_rows_per_expert"),
    ({"pdl": 0}, "pdl"), ({"pdl": "no"}, "pdl"), ({"save_preact": 0}, "save_preact"), ({"dw_copy": "glu"}, "dw_copy"),
    ({"split_k": -1}, "split_k"), ({"split_k": None}, "split_k"), ({"split_k": True}, "split_k"),
    ({"dense_decode_max_rows": None}, "dense_decode_max_rows"),
    ({"dense_decode_max_rows": -3}, "dense_decode_max_rows"),
    ({"tile": "256x64", "token_rows": "x"}, "token_rows"),
])
def test_override_rejects_names_and_values_before_changing_anything(fields, name):
    before = sm.get_config()
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: "):
        with sm.config(**fields):
            pytest.fail("the body must not run")
    assert sm.get_config() is before and _C.get_config() == _in_c(before)
    if name != "tiles":   # (a Config is checked as it is made, too)
        with pytest.raises(ValueError, match=rf"^{re.escape(name)}: "):
            sm.Config(**fields)


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "SAMOYEDS_PDL"}
    full.update(env)
    return run_python(["-c", code], env=full)


@pytest.mark.parametrize("value,pdl", [(None, True), ("0", False), ("1", True), (" 0 ", False)])
def test_samoyeds_pdl_read_at_import(value, pdl):
    code = ("import samoyeds as sm, samoyeds._C as C\n"
            f"assert sm.get_config().pdl is {pdl} and C.get_config()['pdl'] is {pdl}, sm.get_config()\n")
    done = _fresh(code, **({} if value is None else {"SAMOYEDS_PDL": value}))
    assert done.returncode == 0, done.stderr[-2000:]


def test_samoyeds_pdl_not_a_number_fails_the_import():
    done = _fresh("import samoyeds", SAMOYEDS_PDL="off")
    assert done.returncode != 0 and "SAMOYEDS_PDL: expected 0 (off) or 1 (on), got 'off'" in done.stderr


def test_only_config_reads_the_environment():
    """No module of the package but _config.py reads an environment variable at run time."""
    pkg = os.path.dirname(os.path.abspath(sm.__file__))
    readers = []
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path) as fh:
                    if re.search(r"os\.environ|getenv\(", fh.read()):
                        readers.append(os.path.relpath(path, pkg))
    assert readers == ["_config.py"]
