"""b / a for every *_ms value of the JSON rows written by dev/ab/ab_trees.sh.

A row is identified by its scalar fields that are not timings (model, T, proj, ...);
each *_ms value is the median over rounds of each tree.  Prints every row whose ratio
leaves [1 - tol, 1 + tol] and a summary per file.

    python dev/ab/ab_compare.py OUT/ab/TAG [--tol 0.03] [--json FILE]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

TIMING_HINTS = ("_ms", "tb_s", "frac", "speedup", "tflops", "err", "peak_mib", "calls", "bytes", "_s")


def _rows(doc):
    """(key, {metric: value}) for every timed row of a results file."""
    if "rows" in doc:
        rows = doc["rows"]
    elif "cases" in doc:
        rows = doc["cases"]
    else:
        rows = []
    for row in rows:
        key, vals = [], {}

        def walk(prefix, obj):
            for k, v in obj.items():
                name = f"{prefix}{k}"
                if isinstance(v, dict):
                    walk(name + ".", v)
                elif isinstance(v, bool) or isinstance(v, str) or (isinstance(v, int) and not name.endswith(TIMING_HINTS)):
                    if not prefix:
                        key.append(f"{k}={v}")
                elif isinstance(v, (int, float)) and name.endswith("ms") and v > 0:
                    vals[name] = float(v)

        walk("", row)
        yield " ".join(key), vals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tol", type=float, default=0.03)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs = {"a": {}, "b": {}}
    for d in sorted(glob.glob(os.path.join(a.dir, "[ab][0-9]*"))):
        if not os.path.isdir(d):
            continue
        tree = os.path.basename(d)[0]
        for f in glob.glob(os.path.join(d, "**", "*.json"), recursive=True):
            with open(f) as fh:
                doc = json.load(fh)
            for key, vals in _rows(doc):
                for m, v in vals.items():
                    runs[tree].setdefault((os.path.basename(f), key, m), []).append(v)
    out, worst = [], {}
    for k in sorted(set(runs["a"]) & set(runs["b"])):
        ra = statistics.median(runs["a"][k]) if runs["a"][k] else None
        rb = statistics.median(runs["b"][k]) if runs["b"][k] else None
        if not ra or not rb:
            continue
        ratio = rb / ra
        out.append({"file": k[0], "row": k[1], "metric": k[2], "a_ms": ra, "b_ms": rb, "b_over_a": ratio})
        f = k[0]
        worst.setdefault(f, []).append(ratio)
    only = (set(runs["a"]) ^ set(runs["b"]))
    for f, rs in worst.items():
        print(f"{f}: {len(rs)} timings, b/a median {statistics.median(rs):.3f}, min {min(rs):.3f}, max {max(rs):.3f}, "
              f"outside +-{a.tol:.0%}: {sum(abs(r - 1) > a.tol for r in rs)}")
    for o in out:
        if abs(o["b_over_a"] - 1) > a.tol:
            print(f"  {o['file']} {o['row']} {o['metric']}: a {o['a_ms']:.4f} b {o['b_ms']:.4f} b/a {o['b_over_a']:.3f}")
    if only:
        print(f"({len(only)} timings in one tree only, not compared)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
