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


def _f(v, fmt: str, missing: str = "-") -> str:
    """v formatted, or ``missing`` for None/NaN (CPU runs have no memory or ceilings)."""
    return missing if v is None or v != v else format(v, fmt)


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
                    f"{_f(s75.get('dense_equiv_tflops'), '.0f')} | {_f(s75.get('frac_sparse_ceiling'), '.0%')} |")
    return "\n".join(rows)


def moe_table(d: dict) -> str:
    rows = ["| model | T | eager | grouped_mm | samoyeds | vs grouped_mm | vs eager | peak MiB grouped_mm / samoyeds | expert weights |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in d["cases"]:
        m = c["methods"]

        def ms(k):
            return f"{m[k]['ms']:.3f} ms" if "ms" in m.get(k, {}) else "-"
        s = m.get("samoyeds", {})
        peak = f"{_f(m.get('grouped_mm', {}).get('peak_mib'), '.0f')} / {_f(s.get('peak_mib'), '.0f')}"
        wb = f"{c['expert_bytes_dense'] / 2**30:.2f} → {c['expert_bytes_samoyeds'] / 2**30:.2f} GiB"
        rows.append(f"| {c['model']} | {c['T']} | {ms('eager')} | {ms('grouped_mm')} | {ms('samoyeds')} | "
                    f"{_f(s.get('speedup_vs_grouped_mm'), '.2f')}x | {_f(s.get('speedup_vs_eager'), '.2f')}x | "
                    f"{peak} | {wb} |")
    return "\n".join(rows)


def _geomean(xs):
    import math
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def sweep_table(d: dict) -> str:
    rows = ["| format | shapes | geomean vs cuBLAS | best | worst | faster than cuBLAS on |",
            "|---|---:|---:|---:|---:|---:|"]
    for m, label in (("samoyeds-75", "samoyeds 75 %"), ("samoyeds-50", "samoyeds 2:4")):
        sp = [(c["methods"][m]["speedup_vs_cublas"], c) for c in d["cases"]
              if "speedup_vs_cublas" in c["methods"].get(m, {})]
        if not sp:
            continue
        best, worst = max(sp, key=lambda t: t[0]), min(sp, key=lambda t: t[0])
        shape = lambda c: f"M{c['M']} K{c['K']} N{c['N']}"  # noqa: E731
        rows.append(f"| {label} | {len(sp)} | {_geomean([s for s, _ in sp]):.2f}x | {best[0]:.2f}x ({shape(best[1])}) | "
                    f"{worst[0]:.2f}x ({shape(worst[1])}) | {sum(s > 1 for s, _ in sp)} of {len(sp)} |")
    return "\n".join(rows)


def e2e_table(d: dict) -> str:
    rows = ["| model | layers | phase | batch | grouped_mm tokens/s | samoyeds tokens/s | speed-up |",
            "|---|---:|---|---:|---:|---:|---:|"]
    for c in d["cases"]:
        if "methods" not in c:
            rows.append(f"| {c.get('model')} | | error: {c.get('error', '')[:80]} | | | | |")
            continue
        s, g = c["methods"].get("samoyeds", {}), c["methods"].get("grouped_mm", {})
        for phase in ("prefill", "decode"):
            for i, rs in enumerate(s.get(phase, [])):
                rg = g.get(phase, [{}] * (i + 1))[i] if i < len(g.get(phase, [])) else {}
                cell = lambda r: f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else r.get("error", "-")  # noqa: E731
                sp = rs.get("speedup_vs_grouped_mm")
                batch = f"{rs['batch']} x {rs['seq']}" if phase == "prefill" else str(rs["batch"])
                rows.append(f"| {c['model']} | {c['depth']}/{c['full_depth']} | {phase} | {batch} | {cell(rg)} | "
                            f"{cell(rs)} | {f'{sp:.2f}x' if sp else '-'} |")
    return "\n".join(rows)


def memory_table(d: dict) -> str:
    GiB = 2**30
    rows = ["| scope | model | grouped_mm | samoyeds | ratio | samoyeds stopped by |", "|---|---|---:|---:|---:|---|"]
    packed = None
    for c in d["cases"]:
        if c.get("scope") == "packed":
            packed = c if "params" in c else None
            if packed is None:
                rows.append(f"| packed | {c.get('model')} | error: {str(c.get('error', ''))[:80]} | | | |")
            continue
        m = c.get("methods", {})

        def cell(k):
            r = m.get(k, {})
            return f"{r['max']}{'+' if r.get('capped') else ''}" if "max" in r else "error"
        s = m.get("samoyeds", {})
        ratio = c.get("samoyeds_over_grouped_mm")
        rows.append(f"| {c['scope']} | {c['model']} | {cell('grouped_mm')} | {cell('samoyeds')} | "
                    f"{f'{ratio:.2f}x' if ratio else '-'} | {s.get('cap_reason', '') if s.get('capped') else 'memory'} |")
    out = "\n".join(rows)
    if packed:
        p, dd = packed, packed.get("decode", {})
        out += (f"\n\n{p['model']} at full depth ({p['layers']} layers, {p['params'] / 1e9:.1f} B parameters): dense "
                f"bf16 weights {p['dense_bytes'] / GiB:.1f} GiB"
                + (f" vs {p['device_bytes'] / GiB:.1f} GiB of GPU memory" if p.get("device_bytes") else "")
                + f"; built packed in {p.get('build_s', 0):.0f} s, resident "
                f"{p.get('allocated_after_build_gib') or p.get('param_and_buffer_bytes', 0) / GiB:.1f} GiB; prefill "
                f"1 x {p.get('prefill', {}).get('seq')} at {_f(p.get('prefill', {}).get('tokens_per_s'), ',.0f')} "
                f"tokens/s (peak {_f(p.get('prefill', {}).get('peak_gib'), '.1f')} GiB); decode "
                f"{_f(dd.get('ms_per_step'), '.1f')} ms/token; largest batch "
                f"{p.get('max_batch', {}).get('max')} x {p.get('prefill', {}).get('seq')}")
    return out


def breakdown_table(d: dict) -> str:
    labels = d.get("labels", {})
    rows = ["| model | T | variant | ms | gain over the line above | vs dense grouped_mm | peak MiB |",
            "|---|---:|---|---:|---:|---:|---:|"]
    for c in d["cases"]:
        for m, r in c["methods"].items():
            if "ms" not in r:
                rows.append(f"| {c['model']} | {c['T']} | {labels.get(m, m)} | error | | | |")
                continue
            g, v = r.get("gain_over_previous"), r.get("speedup_vs_dense_grouped_mm")
            rows.append(f"| {c['model']} | {c['T']} | {labels.get(m, m)} | {r['ms']:.3f} | {f'{g:.2f}x' if g else ''} | "
                        f"{f'{v:.2f}x' if v else ''} | {_f(r.get('peak_mib'), '.0f')} |")
    return "\n".join(rows)


def _range(xs, fmt="{:.2f}x"):
    xs = [x for x in xs if x]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if abs(hi - lo) < 0.005 else f"{fmt.format(lo)}-{fmt.format(hi)}"


def headline(gpu: str) -> str:
    """The README's headline ratios, each linked to its JSON (only the files that exist)."""
    link = lambda n: f"[{n}](benchmarks/results/{gpu}/{n})"  # noqa: E731
    rows = ["| what | samoyeds vs peer | from |", "|---|---:|---|"]
    d, _ = _load(gpu, "moe.json")
    if d:
        by_T = {}
        for c in d["cases"]:
            by_T.setdefault(c["T"], []).append(c["methods"].get("samoyeds", {}).get("speedup_vs_grouped_mm"))
        big = max(by_T)
        rows.append(f"| MoE layer vs transformers' grouped_mm, T = 4096 | {_range(by_T.get(4096, []))} | {link('moe.json')} |")
        rows.append(f"| MoE layer vs grouped_mm, T = {big} | {_range(by_T[big])} | {link('moe.json')} |")
        small = [x for T in by_T if T <= 16 for x in by_T[T]]
        rows.append(f"| MoE layer vs grouped_mm, decode (T <= 16) | {_range(small)} | {link('moe.json')} |")
        pk = [c["methods"]["grouped_mm"]["peak_mib"] / c["methods"]["samoyeds"]["peak_mib"] for c in d["cases"]
              if c["T"] >= 4096 and c["methods"].get("samoyeds", {}).get("peak_mib")
              and c["methods"].get("grouped_mm", {}).get("peak_mib")]
        rows.append(f"| MoE layer peak activation memory, grouped_mm / samoyeds, T >= 4096 | {_range(pk)} | {link('moe.json')} |")
        rows.append(f"| expert weight bytes, samoyeds / dense | "
                    f"{_range([c['expert_bytes_samoyeds'] / c['expert_bytes_dense'] for c in d['cases']], '{:.0%}')} | "
                    f"{link('moe.json')} |")
    d, _ = _load(gpu, "kernel.json")
    if d:
        for T in sorted({c["T"] for c in d["cases"]}):
            sp = [c["methods"].get("samoyeds-75", {}).get("speedup_vs_cublas") for c in d["cases"] if c["T"] == T]
            rows.append(f"| kernel, one projection, 75 % vs cuBLAS, T = {T} | {_range(sp)} | {link('kernel.json')} |")
    d, _ = _load(gpu, "sweep.json")
    if d:
        sp = [c["methods"].get("samoyeds-75", {}).get("speedup_vs_cublas") for c in d["cases"]]
        rows.append(f"| kernel sweep, one expert, 75 % vs cuBLAS (geomean; range) | {_geomean(sp):.2f}x; {_range(sp)} | "
                    f"{link('sweep.json')} |")
    d, _ = _load(gpu, "e2e.json")
    if d:
        for phase in ("prefill", "decode"):
            sp = [r.get("speedup_vs_grouped_mm") for c in d["cases"] if "methods" in c
                  for r in c["methods"].get("samoyeds", {}).get(phase, [])]
            rows.append(f"| whole model {phase} tokens/s vs grouped_mm | {_range(sp)} | {link('e2e.json')} |")
    d, _ = _load(gpu, "memory.json")
    if d:
        for c in d["cases"]:
            if c.get("samoyeds_over_grouped_mm"):
                capped = c["methods"].get("samoyeds", {}).get("capped")
                rows.append(f"| largest batch, {c['scope']} {c['model']}, vs grouped_mm | "
                            f"{'>= ' if capped else ''}{c['samoyeds_over_grouped_mm']:.2f}x | {link('memory.json')} |")
            if c.get("scope") == "packed" and c.get("prefill"):
                rows.append(f"| {c['model']} full depth ({c['params'] / 1e9:.1f} B parameters, "
                            f"{c['dense_bytes'] / 2**30:.0f} GiB dense) on one GPU | runs in "
                            f"{_f(c.get('allocated_after_build_gib'), '.0f')} GiB | {link('memory.json')} |")
    d, _ = _load(gpu, "breakdown.json")
    if d:
        for c in d["cases"]:
            m = c["methods"]
            a, e = m.get("a_sparse_weights", {}).get("ms"), m.get("e_grouped_launch", {}).get("ms")
            if a and e:
                rows.append(f"| breakdown {c['model']} T = {c['T']}: (e) full layer vs (a) sparse weights only | "
                            f"{a / e:.2f}x | {link('breakdown.json')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--headline", action="store_true", help="only the README's headline table")
    a = ap.parse_args()
    if a.headline:
        print(headline(a.gpu))
        return
    for name, fn in (("moe.json", moe_table), ("kernel.json", kernel_table), ("sweep.json", sweep_table),
                     ("e2e.json", e2e_table), ("memory.json", memory_table), ("breakdown.json", breakdown_table)):
        d, path = _load(a.gpu, name)
        if d is None:
            print(f"(no {path})")
            continue
        env = d["env"]
        print(f"\n{name}: {env.get('device')}, commit {env.get('commit', '?')[:10]}, {env.get('date')}, "
              f"torch {env.get('torch')}; `{env.get('command')}`\n")
        if d.get("ceilings"):
            c = d["ceilings"]
            print(f"ceilings measured in the same run: dense bf16 {c['dense_bf16_tflops']:.0f} TFLOP/s, "
                  f"copy {c['copy_tb_s']:.2f} TB/s\n")
        print(fn(d))
    print("\n" + headline(a.gpu))


if __name__ == "__main__":
    main()
