"""The command line: ``python -m samoyeds demo`` and ``info``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from samoyeds.__main__ import main  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

SMALL = ["--hidden", "128", "--layers", "2", "--experts", "8", "--intermediate", "64", "--vocab", "256",
         "--tokens", "4", "--prompt-len", "8"]


def test_help_explains_options():
    out = subprocess.run([sys.executable, "-m", "samoyeds", "demo", "--help"], check=True, capture_output=True, cwd=HERE,
                         text=True).stdout
    for opt in ("--family", "--format", "--device", "--tokens", "qwen3_moe", "gpt_oss", "deepseek_v3"):
        assert opt in out


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "samoyeds-1:2:128"), ("gpt_oss", "2:4")])
def test_demo_cpu(family, fmt, tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--family", family, "--format", fmt, "--device", "cpu", *SMALL, "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "identical" in printed and "packed" in printed
    r = json.loads(path.read_text())
    assert r["family"] == family and r["format"] == fmt and r["device"] == "cpu"
    assert r["logits_max_abs_diff"] < 1e-4
    assert r["tokens_identical"] == r["tokens_total"] == 4
    assert r["expert_bytes_packed"] < 0.75 * r["expert_bytes_dense"]
    assert set(r["timing"]) == {"samoyeds", "masked-dense eager"}


def test_info_and_no_command(capsys):
    assert main(["info"]) == 0
    assert "cuda_available" in capsys.readouterr().out
    assert main([]) == 2


@pytest.mark.gpu
def test_demo_gpu(tmp_path):
    path = tmp_path / "demo.json"
    assert main(["demo", "--device", "cuda", *SMALL, "--block-tokens", "16", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["dtype"] == "bfloat16"
    for row in r["block_bench"]:
        assert row["rel_err_vs_masked_dense"] < 2e-2
        assert row["samoyeds_ms"] > 0 and row["grouped_mm_ms"] > 0


def test_block_bench_code_path_on_cpu(capsys):
    """The GPU block timing, run at a small shape on the CPU (C reference vs transformers)."""
    import torch

    import samoyeds as sm
    from samoyeds.__main__ import _block_bench

    rows = _block_bench(sm.SparseFormat.parse("samoyeds-1:2:128"), [5, 33], torch.float32, 0, device="cpu",
                        shapes={"small": (128, 64, 8, 2)})
    assert [r["T"] for r in rows] == [5, 33]
    for r in rows:
        assert r["rel_err_vs_masked_dense"] < 1e-5
        assert r["samoyeds_ms"] > 0 and r["grouped_mm_ms"] > 0
    assert "small" in capsys.readouterr().out
