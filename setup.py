"""Build of samoyeds._C: C sources in csrc/ (CPython + NumPy C API) and, when
nvcc is found, the CUDA kernels in cuda/ compiled by nvcc and linked in.

Environment:
  SAMOYEDS_SKIP_CUDA=1        CPU-only build (the C reference ops only).
  SAMOYEDS_CUDA_ARCHS=80;90a  architectures; "90a" means
                              -gencode=arch=compute_90a,code=sm_90a.
  SAMOYEDS_BUILD_JOBS=N       parallel nvcc processes (default: CPU count).
  CUDA_HOME                   toolkit root (else nvcc on PATH, else /usr/local/cuda).
No torch is needed to build: tensors enter the extension through DLPack.
"""
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    with open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8") as fh:
        return re.search(r'^version\s*=\s*"([^"]+)"', fh.read(), re.M).group(1)


def _find_nvcc():
    if os.environ.get("SAMOYEDS_SKIP_CUDA", "0") not in ("", "0"):
        return None, "SAMOYEDS_SKIP_CUDA is set"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = []
    if home:
        candidates.append(os.path.join(home, "bin", "nvcc"))
    which = shutil.which("nvcc")
    if which:
        candidates.append(which)
    candidates.append("/usr/local/cuda/bin/nvcc")
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.realpath(c), None
    return None, "nvcc was not found (CUDA_HOME, PATH, /usr/local/cuda)"


def _cudart_dir(nvcc):
    """The folder holding libcudart_static.a (nvcc may be a wrapper script)."""
    roots = [os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(nvcc))]
    try:  # nvcc tells where it lives
        with open(os.devnull, "w") as null:
            out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                                 capture_output=True, text=True, stdin=null).stderr
        m = re.search(r"^#\$ TOP=(.+)$", out, re.M)
        if m:
            roots.append(os.path.realpath(m.group(1).strip()))
    except OSError:
        pass
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        for lib in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                    os.path.join("targets", "sbsa-linux", "lib")):
            d = os.path.join(root, lib)
            if os.path.isfile(os.path.join(d, "libcudart_static.a")):
                return d
    raise SystemExit(f"samoyeds: found {nvcc} but not libcudart_static.a next to it; set CUDA_HOME "
                     "or SAMOYEDS_SKIP_CUDA=1")


def _gencode(archs):
    flags, names = [], []
    for a in re.split(r"[;,\s]+", archs.strip()):
        if not a:
            continue
        m = re.fullmatch(r"(?:sm_)?(\d+)([a-z]?)(\+PTX)?", a)
        if not m:
            raise SystemExit(f"SAMOYEDS_CUDA_ARCHS: cannot parse {a!r} (expected e.g. 80;86;89;90a)")
        num, suffix, ptx = m.group(1), m.group(2), m.group(3)
        flags.append(f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num}{suffix},code=compute_{num}{suffix}")
        names.append(f"sm_{num}{suffix}")
    return flags, names


class BuildExt(build_ext):
    def build_extensions(self):
        nvcc, why = _find_nvcc()
        ext = self.extensions[0]
        if nvcc is None:
            print(f"samoyeds: building WITHOUT CUDA kernels ({why}); only the C reference ops "
                  "will be available.", file=sys.stderr)
            ext.define_macros.append(("SAM_WITH_CUDA", "0"))
        else:
            objects = self._compile_cuda(nvcc)
            ext.define_macros.append(("SAM_WITH_CUDA", "1"))
            ext.extra_objects.extend(objects)
            ext.library_dirs.append(_cudart_dir(nvcc))
            ext.libraries.extend(["cudart_static", "stdc++", "rt", "pthread", "dl"])
        super().build_extensions()

    def _compile_cuda(self, nvcc):
        archs = os.environ.get("SAMOYEDS_CUDA_ARCHS", "80;90a")
        gencode, names = _gencode(archs)
        print(f"samoyeds: compiling CUDA kernels with {nvcc} for {' '.join(names)}", file=sys.stderr)
        cuda_dir = os.path.join(HERE, "cuda")
        sources = sorted(os.path.join(cuda_dir, f) for f in os.listdir(cuda_dir) if f.endswith(".cu"))
        headers = [os.path.join(cuda_dir, f) for f in os.listdir(cuda_dir) if f.endswith((".h", ".cuh"))]
        newest_header = max((os.path.getmtime(h) for h in headers), default=0)
        # a fixed folder, so that editable rebuilds only recompile what changed
        out_dir = os.path.join(HERE, "build", "cuda-" + "-".join(names))
        os.makedirs(out_dir, exist_ok=True)
        flags = [
            "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", "--expt-relaxed-constexpr",
            "-Xptxas", "-warn-spills", f'-DSAM_ARCHS="{" ".join(names)}"', "-I", cuda_dir,
        ] + gencode
        flags += os.environ.get("SAMOYEDS_NVCC_FLAGS", "").split()

        def compile_one(src):
            obj = os.path.join(out_dir, os.path.basename(src)[:-3] + ".o")
            stamp = obj + ".flags"
            key = " ".join(flags)
            fresh = (os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header)
                     and os.path.exists(stamp) and open(stamp).read() == key)
            if not fresh:
                cmd = [nvcc, "-c", src, "-o", obj] + flags
                print("  " + " ".join(cmd), file=sys.stderr)
                subprocess.run(cmd, check=True)
                with open(stamp, "w") as fh:
                    fh.write(key)
            return obj

        jobs = int(os.environ.get("SAMOYEDS_BUILD_JOBS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(compile_one, sources))


ext = Extension(
    "samoyeds._C",
    sources=sorted(os.path.join("csrc", f) for f in os.listdir(os.path.join(HERE, "csrc")) if f.endswith(".c")),
    include_dirs=[np.get_include(), os.path.join(HERE, "cuda"), os.path.join(HERE, "csrc")],
    define_macros=[("SAM_VERSION", f'"{_version()}"')],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wno-missing-braces"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
