"""Build of samoyeds._C: C sources in csrc/ (CPython + NumPy C API) and, when
nvcc is found, the CUDA kernels in cuda/ compiled by nvcc and linked in.

Which architectures: SAMOYEDS_CUDA_ARCHS when set; else those of the GPUs that
nvidia-smi sees (and CUDA_VISIBLE_DEVICES leaves visible): compute capability
9.0 -> 90a, 8.6 -> 86, 10.0 -> 100a (from 9.0 on, the arch-specific "a" target,
which the wgmma.sp kernels need).  With no GPU visible the build holds the C
reference only and says in one line how to build the kernels.

Environment:
  SAMOYEDS_CUDA_ARCHS=80;90a  architectures; "90a" means
                              -gencode=arch=compute_90a,code=sm_90a; "all" means
                              SUPPORTED_ARCHS; a "+PTX" suffix adds PTX.
  SAMOYEDS_SKIP_CUDA=1        CPU-only build (the C reference ops only).
  SAMOYEDS_BUILD_JOBS=N       parallel nvcc processes (default: CPU count).
  SAMOYEDS_NVCC_FLAGS=...     extra nvcc flags.
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

#: The architectures the kernels build for: mma.sp on sm_80/86/89, wgmma.sp on sm_90a; Blackwell
#: (sm_100a/120a) compiles and takes the mma.sp path, not yet run on such a GPU here.  .ci/run
#: compiles every one of them.
SUPPORTED_ARCHS = ("80", "86", "89", "90a", "100a", "120a")

#: The one line a build without kernels prints (and ``samoyeds info`` repeats).
HOW_TO_BUILD_KERNELS = "to build the CUDA kernels: SAMOYEDS_CUDA_ARCHS=90a pip install . (90a: H100/H200; 80: A100)"


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


def _arch_of(compute_cap):
    """nvidia-smi's compute capability as a SAMOYEDS_CUDA_ARCHS entry: 9.0 -> 90a, 8.6 -> 86."""
    major, minor = (int(x) for x in compute_cap.split("."))
    return f"{major}{minor}" + ("a" if major >= 9 else "")


def _visible_archs():
    """(architectures of the visible GPUs, oldest first, or [], why there are none).
    Visible: listed by nvidia-smi and, when CUDA_VISIBLE_DEVICES is set, named there
    by index or UUID (prefix)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "nvidia-smi was not found"
    try:
        out = subprocess.run([smi, "--query-gpu=index,uuid,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return [], f"nvidia-smi failed: {e}"
    rows = [[f.strip() for f in line.split(",")] for line in out.stdout.splitlines() if line.count(",") == 2]
    if out.returncode != 0 or not rows:
        said = (out.stdout.strip() or out.stderr.strip()).splitlines()
        return [], f"nvidia-smi lists no GPU ({said[0].strip()})" if said else "nvidia-smi lists no GPU"
    wanted = os.environ.get("CUDA_VISIBLE_DEVICES")
    if wanted is not None:
        names = [w.strip() for w in wanted.split(",") if w.strip()]
        rows = [r for r in rows if any(n == r[0] or (n.startswith("GPU-") and r[1].startswith(n)) for n in names)]
        if not rows:
            return [], f"CUDA_VISIBLE_DEVICES={wanted!r} hides every GPU"
    archs, old = [], []
    for _, _, cap in rows:
        if not re.fullmatch(r"\d+\.\d+", cap):
            continue
        if int(cap.split(".")[0]) < 8:
            old.append(cap)
        elif _arch_of(cap) not in archs:
            archs.append(_arch_of(cap))
    if not archs:
        return [], f"the GPUs' compute capability {', '.join(old) or '?'} is below 8.0 (the kernels need sm_80)"
    return sorted(archs, key=lambda a: int(a.rstrip("a"))), None


def _nvcc_archs(nvcc):
    """The compute_XX names this nvcc can build, or None when it does not say."""
    try:
        out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    found = set(re.findall(r"compute_(\d+)", out.stdout))
    return found if out.returncode == 0 and found else None


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
        archs = None
        if nvcc is not None:
            archs, why = self._archs(nvcc)
        if nvcc is None or archs is None:
            print(f"samoyeds: building the C reference only ({why}); {HOW_TO_BUILD_KERNELS}", file=sys.stderr)
            ext.define_macros.append(("SAM_WITH_CUDA", "0"))
        else:
            objects = self._compile_cuda(nvcc, archs)
            ext.define_macros.append(("SAM_WITH_CUDA", "1"))
            ext.extra_objects.extend(objects)
            ext.library_dirs.append(_cudart_dir(nvcc))
            ext.libraries.extend(["cudart_static", "stdc++", "rt", "pthread", "dl"])
        super().build_extensions()

    @staticmethod
    def _archs(nvcc):
        """(SAMOYEDS_CUDA_ARCHS or the visible GPUs' architectures, None) or (None, why not)."""
        archs = os.environ.get("SAMOYEDS_CUDA_ARCHS", "").strip()
        if archs.lower() == "all":
            return ";".join(SUPPORTED_ARCHS), None
        if archs:
            return archs, None
        visible, why = _visible_archs()
        if not visible:
            return None, f"found {nvcc} but no GPU to build for: {why}"
        known = _nvcc_archs(nvcc)
        missing = [a for a in visible if known is not None and a.rstrip("a") not in known]
        if missing:
            raise SystemExit(f"samoyeds: the visible GPU needs sm_{missing[0]}, which {nvcc} cannot build; "
                             "install a newer CUDA toolkit, or set SAMOYEDS_CUDA_ARCHS (e.g. 90a) or "
                             "SAMOYEDS_SKIP_CUDA=1")
        return ";".join(visible), None

    def _compile_cuda(self, nvcc, archs):
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


def _extension():
    return Extension(
        "samoyeds._C",
        sources=sorted(os.path.join("csrc", f) for f in os.listdir(os.path.join(HERE, "csrc")) if f.endswith(".c")),
        include_dirs=[np.get_include(), os.path.join(HERE, "cuda"), os.path.join(HERE, "csrc")],
        define_macros=[("SAM_VERSION", f'"{_version()}"')],
        extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wno-missing-braces"],
    )


if __name__ == "__main__":  # pip (setuptools.build_meta) and `python setup.py` run it as __main__
    setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildExt})
