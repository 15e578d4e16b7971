"""The summary of dev/lab/ab_builds.sh: for every row of the runs' JSON files (matched by
position) and every *_ms value in it, the median over the rounds of build a and of build b,
each round's values, and b / a.  Written to DIR/ab_summary.json and printed.

  python dev/lab/ab_summary.py DIR ROUNDS [--flags-a F] [--flags-b F]
"""
import argparse
import glob
import json
import os
import statistics


def rows_of(path):
    files = sorted(glob.glob(os.path.join(path, "*.json")))
    if len(files) != 1:
        raise SystemExit(f"{path}: expected one JSON file, found {len(files)}")
    with open(files[0]) as f:
        d = json.load(f)
    return os.path.basename(files[0]), d.get("rows") or d.get("cases") or []


def label(row):
    return " ".join(str(row[k]) for k in ("case", "model", "proj", "T", "fmt") if k in row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("rounds", type=int)
    ap.add_argument("--flags-a", default="")
    ap.add_argument("--flags-b", default="")
    a = ap.parse_args()
    runs = {b: [rows_of(os.path.join(a.dir, f"{b}{r}")) for r in range(1, a.rounds + 1)] for b in "ab"}
    name, first = runs["a"][0]
    out = []
    for i, row in enumerate(first):
        for key in sorted(k for k, v in row.items() if k.endswith("_ms") and isinstance(v, (int, float))):
            vals = {b: [rs[i][key] for _, rs in runs[b]] for b in "ab"}
            med = {b: statistics.median(v) for b, v in vals.items()}
            out.append({"row": label(row), "key": key, "a": vals["a"], "b": vals["b"], "a_median": med["a"],
                        "b_median": med["b"], "b_over_a": med["b"] / med["a"] if med["a"] else None})
            print(f"{label(row):40} {key:28} a {med['a']:.4f}  b {med['b']:.4f}  b/a {out[-1]['b_over_a']:.3f}  "
                  f"(a {', '.join(f'{v:.3f}' for v in vals['a'])}; b {', '.join(f'{v:.3f}' for v in vals['b'])})")
    with open(os.path.join(a.dir, "ab_summary.json"), "w") as f:
        json.dump({"file": name, "rounds": a.rounds, "flags_a": a.flags_a, "flags_b": a.flags_b,
                   "commit": os.environ.get("SAMOYEDS_COMMIT", "unknown"), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
