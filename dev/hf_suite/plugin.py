"""pytest plugin for run.py: patches every model of the ten families at its first forward
and records each test's outcome.

``samoyeds.patch_model`` runs on a model of one of the families' classes when its
``forward`` is first called with dense expert weights in memory (not on the meta device), so a
test's models run samoyeds' experts however the test built them (``model_class(config)``,
``from_pretrained``, copies).  The format is ``SAMOYEDS_SUITE_FORMAT`` (default
``samoyeds-1:2:128``); ``SAMOYEDS_SUITE_PATCH=0`` patches nothing (the baseline).  Outcomes
go to ``SAMOYEDS_SUITE_OUT`` (JSON lines): test id, outcome
(passed / failed / skipped), the first line of the failure, and whether a patched model ran a forward.
"""
from __future__ import annotations

import functools
import json
import os

import pytest

_PATCHED = {"count": 0}


def _install() -> None:
    import transformers

    import samoyeds
    from samoyeds.hf import UnsupportedModelError, is_patched
    from samoyeds.hf.experts import find_experts
    from samoyeds.hf.families import FAMILIES

    fmt = os.environ.get("SAMOYEDS_SUITE_FORMAT", "samoyeds-1:2:128")
    names = {f.model_class for f in FAMILIES.values()}
    for family in FAMILIES:
        prefix = FAMILIES[family].model_class.replace("ForCausalLM", "")
        names |= {n for n in dir(transformers) if n.startswith(prefix) and n.endswith(
            ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering"))}
    for name in sorted(names):
        cls = getattr(transformers, name, None)
        if cls is None or not isinstance(cls, type) or "forward" not in cls.__dict__:
            continue
        orig = cls.__dict__["forward"]

        @functools.wraps(orig)
        def forward(self, *args, __orig=orig, **kwargs):
            if not is_patched(self):
                try:
                    targets = find_experts(self)
                    dense = [t for t in targets if "gate_up_proj" in t.experts._parameters
                             and t.experts.gate_up_proj.device.type != "meta"]
                    if targets and len(dense) == len(targets):
                        samoyeds.patch_model(self, fmt, progress=False)
                except UnsupportedModelError:
                    pass
            if is_patched(self):  # patched here, by from_pretrained of a saved samoyeds model, or a copy
                _PATCHED["count"] += 1
            return __orig(self, *args, **kwargs)

        cls.forward = forward


def pytest_configure(config):
    if os.environ.get("SAMOYEDS_SUITE_PATCH", "1") != "0":  # "0": the unpatched baseline run.py compares with
        _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    before = _PATCHED["count"] if call.when == "setup" else None
    outcome = yield
    rep = outcome.get_result()
    if call.when == "setup":
        item._samoyeds_patched0 = before
    if (call.when == "call" or (call.when == "setup" and rep.outcome != "passed")) and os.environ.get(
            "SAMOYEDS_SUITE_OUT"):
        msg = ""
        if rep.outcome == "failed" and call.excinfo is not None:
            text = str(call.excinfo.value).strip()
            msg = f"{call.excinfo.typename}: {text.splitlines()[0][:300] if text else ''}"
        elif rep.outcome == "skipped" and isinstance(rep.longrepr, tuple):
            msg = str(rep.longrepr[2])[:300]
        rec = {"id": item.nodeid, "outcome": rep.outcome, "message": msg,
               "patched": _PATCHED["count"] > getattr(item, "_samoyeds_patched0", 0)}
        with open(os.environ["SAMOYEDS_SUITE_OUT"], "a") as f:
            f.write(json.dumps(rec) + "\n")
