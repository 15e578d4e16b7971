"""Portability: the CUDA kernels compile for every architecture samoyeds supports
(sm_80 A100, sm_86 RTX 30xx/A10, sm_89 L4/RTX 40xx, sm_90a H100/H200), and the
package builds and imports as one fat binary holding all four.  No GPU needed.

Two steps on a copy of the committed sources (``git archive``; ``--worktree``
takes the working tree instead):
  1. per architecture, every ``cuda/*.cu`` compiled to a cubin (device code only)
     with the flags setup.py uses: success, seconds, cubin bytes, ptxas spills;
  2. ``SAMOYEDS_CUDA_ARCHS="80;86;89;90a" python setup.py build_ext --inplace``:
     the extension's size, and ``samoyeds.build_info()`` of the result.
Results: benchmarks/results/portability.json (``--out`` to change).

  python dev/lab/portability.py [--archs 80,86,89,90a] [--worktree] [--out PATH] [--jobs N]
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# setup.py's nvcc flags (SAMOYEDS_NVCC_FLAGS aside); -cubin replaces -c -Xcompiler -fPIC
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr", "-Xptxas", "-warn-spills"]


def _run(cmd, cwd=None, env=None):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0


def _commit(tree: str) -> str:
    rc, out, _ = _run(["git", "rev-parse", "HEAD"], cwd=tree)
    return out.strip() if rc == 0 else "unknown"


def _export(rev: str, dest: str) -> None:
    """The committed tree at rev, without .git (what a user's checkout holds)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)


def _gencode(arch: str) -> list:
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def _nvcc() -> str:
    for c in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc"),
              "/usr/local/cuda/bin/nvcc"):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SystemExit("portability: nvcc not found (CUDA_HOME, PATH, /usr/local/cuda)")


def compile_arch(nvcc: str, tree: str, arch: str, out_dir: str, jobs: int) -> dict:
    cuda = os.path.join(tree, "cuda")
    sources = sorted(f for f in os.listdir(cuda) if f.endswith(".cu"))

    def one(src):
        cubin = os.path.join(out_dir, f"{src[:-3]}.sm_{arch}.cubin")
        cmd = [nvcc, "-cubin", os.path.join(cuda, src), "-o", cubin, "-I", cuda] + NVCC_FLAGS + _gencode(arch)
        rc, log, secs = _run(cmd)
        spills = sorted(set(re.findall(r"(\d+) bytes spill stores", log)) - {"0"})
        res = {"ok": rc == 0, "seconds": round(secs, 1),
               "cubin_bytes": os.path.getsize(cubin) if rc == 0 and os.path.exists(cubin) else None,
               "spill_store_bytes": [int(s) for s in spills]}
        if rc != 0:
            res["log_tail"] = log[-2000:]
        return src, res

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        files = dict(pool.map(one, sources))
    ok = all(f["ok"] for f in files.values())
    return {"ok": ok, "cubin_bytes": sum(f["cubin_bytes"] or 0 for f in files.values()) if ok else None,
            "seconds": round(sum(f["seconds"] for f in files.values()), 1), "files": files}


def build_fat(tree: str, archs: list, jobs: int) -> dict:
    env = dict(os.environ, SAMOYEDS_CUDA_ARCHS=";".join(archs), SAMOYEDS_BUILD_JOBS=str(jobs))
    env.pop("SAMOYEDS_SKIP_CUDA", None)
    rc, log, secs = _run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env)
    res = {"ok": rc == 0, "seconds": round(secs, 1), "archs": ";".join(archs)}
    if rc != 0:
        res["log_tail"] = log[-3000:]
        return res
    so = glob.glob(os.path.join(tree, "samoyeds", "_C*.so"))
    res["extension_bytes"] = os.path.getsize(so[0]) if so else None
    objs = glob.glob(os.path.join(tree, "build", "cuda-*", "*.o"))
    res["cuda_object_bytes"] = sum(os.path.getsize(o) for o in objs)
    code = "import json, samoyeds; print(json.dumps(samoyeds.build_info()))"
    rc, out, _ = _run([sys.executable, "-c", code], cwd=tree, env=dict(os.environ, PYTHONPATH=tree))
    res["import_ok"] = rc == 0
    if rc == 0:
        res["build_info"] = json.loads(out.strip().splitlines()[-1])
        want = " ".join(f"sm_{a}" for a in archs)
        res["ok"] = res["build_info"].get("cuda_archs") == want
    else:
        res["ok"] = False
        res["log_tail"] = out[-2000:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="80,86,89,90a")
    ap.add_argument("--rev", default="HEAD", help="commit to export (ignored with --worktree)")
    ap.add_argument("--worktree", action="store_true", help="compile the working tree as it is")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "portability.json"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-fat", action="store_true", help="per-architecture cubins only")
    args = ap.parse_args()
    archs = [a.strip() for a in re.split(r"[;,\s]+", args.archs) if a.strip()]
    nvcc = _nvcc()
    rc, ver, _ = _run([nvcc, "--version"])
    tmp = tempfile.mkdtemp(prefix="samoyeds-port-")
    try:
        if args.worktree:
            tree = os.path.join(tmp, "src")
            shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", "build", "*.so", "__pycache__"))
            commit = _commit(ROOT) + "+worktree"
        else:
            tree = os.path.join(tmp, "src")
            os.makedirs(tree)
            _export(args.rev, tree)
            rc, out, _ = _run(["git", "rev-parse", args.rev], cwd=ROOT)
            commit = out.strip()
        cubins = os.path.join(tmp, "cubin")
        os.makedirs(cubins)
        result = {
            "env": {"command": " ".join(["python"] + [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                    "commit": commit,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "nvcc": ver.strip().splitlines()[-1] if ver.strip() else "?",
                    "host": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version()},
            "nvcc_flags": NVCC_FLAGS, "archs": {},
        }
        for arch in archs:
            print(f"compiling cuda/*.cu for sm_{arch} ...", flush=True)
            r = compile_arch(nvcc, tree, arch, cubins, args.jobs)
            result["archs"][f"sm_{arch}"] = r
            print(f"  sm_{arch}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']} s (compile time summed), "
                  f"cubins {r['cubin_bytes']} bytes", flush=True)
        if not args.skip_fat:
            print(f"building the package for {';'.join(archs)} ...", flush=True)
            fat = build_fat(tree, archs, args.jobs)
            result["package_build"] = fat
            print(f"  package: {'ok' if fat['ok'] else 'FAILED'} in {fat['seconds']} s, extension "
                  f"{fat.get('extension_bytes')} bytes, build_info.cuda_archs="
                  f"{fat.get('build_info', {}).get('cuda_archs')!r}", flush=True)
        result["ok"] = all(r["ok"] for r in result["archs"].values()) and \
            result.get("package_build", {"ok": True})["ok"]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.out}")
        return 0 if result["ok"] else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
