"""The project's own promises: the README's two set-up commands, CI running the
test one, the build reporting what it compiled."""
from __future__ import annotations

import os
import re

import samoyeds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_commands() -> list:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    cmds = _setup_commands()
    assert len(cmds) == 2, cmds
    assert "python -m samoyeds demo" in cmds[0]
    assert "pytest" in cmds[1]
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert cmds[1] in ci


def test_build_info():
    info = samoyeds.build_info()
    assert info["version"] == samoyeds.__version__
    assert info["layout_version"] == samoyeds.PackedWeight.layout_version == 1
    assert isinstance(info["cuda_compiled"], bool) and isinstance(info["ws_drop"], bool)
    if info["cuda_compiled"]:
        assert info["cuda_archs"].startswith("sm_") and info["cuda_runtime_version"] >= 11000
    else:
        assert info["cuda_archs"] == "" and not samoyeds.cuda_available()
        assert info["ws_drop"] is False  # (the measurement switch lives in the CUDA kernels)


def test_import_does_not_pull_frameworks():
    import subprocess
    import sys
    code = "import sys, samoyeds; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    assert out.strip() == "False"
