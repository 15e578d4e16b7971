"""transformers' own common model tests on samoyeds-patched models of the ten families.

    python dev/hf_suite/run.py [--src DIR] [--families mixtral,...] [-k EXPR | --training] [--json PATH] [--md PATH]

``--src``: transformers' ``tests/`` folder of the installed version.  Without it, the
sdist of the installed version is fetched with ``pip download transformers==<version>
--no-binary :all: --no-deps`` into ``build/hf_suite/`` and its ``tests/`` used.  The sdist
holds ``tests/test_modeling_common.py`` (``ModelTesterMixin``, the common tests) but not
``tests/models/`` (the per-family test files), ``tests/generation/`` or ``tests/exporters/``;
so the families' testers are samoyeds' own (families_test.py: the families' configs from
``samoyeds.hf.families``), and the generation and export mixins, absent, are empty classes.
With a git checkout of transformers (``--src <checkout>/tests``) the same applies: the
mixins it has are used.

Every model of the families is patched at its first forward (plugin.py).  Each family runs
in its own pytest process; the outcomes are classified as passed, failed, skipped, or
expected (a failure whose reason EXPECTED names: samoyeds' documented limits).  Writes
``--json`` (default dev/hf_suite/results.json) and ``--md`` (the markdown table, default
dev/hf_suite/results.md).  ``--training`` runs only the tests that train (training, gradient
checkpointing, retain_grad, enable_input_require_grads; :data:`TRAINING`) into
dev/hf_suite/training.json and training.md.  Needs ``parameterized`` and ``pytest`` besides transformers.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
try:  # the installed samoyeds, or else the source tree built in place
    import samoyeds  # noqa: F401
except ImportError:
    sys.path.insert(1, ROOT)
BUILD = os.path.join(ROOT, "build", "hf_suite")


def _samoyeds_parent() -> str:
    """The folder holding the samoyeds this process imports (installed, or the tree built in
    place): the children import that one, never a source tree without _C."""
    import samoyeds

    return os.path.dirname(os.path.dirname(os.path.abspath(samoyeds.__file__)))

# (test-name regex, message regex, reason): failures that are samoyeds' documented limits.
EXPECTED = [
    (r"", r"PatchedModelError: set_experts_implementation",
     "switching a patched model's experts implementation raises; unpatch_model first (docs/HF.md)"),
]

#: ``--training``: the common tests that train (a backward through the patched experts).
TRAINING = ("test_training or test_retain_grad_hidden_states_attentions or test_enable_input_require_grads or "
            "gradient_checkpointing")

_STUBS = {
    "exporters/test_export.py": "class ExportTesterMixin:\n    \"\"\"Absent from the sdist: no export tests.\"\"\"\n",
    "generation/test_utils.py":
        "class GenerationTesterMixin:\n    \"\"\"Absent from the sdist: no generation tests.\"\"\"\n",
}


def _sdist_tests() -> str:
    import transformers

    version = transformers.__version__
    dest = os.path.join(BUILD, "sdist")
    tests = os.path.join(dest, f"transformers-{version}", "tests")
    if os.path.isdir(tests):
        return tests
    os.makedirs(dest, exist_ok=True)
    tgz = os.path.join(dest, f"transformers-{version}.tar.gz")
    if not os.path.isfile(tgz):
        subprocess.run([sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:",
                        "--no-deps", "-q", "-d", dest], check=True)
    with tarfile.open(tgz) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(f"transformers-{version}/tests/")]
        tf.extractall(dest, members=members, filter="data")
    return tests


def _package(src: str) -> str:
    """A package ``tftests`` of transformers' test files, the missing mixins, and ours."""
    pkg = os.path.join(BUILD, "tftests")
    shutil.rmtree(pkg, ignore_errors=True)
    os.makedirs(pkg)
    for f in glob.glob(os.path.join(src, "*.py")):
        shutil.copy(f, pkg)
    for sub in ("exporters", "generation"):
        if os.path.isdir(os.path.join(src, sub)):
            shutil.copytree(os.path.join(src, sub), os.path.join(pkg, sub))
    for rel, text in _STUBS.items():
        path = os.path.join(pkg, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.isfile(path):
            with open(path, "w") as f:
                f.write(text)
    for d in (pkg, os.path.join(pkg, "exporters"), os.path.join(pkg, "generation")):
        open(os.path.join(d, "__init__.py"), "a").close()
    shutil.copy(os.path.join(HERE, "families_test.py"), os.path.join(pkg, "test_samoyeds_families.py"))
    return pkg


def _classify(rec: dict) -> tuple:
    if rec["outcome"] != "failed":
        return rec["outcome"], ""
    name = rec["id"].rsplit("::", 1)[-1]
    for test_re, msg_re, reason in EXPECTED:
        if re.search(test_re, name) and re.search(msg_re, rec["message"]):
            return "expected", reason
    return "failed", rec["message"]


def run(families, k: str, src: str, timeout: int) -> dict:
    pkg = _package(src)
    results = {}
    for family in families:
        out = os.path.join(BUILD, f"{family}.jsonl")
        if os.path.exists(out):
            os.remove(out)
        env = dict(os.environ, SAMOYEDS_SUITE_FAMILIES=family, SAMOYEDS_SUITE_OUT=out,
                   PYTHONPATH=os.pathsep.join([HERE, _samoyeds_parent(), BUILD, os.environ.get("PYTHONPATH", "")]),
                   TRANSFORMERS_VERBOSITY="error")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "plugin", "-p", "no:cacheprovider", "--rootdir", BUILD,
               os.path.join(pkg, "test_samoyeds_families.py")]
        if k:
            cmd += ["-k", k]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=BUILD, env=env, capture_output=True, text=True, timeout=timeout)
        recs = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
        tests = []
        for rec in recs:
            cls, why = _classify(rec)
            tests.append({"test": rec["id"].rsplit("::", 1)[-1], "result": cls, "reason": why,
                          "patched": rec["patched"]})
        # the failures again on unpatched models: those that fail there too are not samoyeds'
        names = sorted({t["test"] for t in tests if t["result"] == "failed"})
        if names:
            base = out + ".unpatched"
            if os.path.exists(base):
                os.remove(base)
            subprocess.run(cmd[:-2] + ["-k", " or ".join(names)] if k else cmd + ["-k", " or ".join(names)],
                           cwd=BUILD, env=dict(env, SAMOYEDS_SUITE_OUT=base, SAMOYEDS_SUITE_PATCH="0"),
                           capture_output=True, text=True, timeout=timeout)
            dense = {}
            if os.path.exists(base):
                for line in open(base):
                    rec = json.loads(line)
                    dense[rec["id"].rsplit("::", 1)[-1]] = rec
            for t in tests:
                d = dense.get(t["test"])
                if t["result"] == "failed" and d is not None and d["outcome"] == "failed":
                    t["result"], t["reason"] = "expected", f"fails unpatched too: {d['message'][:160]}"
        counts = {c: sum(t["result"] == c for t in tests) for c in ("passed", "failed", "expected", "skipped")}
        results[family] = {"run": len(tests), **counts, "seconds": round(time.time() - t0, 1), "tests": tests}
        if not recs:
            results[family]["error"] = (proc.stdout + proc.stderr)[-2000:]
        print(f"{family}: {counts} ({results[family]['seconds']} s)", flush=True)
    return results


def _compact(r: dict) -> dict:
    """One family's results as committed: the counts, the cases that did not pass (with their
    reasons), and the passing test names with their case counts."""
    if "cases" in r:
        return r
    passed: dict = {}
    for t in r["tests"]:
        if t["result"] == "passed":
            n, p = passed.get(t["test"], (0, 0))
            passed[t["test"]] = (n + 1, p + int(t["patched"]))
    out = {k: v for k, v in r.items() if k != "tests"}
    out["ran_patched"] = sum(t["patched"] for t in r["tests"])
    out["cases"] = [t for t in r["tests"] if t["result"] != "passed"]
    out["passed_tests"] = {name: {"cases": n, "ran_patched": p} for name, (n, p) in sorted(passed.items())}
    return out


def markdown(results: dict, meta: dict) -> str:
    lines = [f"transformers {meta['transformers']} common model tests (`ModelTesterMixin`, "
             f"`tests/test_modeling_common.py` of its sdist), torch {meta['torch']}, CPU, fp32, "
             f"format {meta['format']}; every model patched at its first forward (`dev/hf_suite/`)"
             + (f"; the tests selected by `-k \"{meta['k']}\"`." if meta.get("k") else "."), "",
             "| family | run | passed | failed | expected | skipped | ran patched experts |",
             "|---|---|---|---|---|---|---|"]
    for fam, r in results.items():
        patched = r["ran_patched"] if "ran_patched" in r else sum(t["patched"] for t in r["tests"])
        lines.append(f"| {fam} | {r['run']} | {r['passed']} | {r['failed']} | {r['expected']} | {r['skipped']} "
                     f"| {patched} |")
    lines += ["", "run: test cases (parametrised ones count once per case); expected: a failure by a documented "
              "limit of samoyeds, or one the unpatched model fails too; ran patched experts: cases in which a "
              "patched model ran a forward (the others run none: config, loading, init and dtype checks)."]
    reasons = {}
    for fam, r in results.items():
        for t in r.get("cases", r.get("tests", [])):
            if t["result"] in ("failed", "expected"):
                reasons.setdefault((t["result"], t["test"], t["reason"]), []).append(fam)
    if reasons:
        lines += ["", "| result | test | reason | families |", "|---|---|---|---|"]
        for (res, test, why), fams in sorted(reasons.items()):
            lines.append(f"| {res} | `{test}` | {why.replace('|', '/')} | {', '.join(fams)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import torch
    import transformers

    from samoyeds.hf.families import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", help="transformers' tests/ folder (default: the installed version's sdist)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("-k", default="", help="pytest -k expression (a subset of the tests)")
    ap.add_argument("--training", action="store_true",
                    help=f"only the tests that train (-k {TRAINING!r}); writes training.json / training.md by default")
    ap.add_argument("--json", default=os.path.join(HERE, "results.json"))
    ap.add_argument("--md", default=os.path.join(HERE, "results.md"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per family")
    ap.add_argument("--update", action="store_true", help="merge these families into an existing --json")
    ap.add_argument("--from-json", action="store_true", help="only rewrite --md from --json")
    args = ap.parse_args(argv)
    if args.training:
        if args.k:
            ap.error("--training and -k: give one")
        args.k = TRAINING
        if args.json == os.path.join(HERE, "results.json"):
            args.json = os.path.join(HERE, "training.json")
        if args.md == os.path.join(HERE, "results.md"):
            args.md = os.path.join(HERE, "training.md")
    if args.from_json:
        with open(args.json) as f:
            saved = json.load(f)
        saved["families"] = {fam: _compact(r) for fam, r in saved["families"].items()}
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)
        with open(args.md, "w") as f:
            f.write(markdown(saved["families"], saved["meta"]))
        return 0
    src = args.src or _sdist_tests()
    if not os.path.isfile(os.path.join(src, "test_modeling_common.py")):
        print(f"{src}: no test_modeling_common.py", file=sys.stderr)
        return 2
    fams = [f for f in args.families.split(",") if f]
    results = run(fams, args.k, src, args.timeout)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "k": args.k,
            "format": os.environ.get("SAMOYEDS_SUITE_FORMAT", "samoyeds-1:2:128"), "src": os.path.abspath(src)}
    if args.update and os.path.isfile(args.json):
        with open(args.json) as f:
            old = json.load(f)
        if {k: v for k, v in old["meta"].items() if k != "src"} != {k: v for k, v in meta.items() if k != "src"}:
            print(f"{args.json}: another version, test subset or format; not merged", file=sys.stderr)
            return 2
        results = {**old["families"], **results}
        results = {f: results[f] for f in FAMILIES if f in results}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "families": {fam: _compact(r) for fam, r in results.items()}}, f, indent=1)
    with open(args.md, "w") as f:
        f.write(markdown(results, meta))
    print(f"wrote {args.json} and {args.md}")
    return 0 if all(r["failed"] == 0 and "error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
