"""The top warp-stall sites of one kernel from an Nsight Compute source dump:
each SASS instruction's share of the sampled warp stalls, how often it ran, and
its three largest stall reasons.

  ncu -i REPORT --page source --csv --print-source sass > src.csv
  python dev/lab/ncu_top.py src.csv [--top 40] [--by-opcode]

--by-opcode also sums the samples by SASS opcode (predicate and modifiers dropped).
"""
import argparse
import collections
import csv


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--by-opcode", action="store_true")
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    # first row names the kernel, the second is the header
    hdr, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(r[samples]) for r in data)
    if total == 0:
        raise SystemExit(f"{a.csv}: no warp-stall samples")
    by_reason = collections.Counter()
    for r in data:
        for h in reasons:
            by_reason[h] += _num(r[col[h]])
    print(f"{rows[0][1] if len(rows[0]) > 1 else ''}")
    print(f"samples {total:.0f}; by reason: " +
          ", ".join(f"{k[6:]} {v / total:.1%}" for k, v in by_reason.most_common(10)))
    if a.by_opcode:
        ops = collections.Counter()
        for r in data:
            words = r[col["Source"]].split()
            if words and words[0].startswith("@"):
                words = words[1:]
            ops[words[0].split(".")[0] if words else "?"] += _num(r[samples])
        print("by opcode: " + ", ".join(f"{k} {v / total:.1%}" for k, v in ops.most_common(16)))
    for r in sorted(data, key=lambda r: -_num(r[samples]))[:a.top]:
        n = _num(r[samples])
        top3 = sorted(((_num(r[col[h]]), h[6:]) for h in reasons), reverse=True)[:3]
        print(f"{r[col['Address']]:>18} {n / total:6.1%} executed {r[col['Instructions Executed']]:>10}  "
              f"{r[col['Source']][:72]:72} " + " ".join(f"{k}:{v / n:.0%}" for v, k in top3 if v))


if __name__ == "__main__":
    main()
