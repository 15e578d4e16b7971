"""The project's own promises: the README's two set-up commands run verbatim by CI, the
CUDA build for the GPUs that are there, the compile check over every supported
architecture, the license and citation, and a wheel that holds every subpackage."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import stat
import subprocess
import sys

import pytest

import samoyeds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(samoyeds.__file__)))

#: The README's two commands (CONTRACT.md): each alone in a fenced block, run verbatim by .ci/run.
DEMO_COMMAND = 'pip install torch==2.13.0 ".[hf]" && samoyeds demo'
TEST_COMMAND = 'pip install torch==2.13.0 ".[test]" && pytest tests -q'


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as fh:
        return fh.read()


def _fenced_lines(markdown: str) -> list:
    """Every line inside a fenced code block (``` or ~~~, any language tag), stripped."""
    lines, fence = [], None
    for line in markdown.splitlines():
        mark = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and mark:
            fence = mark.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is not None:
            lines.append(line.strip().removeprefix("$ "))
    return lines


def _ci_lines() -> list:
    return [line.strip() for line in _read(".ci", "run").splitlines()]


def _load_setup():
    """setup.py as a module (its setup() call runs only as __main__)."""
    pytest.importorskip("setuptools")
    spec = importlib.util.spec_from_file_location("samoyeds_setup", os.path.join(ROOT, "setup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _supported_archs() -> tuple:
    tree = ast.parse(_read("setup.py"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SUPPORTED_ARCHS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no SUPPORTED_ARCHS")


# --- README <-> CI -------------------------------------------------------------------------------

def test_readme_has_the_two_commands_in_fenced_blocks():
    fenced = _fenced_lines(_read("README.md"))
    assert DEMO_COMMAND in fenced, "README.md lacks the demo command in a fenced block"
    assert TEST_COMMAND in fenced, "README.md lacks the test command in a fenced block"


def test_ci_runs_every_readme_install_command_verbatim():
    ci = _ci_lines()
    readme = [line for line in _fenced_lines(_read("README.md")) if line.startswith("pip install torch==")]
    assert readme, "README.md has no 'pip install torch==...' command"
    for cmd in readme + [DEMO_COMMAND, TEST_COMMAND]:
        assert cmd in ci, f".ci/run does not run the README's command verbatim: {cmd}"


def test_ci_compile_check_covers_every_supported_arch():
    m = re.search(r'^ARCHS="([^"]*)"', _read(".ci", "run"), re.M)
    assert m, ".ci/run sets no ARCHS"
    assert tuple(m.group(1).split()) == _supported_archs()
    assert os.stat(os.path.join(ROOT, ".ci", "run")).st_mode & stat.S_IXUSR


# --- the CUDA build: the visible GPUs' architectures -----------------------------------------------

def _fake_tool(folder, name: str, script: str) -> str:
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """nvidia-smi listing an H100 (9.0) and an A10 (8.6) first on PATH."""
    _fake_tool(tmp_path, "nvidia-smi", 'echo "0, GPU-5f1c0e2a-aaaa, 9.0"\necho "1, GPU-77b0d4e1-bbbb, 8.6"\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SAMOYEDS_CUDA_ARCHS", raising=False)
    return tmp_path


@pytest.mark.parametrize("cap,arch", [("8.0", "80"), ("8.6", "86"), ("8.9", "89"), ("9.0", "90a"),
                                      ("10.0", "100a"), ("12.0", "120a")])
def test_compute_capability_to_arch(cap, arch):
    assert _load_setup()._arch_of(cap) == arch


def test_builds_for_the_visible_gpus(fake_smi, monkeypatch):
    setup = _load_setup()
    assert setup._visible_archs() == (["86", "90a"], None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert setup._visible_archs() == (["86"], None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1c0e2a")
    assert setup._visible_archs() == (["90a"], None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    archs, why = setup._visible_archs()
    assert archs == [] and "CUDA_VISIBLE_DEVICES" in why


def test_explicit_archs_win_and_all_means_supported(fake_smi, monkeypatch):
    setup = _load_setup()
    nvcc = _fake_tool(fake_smi, "nvcc", "echo compute_80; echo compute_86; echo compute_90\n")
    assert setup.BuildExt._archs(nvcc) == ("86;90a", None)
    monkeypatch.setenv("SAMOYEDS_CUDA_ARCHS", "89")
    assert setup.BuildExt._archs(nvcc) == ("89", None)
    monkeypatch.setenv("SAMOYEDS_CUDA_ARCHS", "all")
    assert setup.BuildExt._archs(nvcc) == (";".join(setup.SUPPORTED_ARCHS), None)
    flags, names = setup._gencode(";".join(setup.SUPPORTED_ARCHS))
    assert names == [f"sm_{a}" for a in setup.SUPPORTED_ARCHS]
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags


def test_no_visible_gpu_builds_the_reference_and_says_how(tmp_path, monkeypatch):
    setup = _load_setup()
    monkeypatch.setenv("PATH", str(tmp_path))                 # no nvidia-smi
    monkeypatch.delenv("SAMOYEDS_CUDA_ARCHS", raising=False)
    archs, why = setup.BuildExt._archs("/opt/cuda/bin/nvcc")
    assert archs is None and "nvidia-smi" in why
    assert "SAMOYEDS_CUDA_ARCHS=90a pip install ." in setup.HOW_TO_BUILD_KERNELS


def test_nvidia_smi_failure_is_reported(tmp_path, monkeypatch):
    setup = _load_setup()
    _fake_tool(tmp_path, "nvidia-smi", 'echo "No devices were found"; exit 6\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert setup._visible_archs() == ([], "nvidia-smi lists no GPU (No devices were found)")


def test_gpu_newer_than_nvcc_is_a_clear_error(fake_smi):
    setup = _load_setup()
    nvcc = _fake_tool(fake_smi, "nvcc", "echo compute_80; echo compute_86\n")    # knows no sm_90
    with pytest.raises(SystemExit, match="sm_90a.*SAMOYEDS_CUDA_ARCHS"):
        setup.BuildExt._archs(nvcc)


def test_build_info():
    info = samoyeds.build_info()
    assert info["version"] == samoyeds.__version__
    assert info["layout_version"] == samoyeds.PackedWeight.layout_version == 1
    assert isinstance(info["cuda_compiled"], bool)
    if info["cuda_compiled"]:
        assert info["cuda_archs"].startswith("sm_") and info["cuda_runtime_version"] >= 11000
    else:
        assert info["cuda_archs"] == "" and not samoyeds.cuda_available()


def test_import_does_not_pull_frameworks():
    code = "import sys, samoyeds; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), env=env).stdout
    assert out.strip() == "False"


# --- license, citation, wheel contents ---------------------------------------------------------------

def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads(_read("pyproject.toml"))


def test_license_is_the_apache_2_text_pyproject_names():
    text = _read("LICENSE")
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    for section in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "2. Grant of Copyright License",
                    "3. Grant of Patent License", "9. Accepting Warranty or Additional Liability",
                    "END OF TERMS AND CONDITIONS", "APPENDIX: How to apply the Apache License to your work"):
        assert section in text
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and "LICENSE" in project["license-files"]


def test_citation_names_the_paper_and_this_version():
    cff = _read("CITATION.cff")
    assert re.search(r"^cff-version: 1\.2\.0$", cff, re.M)
    assert re.search(rf"^version: {re.escape(samoyeds.__version__)}$", cff, re.M)
    assert "Samoyeds: Accelerating MoE Models with Structured Sparsity Leveraging Sparse Tensor Cores" in cff
    assert "doi: 10.1145/3689031.3717455" in cff and "EuroSys" in cff


def _source_packages() -> list:
    found = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, "samoyeds")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found.append(os.path.relpath(folder, ROOT).replace(os.sep, "."))
    return sorted(found)


def test_pyproject_packages_every_subpackage():
    import fnmatch

    find = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    for pkg in _source_packages():
        assert any(fnmatch.fnmatchcase(pkg, pat) for pat in find["include"]), f"{pkg} is left out of the wheel"


def test_installed_distribution_holds_every_subpackage_and_the_license():
    from importlib import metadata

    if os.path.commonpath([os.path.abspath(samoyeds.__file__), ROOT]) == ROOT:
        pytest.skip("samoyeds is imported from the source tree, not from an installed wheel")
    files = {str(f).replace(os.sep, "/") for f in metadata.distribution("samoyeds").files or ()}
    for pkg in _source_packages():
        assert pkg.replace(".", "/") + "/__init__.py" in files, f"the installed samoyeds lacks {pkg}"
    assert any(f.endswith("/LICENSE") and ".dist-info/" in f for f in files)
    assert any(f.startswith("samoyeds/_C.") for f in files)
