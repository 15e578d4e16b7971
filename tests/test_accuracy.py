"""The accuracy study (benchmarks/accuracy.py) at test size: a small MoE causal LM
trained on the standard library's source for a few steps, pruned with every
pattern and method, fine-tuned with fixed masks, packed and reloaded.  Only the
orderings a short run can be trusted with are asserted, not the numbers."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import GPU  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import accuracy  # noqa: E402

transformers.logging.set_verbosity_error()


def test_corpus_is_the_stdlib_split_by_file():
    root, files = accuracy.stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    assert not any("site-packages" in f.split(os.sep) for f in files)
    held = [f for f in files if accuracy.is_heldout(f)]
    assert 0.02 < len(held) / len(files) < 0.1
    assert [f for f in files if accuracy.is_heldout(f)] == held, "the split is fixed"
    train, heldout, info = accuracy.load_corpus(max_files=200)
    assert info["files_train"] + info["files_heldout"] == 200 and info["files_heldout"] > 0
    assert train.dtype == torch.uint8 and train.numel() == info["bytes_train"] > 100_000
    assert b"def " in bytes(heldout[:200_000].tolist()) and b"import " in bytes(train[:200_000].tolist())
    w = accuracy.eval_windows(heldout, 8, 64)
    assert w.shape == (8, 64) and torch.equal(w, accuracy.eval_windows(heldout, 8, 64))


def test_training_is_reproducible():
    mode = accuracy.MODES["test"]
    train, _, _ = accuracy.load_corpus(max_files=50)
    hashes, losses = [], []
    for _ in range(2):
        model = accuracy.build(mode, seed=4, device="cpu")
        model.set_experts_implementation("eager")
        losses.append(accuracy.train(model, train, mode, steps=4, lr=1e-3, warmup=1, seed=5, device="cpu",
                                     log_every=0))
        hashes.append(accuracy.state_hash(model))
    assert hashes[0] == hashes[1] and losses[0] == losses[1]


def test_study_at_test_size(tmp_path, capsys):
    r = accuracy.run("test", "cpu", seed=0, out=str(tmp_path))
    printed = capsys.readouterr().out
    with open(tmp_path / "accuracy.json") as fh:
        saved = json.load(fh)
    assert saved["variants"] and saved["corpus"]["bytes_train"] > 0 and "commit" in saved["environment"]
    assert printed.strip().splitlines()[-4].startswith("Samoyeds 75% sparsegpt"), "the table comes last"

    assert r["training"]["final_train_loss"] < r["training"]["first_train_loss"] - 2.0, "the model learned"
    rows = {v["name"]: v for v in r["variants"]}
    assert all("error" not in v for v in rows.values()), [v.get("error") for v in rows.values()]
    dense = rows["dense"]["ppl"]
    assert dense < 40, "far below the 256 of a uniform byte model"
    for label in ("unstructured 75%", "VENOM-style 75%", "Samoyeds 75%"):
        mag, act, obs = (rows[f"{label} {m}"] for m in ("magnitude", "activation", "sparsegpt"))
        assert mag["sparsity"] == pytest.approx(0.75, abs=0.01)
        # calibrated masks reproduce the experts' outputs better than magnitude
        assert act["experts_output_error"] < mag["experts_output_error"]
        assert obs["experts_output_error"] < 0.8 * act["experts_output_error"]
        assert obs["ppl"] < mag["ppl"]
        assert rows[f"2:4 magnitude"]["ppl"] < mag["ppl"], "50 % loses less than 75 %"
        for v in (mag, act, obs):
            assert v["finetuned"]["masks_held"]
            assert v["finetuned"]["ppl"] < v["ppl"], "the masked fine-tune recovers"
    assert rows["Samoyeds 75% magnitude"]["experts_output_error"] <= \
        rows["Samoyeds 75% magnitude, per-half rows"]["experts_output_error"]
    packed = r["packed"]
    assert "error" not in packed, packed
    assert packed["samoyeds_ppl"] == pytest.approx(packed["masked_dense_ppl"], rel=1e-4)
    assert packed["reloaded_equal"]
    assert set(r["targets"]) == {"calibrated_loses_at_most_half_of_magnitude", "finetuned_within_10pct_of_dense",
                                 "finetuned_at_least_as_good_as_venom"}
    assert math.isfinite(r["targets"]["finetuned_within_10pct_of_dense"]["ppl"])


@pytest.mark.gpu
def test_study_gpu_path(tmp_path):
    """The GPU mode's code path (bf16 autocast, the training experts implementation
    picked on the device, packed bf16 model through the CUDA kernels) at test size."""
    assert GPU
    r = accuracy.run("test", "cuda", seed=0, out=str(tmp_path))
    rows = {v["name"]: v for v in r["variants"]}
    assert all("error" not in v for v in rows.values())
    assert "error" not in r["packed"], r["packed"]
    assert r["packed"]["samoyeds_ppl"] == pytest.approx(r["packed"]["masked_dense_ppl"], rel=2e-2)
