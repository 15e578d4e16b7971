"""The command line: ``samoyeds demo``, ``info``, ``--version`` and its argument errors."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import samoyeds  # noqa: E402
from samoyeds import __main__ as cli  # noqa: E402
from samoyeds.__main__ import main  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# the folder holding the samoyeds package these tests import, so that a subprocess imports the same one
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(samoyeds.__file__)))

SMALL = ["--hidden", "128", "--layers", "2", "--experts", "8", "--intermediate", "64", "--vocab", "256",
         "--tokens", "8", "--prompt-len", "8"]


def _run(*args: str, exe=(sys.executable, "-m", "samoyeds")) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([*exe, *args], capture_output=True, text=True, cwd=HERE, env=env, timeout=300)


def test_help_explains_options():
    out = _run("demo", "--help")
    assert out.returncode == 0, out.stderr
    for opt in ("--family", "--format", "--device", "--tokens", "--block-tokens", "qwen3_moe", "gpt_oss",
                "deepseek_v3"):
        assert opt in out.stdout


BAD = [
    (["--format", "1:4"], "--format"),
    (["--format", "2:4:x"], "--format"),
    (["--top-k", "20"], "--top-k"),                       # more than the default 16 experts
    (["--experts", "4", "--top-k", "8"], "--top-k"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "1.5"], "--tokens"),
    (["--batch", "0"], "--batch"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--layers", "0"], "--layers"),
    (["--experts", "-3"], "--experts"),
    (["--hidden", "100"], "--hidden"),
    (["--intermediate", "99"], "--intermediate"),
    (["--format", "1:3:128"], "--hidden"),                # 256 rows are not groups of 3
    (["--format", "1:3:128", "--hidden", "96"], "--intermediate"),
    (["--vocab", "3"], "--vocab"),
    (["--seed", "-1"], "--seed"),
    (["--block-tokens", "abc"], "--block-tokens"),
    (["--block-tokens", "16,0"], "--block-tokens"),
    (["--block-tokens", ""], "--block-tokens"),
    (["--family", "gpt2"], "--family"),
    (["--device", "tpu"], "--device"),
    (["--dtype", "fp8"], "--dtype"),
    (["--json", "/nonexistent-folder/demo.json"], "--json"),
]


@pytest.mark.parametrize("argv,name", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_demo_rejects_bad_argument_in_one_line(argv, name, capsys, monkeypatch):
    def build(*_):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(cli, "_demo", build)
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("samoyeds demo: error: "), err
    assert f"argument {name}" in err, err


def test_bad_argument_through_the_command_has_no_traceback():
    out = _run("demo", "--top-k", "20")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "argument --top-k" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(samoyeds.cuda_available(), reason="a GPU is usable here")
def test_demo_device_cuda_without_gpu_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --device" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"samoyeds {samoyeds.__version__}"


@pytest.mark.skipif(shutil.which("samoyeds") is None, reason="the samoyeds console script is not installed")
def test_console_script_version():
    out = _run("--version", exe=(shutil.which("samoyeds"),))
    assert out.returncode == 0 and out.stdout.strip() == f"samoyeds {samoyeds.__version__}"


def test_info_in_words(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    info = samoyeds.build_info()
    assert out.splitlines()[0] == f"samoyeds {samoyeds.__version__}"
    # words, not the fields of build_info()
    for field in ("ws_drop", "cuda_runtime_version", "cuda_compiled", "cuda_available", "True", "False"):
        assert field not in out
    if info["cuda_compiled"]:
        assert f"compiled for {info['cuda_archs']}" in out
        assert re.search(r"CUDA runtime \d+\.\d+\)", out)
    else:
        assert "not compiled" in out and "SAMOYEDS_CUDA_ARCHS=90a pip install ." in out
    if not samoyeds.cuda_available():
        assert "the C reference runs" in out


def test_runtime_version_in_words():
    assert cli._runtime(13000) == "13.0"
    assert cli._runtime(12080) == "12.8"
    assert cli._runtime(None) == "unknown"


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "samoyeds-1:2:128"), ("gpt_oss", "2:4")])
def test_demo_cpu(family, fmt, tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--family", family, "--format", fmt, "--device", "cpu", *SMALL, "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(path.read_text())
    assert r["family"] == family and r["format"] == fmt and r["device"] == "cpu"
    assert r["logits_max_abs_diff"] < 1e-4
    assert r["tokens_identical"] == r["tokens_total"] == 8
    # varied text: the random model does not collapse to one repeated token
    assert len(set(r["tokens"][0])) >= 4, r["tokens"]
    # the reference path is not timed, and no speed is printed for it
    assert r["timing"] == {}
    assert not re.search(r"\d ms\b|tokens/s", printed), printed
    assert "reference" in printed
    # the memory line states the ratio of the bytes it reports, and what that ratio counts
    ratio = r["expert_bytes_packed"] / r["expert_bytes_dense"]
    assert r["density"] < ratio < 0.75
    assert f"= {cli._pct(ratio)} of the dense bytes" in printed
    # with float32 values the ratio is lower than the README's (bfloat16) one: the demo gives both
    r16 = r["expert_bytes_ratio_16bit"]
    assert ratio < r16 < 1 and f"{cli._pct(r16)} with the 2-byte bfloat16 values of the README's results" in printed
    assert f"keeps {cli._pct(r['density'])} of the expert weight values" in printed


def test_demo_init_varies_tokens_on_every_family():
    """The demo's init keeps a random model of every family from repeating one token."""
    import torch

    fam = cli._families()
    shape = fam.Shape(vocab=256, hidden=64, layers=2, experts=4, top_k=2, intermediate=32, head_dim=16)
    ids = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for family in sorted(fam.FAMILIES):
        model = fam.build_model(family, shape, seed=1)
        cli._init_weights(model, 1)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 min_new_tokens=12, pad_token_id=0)[:, 8:]
        assert min(len(set(row.tolist())) for row in out) >= 4, (family, out.tolist())


@pytest.mark.gpu
def test_demo_gpu(tmp_path):
    path = tmp_path / "demo.json"
    assert main(["demo", "--device", "cuda", *SMALL, "--block-tokens", "16", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["dtype"] == "bfloat16"
    assert set(r["timing"]) == {"samoyeds", "masked-dense eager"}
    for row in r["block_bench"]:
        assert row["rel_err_vs_masked_dense"] < 2e-2
        assert row["samoyeds_ms"] > 0 and row["grouped_mm_ms"] > 0


def test_block_bench_code_path_on_cpu(capsys):
    """The GPU block timing, run at a small shape on the CPU (C reference vs transformers)."""
    import torch

    rows = cli._block_bench(samoyeds.SparseFormat.parse("samoyeds-1:2:128"), [5, 33], torch.float32, 0,
                            device="cpu", shapes={"small": (128, 64, 8, 2)})
    assert [r["T"] for r in rows] == [5, 33]
    for r in rows:
        assert r["rel_err_vs_masked_dense"] < 1e-5
        assert r["samoyeds_ms"] > 0 and r["grouped_mm_ms"] > 0
    assert "small" in capsys.readouterr().out


@pytest.mark.parametrize("archs,cc,runs", [
    (["sm_90a"], (9, 0), True), (["sm_80"], (8, 6), True), (["sm_86"], (8, 0), False),
    (["sm_80"], (9, 0), False), (["sm_90a"], (10, 0), False), (["sm_80", "sm_100a"], (10, 0), True),
    (["sm_120a"], (12, 0), True), (["sm_100a"], (10, 3), False),
])
def test_info_knows_which_gpus_the_build_runs_on(archs, cc, runs):
    assert cli._arch_runs_on(archs, cc) is runs


def test_without_transformers_demo_says_what_to_install_and_info_runs(monkeypatch, capsys):
    def missing():
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(cli, "_families", missing)
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--family", "mixtral"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs torch and transformers" in err and "[hf]" in err
    assert main(["info"]) == 0
