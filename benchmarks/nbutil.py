"""What the notebooks in examples/ share: where the results are, re-running a
benchmark, showing and saving a figure.

A figure is written into docs/figures (a tracked file) only when the notebook asks for it
(``nbutil.SAVE = True``) and it shows the committed results; otherwise it goes to a temporary
folder, removed with the other temporary folders of this module when the process exits.

Environment (read by these notebooks only, not by the package):
  SAMOYEDS_NOTEBOOK_SMOKE=1   CI: a re-run is the script's ``--tiny --device cpu`` mode into a
                              temporary folder, and no figure is written into docs/figures
  SAMOYEDS_RESULTS=DIR        results to read (default benchmarks/results/h100)
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SMOKE = os.environ.get("SAMOYEDS_NOTEBOOK_SMOKE", "") not in ("", "0")
COMMITTED = os.path.join(HERE, "results")
RESULTS = os.environ.get("SAMOYEDS_RESULTS") or os.path.join(COMMITTED, "h100")
FIGURES = os.path.join(ROOT, "docs", "figures")
SAVE = False  # True: show() also writes the committed results' figures into docs/figures
_TEMP: list = []


def _cleanup() -> None:
    for d in _TEMP:
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_cleanup)


def temp_dir(prefix: str = "samoyeds-nb-") -> str:
    """A temporary folder removed when the process exits."""
    d = tempfile.mkdtemp(prefix=prefix)
    _TEMP.append(d)
    return d


def run(script: str, *args: str, out: Optional[str] = None, smoke_args=("--tiny", "--device", "cpu")) -> str:
    """Runs ``benchmarks/<script>`` (a path with a folder: from the repository root, e.g.
    ``dev/lab/bench_dense_decode.py``) and returns the folder its JSON is in (``out``).

    On a GPU the results go by default where the script puts them
    (benchmarks/results/<gpu>/); in smoke mode the script's CPU smoke run writes
    into a temporary folder.  The script's output is shown as it comes."""
    path = os.path.join(ROOT, script) if "/" in script else os.path.join(HERE, script)
    if SMOKE:
        out = out or temp_dir()
        cmd = [sys.executable, path, *smoke_args, "--out", out, *args]
    else:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("RUN = True re-runs the benchmark on a CUDA GPU; torch sees none here")
        sys.path.insert(0, HERE)
        from common import gpu_dir
        out = out or gpu_dir(None)
        cmd = [sys.executable, path, "--out", out, *args]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for line in p.stdout:
        print(line, end="", flush=True)
    if p.wait() != 0:
        raise RuntimeError(f"{script} exited with status {p.returncode}")
    return out


def load(name: str, results: Optional[str] = None) -> Optional[dict]:
    """The parsed ``results/name`` and a line saying where it comes from; None (said
    so) when the file does not exist."""
    results = results or RESULTS
    path = os.path.join(results, name)
    if not os.path.exists(path):
        print(f"no {os.path.relpath(path, ROOT)} yet: run the benchmark on a GPU (RUN = True, or "
              f"benchmarks/gpu_check.sh) to make it")
        return None
    with open(path) as fh:
        d = json.load(fh)
    env = d.get("env") or d.get("environment") or {}
    print(f"{os.path.relpath(path, ROOT)}: {env.get('device', 'CPU')}, commit {str(env.get('commit', '?'))[:10]}, "
          f"{env.get('date', '?')}\n  command: {env.get('command', '?')}")
    return d


def figure_path(name: str, results: str) -> Optional[str]:
    """docs/figures/<name>.png for the committed H100 results (<name>_<gpu>.png for another
    GPU's) when SAVE is set; None for results elsewhere, in smoke mode or without SAVE."""
    results = os.path.abspath(results)
    if SMOKE or not SAVE or os.path.dirname(results) != os.path.abspath(COMMITTED):
        return None
    gpu = os.path.basename(results)
    return os.path.join(FIGURES, name + ("" if gpu == "h100" else f"_{gpu}") + ".png")


def show(fig, name: str, results: Optional[str] = None) -> None:
    """Displays fig; saves it under docs/figures when SAVE is set and it shows committed
    results, else into a temporary folder (removed at exit)."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    path = figure_path(name, results or RESULTS)
    if path is None:
        if not _TEMP:
            temp_dir()
        path = os.path.join(_TEMP[0], name + ".png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        print(f"saved {os.path.relpath(path, ROOT)}")
    display(fig)
    plt.close(fig)


def markdown(text: str) -> None:
    from IPython.display import Markdown, display
    display(Markdown(text))
