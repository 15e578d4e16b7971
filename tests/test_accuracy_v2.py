"""The accuracy study v2 (benchmarks/accuracy_v2.py) end to end at its tiny size on the CPU:
corpus, tokenizer, two MoE LMs pretrained for two seeds (the second flagged held out), every
variant one-shot and fine-tuned through both paths, the merge with mean, std and targets.
Only what a tiny run can be trusted with is asserted: the structure, finite numbers, and the
orderings that must hold."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import accuracy_v2 as acc  # noqa: E402
import accuracy_v2_data as data  # noqa: E402


def test_corpus_split_by_package_without_shared_lines(tmp_path):
    spec = data.CorpusSpec(max_bytes=600_000, max_package_bytes=60_000, english_max_bytes=50_000, vocab=300)
    sel = data.select_code(spec)
    train = {p["name"] for p in sel["train"]}
    held = {p["name"] for p in sel["heldout"]}
    assert train and held and not train & held, "held out by package"
    assert sel == data.select_code(spec), "the split is fixed"
    c = data.build(str(tmp_path), spec, log=lambda m: None)
    info = c.info
    assert set(info["sha256"]) == {"code_train", "code_heldout", "english_train", "english_heldout"}
    assert len(info["tokenizer"]["sha256"]) == 64 and c.vocab == 300
    assert all(p["version"] and len(p["sha256"]) == 64 for p in info["code"]["train_packages"])
    assert info["code"]["dedup"]["heldout_bytes_in_lines_also_in_train_after"] < 0.2
    c2 = data.build(str(tmp_path), spec, log=lambda m: None)
    assert c2.info["sha256"] == info["sha256"] and c2.info["key"] == info["key"]
    assert (c2.tokens["code_train"] == c.tokens["code_train"]).all(), "cached"


def test_plan_prints_every_stage(capsys):
    assert acc.main(["--plan"]) == 0
    out = capsys.readouterr().out
    for word in ("mixtral", "finegrained", "pretrain", "quarter-width", "variants", "device-minutes"):
        assert word in out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("acc2")
    assert acc.main(["--tiny", "--device", "cpu", "--out", str(out)]) == 0
    with open(out / "accuracy_v2.json") as fh:
        return out, json.load(fh)


def test_tiny_study_structure(tiny):
    out, r = tiny
    assert r["study"] == "accuracy_v2" and r["size"] == "tiny"
    assert r["seeds"] == [0, 1] and r["heldout_seeds"] == [1] and r["corpus_consistent"]
    assert "commit" in r["environment"] and r["environment"]["versions"]["torch"]
    assert len(r["corpus"]["sha256"]["code_train"]) == 64 and len(r["tokenizer"]["sha256"]) == 64
    assert {p["model"] for p in r["parts"]} == {"mixtral", "finegrained"}
    assert all(p["complete"] for p in r["parts"]), r["parts"]
    n_pruned = sum(len(p.get("methods", acc.METHODS)) for p in acc.patterns())
    for name, m in r["models"].items():
        v = m["variants"]
        assert len(v) == 3 + n_pruned, sorted(v)
        assert m["heldout_seeds"] == [1]
        assert all(not x["errors"] for x in v.values()), {k: x["errors"] for k, x in v.items() if x["errors"]}
        for k, x in v.items():
            for metric in ("code_ppl", "code_bpb", "code_acc", "english_ppl"):
                st = x["oneshot"][metric]
                assert st["n"] == 2 and math.isfinite(st["mean"]) and math.isfinite(st["std"]), (k, metric)
        curve = m["pretrain"]["0"]["heldout_curve"]
        assert curve[-1]["heldout_loss"] < curve[0]["heldout_loss"] - 0.5, "the model learned"
        assert m["pretrain"]["0"]["epochs"] < 1
        q = m["quarter"]["0"]
        assert q["config"]["intermediate"] * 4 == m["config"]["intermediate"]
        assert q["equal_compute"]["ratio"] == pytest.approx(1.0, abs=0.05)
        for t in m["targets"].values():
            assert t["met"] in (True, False, None) and t["quantity"]["n"] == 2


def test_tiny_study_orderings(tiny):
    out, r = tiny
    for name, m in r["models"].items():
        v = m["variants"]
        dense, floor = v["dense"]["oneshot"]["code_ppl"], v["floor (experts removed)"]["oneshot"]["code_ppl"]
        assert all(f > d for f, d in zip(floor["values"], dense["values"])), "the floor is worse than dense"
        assert v["2:4 magnitude"]["sparsity"] == pytest.approx(0.5)
        for k, x in v.items():
            if x["kind"] == "pruned" and not k.startswith("2:4"):
                assert x["sparsity"] == pytest.approx(0.75, abs=0.01), k
            if x["kind"] == "pruned":
                assert set(x["ft"]) == {"experts-1%", "all-1%", "experts-5%", "all-5%"}
                for cfg, paths in x["ft"].items():
                    assert ("samoyeds" in paths) == bool(x["packable"]), (k, cfg)
                    for p in ("masked", "samoyeds"):
                        if p in paths:
                            assert math.isfinite(paths[p]["code_ppl"]["mean"])
                    if "paths_code_loss_diff" in paths:   # the two paths are the same math in fp32
                        assert max(abs(d) for d in paths["paths_code_loss_diff"]["values"]) < 1e-3, (k, cfg)
        for pat in ("samoyeds-1:2:128", "venom-128:2:8", "unstructured-75"):
            mag = v[f"{pat} magnitude"]["experts_output_error"]["mean"]
            rec = v[f"{pat} sparsegpt"]["experts_output_error"]["mean"]
            assert rec < mag, (pat, rec, mag)
    for f in os.listdir(out / "accuracy_v2_parts"):
        with open(out / "accuracy_v2_parts" / f) as fh:
            part = json.load(fh)
        for k, row in part["variants"].items():
            for cfg, slot in (row.get("ft") or {}).items():
                if "masked" in slot and row["kind"] == "pruned":
                    assert slot["masked"]["masks_held"], (f, k, cfg)


def test_tiny_study_resumes_and_merges(tiny, capsys):
    out, r = tiny
    assert acc.main(["--tiny", "--device", "cpu", "--out", str(out), "--stage", "variants", "--seed", "0",
                     "--model", "mixtral"]) == 0
    assert "pretraining" not in capsys.readouterr().out, "checkpoints come from the cache"
    assert acc.main(["--tiny", "--device", "cpu", "--out", str(out), "--stage", "merge"]) == 0
    with open(out / "accuracy_v2.json") as fh:
        again = json.load(fh)
    assert again["models"]["mixtral"]["variants"] == r["models"]["mixtral"]["variants"]
