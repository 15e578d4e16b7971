"""Markdown tables from the results JSON (the README's numbers come from here).

  python benchmarks/report.py [--gpu h100]
"""
from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(gpu: str, name: str):
    path = os.path.join(HERE, "results", gpu, name)
    if not os.path.exists(path):
        return None, path
    with open(path) as fh:
        return json.load(fh), path


def kernel_table(d: dict) -> str:
    rows = ["| model | T | projection | samoyeds 75 % | vs cuBLAS | vs grouped_mm | vs cuSPARSELt | samoyeds 2:4 vs cuBLAS | dense-equiv. TFLOP/s | of sparse ceiling |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in d["cases"]:
        m = c["methods"]
        s75, s50 = m.get("samoyeds-75", {}), m.get("samoyeds-50", {})
        if "ms" not in s75:
            continue

        def r(x, k):
            v = x.get(k)
            return f"{v:.2f}x" if v else "-"
        rows.append(f"| {c['model']} | {c['T']} | {c['proj']} | {s75['ms']:.3f} ms | {r(s75, 'speedup_vs_cublas')} | "
                    f"{r(s75, 'speedup_vs_grouped_mm')} | {r(s75, 'speedup_vs_cusparselt')} | {r(s50, 'speedup_vs_cublas')} | "
                    f"{s75['dense_equiv_tflops']:.0f} | {s75['frac_sparse_ceiling']:.0%} |")
    return "\n".join(rows)


def moe_table(d: dict) -> str:
    rows = ["| model | T | eager | grouped_mm | samoyeds | vs grouped_mm | vs eager | peak MiB grouped_mm / samoyeds | expert weights |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in d["cases"]:
        m = c["methods"]

        def ms(k):
            return f"{m[k]['ms']:.3f} ms" if "ms" in m.get(k, {}) else "-"
        s = m.get("samoyeds", {})
        peak = f"{m.get('grouped_mm', {}).get('peak_mib', float('nan')):.0f} / {s.get('peak_mib', float('nan')):.0f}"
        wb = f"{c['expert_bytes_dense'] / 2**30:.2f} → {c['expert_bytes_samoyeds'] / 2**30:.2f} GiB"
        rows.append(f"| {c['model']} | {c['T']} | {ms('eager')} | {ms('grouped_mm')} | {ms('samoyeds')} | "
                    f"{s.get('speedup_vs_grouped_mm', float('nan')):.2f}x | {s.get('speedup_vs_eager', float('nan')):.2f}x | "
                    f"{peak} | {wb} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h100")
    a = ap.parse_args()
    for name, fn in (("moe.json", moe_table), ("kernel.json", kernel_table)):
        d, path = _load(a.gpu, name)
        if d is None:
            print(f"(no {path})")
            continue
        env = d["env"]
        print(f"\n{name}: {env.get('device')}, commit {env.get('commit', '?')[:10]}, {env.get('date')}, "
              f"torch {env.get('torch')}; `{env.get('command')}`\n")
        if "ceilings" in d:
            c = d["ceilings"]
            print(f"ceilings measured in the same run: dense bf16 {c['dense_bf16_tflops']:.0f} TFLOP/s, "
                  f"copy {c['copy_tb_s']:.2f} TB/s\n")
        print(fn(d))


if __name__ == "__main__":
    main()
