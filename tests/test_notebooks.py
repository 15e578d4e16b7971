"""Every notebook in examples/ executes headless (nbclient) in its small CPU mode
(SAMOYEDS_NOTEBOOK_SMOKE=1: a re-run is the benchmark's --tiny --device cpu run into
a temporary folder, no figure is written into docs/, the temporary folders are
removed when the kernel exits), and every figure the plotting module makes from the
committed results renders."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
NOTEBOOKS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".ipynb")) if os.path.isdir(EXAMPLES) else []
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A kernelspec running this interpreter, importing the samoyeds these tests import; the
    smoke flag, the Agg backend, and a temporary folder of its own (removed with tmp_path)."""
    import samoyeds
    spec = tmp_path / "jupyter" / "kernels" / "samoyeds-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "samoyeds test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("SAMOYEDS_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("SAMOYEDS_RESULTS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(samoyeds.__file__)), os.environ.get("PYTHONPATH")) if p))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp_path


def _execute(name: str) -> list:
    nb = nbformat.read(os.path.join(EXAMPLES, name), as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="samoyeds-test", timeout=300,
                                     resources={"metadata": {"path": EXAMPLES}})
    client.execute()
    return ["".join(o.get("text", "") for o in c.get("outputs", []) if o.get("output_type") == "stream")
            for c in nb.cells if c.cell_type == "code"]


def _figures() -> set:
    d = os.path.join(ROOT, "docs", "figures")
    return {(f, os.path.getmtime(os.path.join(d, f))) for f in os.listdir(d)} if os.path.isdir(d) else set()


def test_every_notebook_is_tested():
    assert set(NOTEBOOKS) >= {"kernel.ipynb", "moe_layer.ipynb", "end_to_end.ipynb", "memory.ipynb",
                              "accuracy.ipynb", "quickstart.ipynb", "finetune.ipynb"}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_env):
    before = _figures()
    out = "\n".join(_execute(name))
    assert _figures() == before, "a smoke run must not write into docs/figures"
    left = os.listdir(kernel_env / "tmp")
    assert not [d for d in left if d.startswith("samoyeds-")], f"temporary folders left behind: {left}"
    if name == "finetune.ipynb":
        assert "identical logits True" in out and "the masks did not move" in out
    if name not in ("quickstart.ipynb", "accuracy.ipynb", "finetune.ipynb"):
        assert "--tiny --device cpu" in out, "the smoke run re-runs the benchmark's CPU mode"
        assert "samoyeds-nb-" in out and "command:" in out, "and plots what it wrote"


def test_accuracy_notebook_without_results(kernel_env, monkeypatch):
    empty = kernel_env / "results" / "h100"
    empty.mkdir(parents=True)
    monkeypatch.setenv("SAMOYEDS_RESULTS", str(empty))
    out = "\n".join(_execute("accuracy.ipynb"))
    assert "no " in out and "accuracy.json" in out and "nothing to plot" in out


def test_accuracy_notebook_with_results(kernel_env, monkeypatch):
    d = kernel_env / "results" / "cpu"
    d.mkdir(parents=True)
    shutil.copy(os.path.join(FIXTURES, "accuracy_test_mode.json"), d / "accuracy.json")
    monkeypatch.setenv("SAMOYEDS_RESULTS", str(d))
    out = "\n".join(_execute("accuracy.ipynb"))
    assert "nothing to plot" not in out and "finetuned_within_10pct_of_dense" in out


def test_figures_from_committed_results(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import plots

    plots.main(["--results", os.path.join(RESULTS, "h100"), "--out", str(tmp_path)])
    made = {f for f in os.listdir(tmp_path) if f.endswith(".png")}
    for png, js, _ in plots.FIGURES:
        if os.path.exists(os.path.join(RESULTS, "h100", js)):
            assert png + ".png" in made


def test_figures_go_to_docs_only_when_asked(monkeypatch, tmp_path):
    """nbutil.show writes a figure of the committed results into docs/figures only with
    nbutil.SAVE set; otherwise into a temporary folder that _cleanup removes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import nbutil

    committed = os.path.join(nbutil.COMMITTED, "h100")
    monkeypatch.setattr(nbutil, "SMOKE", False)
    monkeypatch.setattr(nbutil, "SAVE", False)
    monkeypatch.setattr(nbutil, "FIGURES", str(tmp_path / "figures"))
    monkeypatch.setattr(nbutil, "_TEMP", [])
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert nbutil.figure_path("x", committed) is None
    nbutil.show(plt.figure(), "x", committed)
    (tmp,) = nbutil._TEMP
    assert os.listdir(tmp) == ["x.png"] and not (tmp_path / "figures").exists()
    nbutil._cleanup()
    assert not os.path.exists(tmp)
    monkeypatch.setattr(nbutil, "SAVE", True)
    assert nbutil.figure_path("x", committed) == str(tmp_path / "figures" / "x.png")
    assert nbutil.figure_path("x", str(tmp_path)) is None  # results elsewhere: never docs/figures
    nbutil.show(plt.figure(), "x", committed)
    assert os.listdir(tmp_path / "figures") == ["x.png"]
