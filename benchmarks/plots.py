"""Figures from the results JSON only (the notebooks in examples/ and the README's
PNGs in docs/figures/ are made with these functions).  Each function takes the
loaded JSON and returns a matplotlib Figure; missing methods and failed cases are
left out of a plot, never invented.

  python benchmarks/plots.py [--results benchmarks/results/h100] [--out docs/figures]
      writes every figure whose JSON exists
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COLORS = {"samoyeds-75": "#1f77b4", "samoyeds": "#1f77b4", "samoyeds-50": "#6baed6", "cublas": "#7f7f7f",
          "grouped_mm": "#ff7f0e", "cusparselt": "#2ca02c", "eager": "#bcbd22"}


def _plt():
    import matplotlib.pyplot as plt
    return plt


def load(results: str, name: str) -> Optional[dict]:
    """``results/name`` parsed, or None when the file is missing."""
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def source(d: dict) -> str:
    """One line naming where a result comes from (device, commit, date, command)."""
    env = d.get("env") or d.get("environment") or {}
    return (f"{env.get('device', env.get('host', 'CPU'))}, commit {str(env.get('commit', '?'))[:10]}, "
            f"{str(env.get('date', '?'))[:10]}: {env.get('command', '?')}")


def _ms(d: dict, m: str) -> Optional[float]:
    v = d.get("methods", {}).get(m, {})
    return v.get("ms") if isinstance(v, dict) else None


def _log_y(ax) -> None:
    """Log y axis labelled with plain numbers (0.125, 0.25, 0.5, 1, 2, ...)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(-6, 7)]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _title(fig, text: str, d: dict) -> None:
    env = d.get("env") or {}
    fig.suptitle(f"{text}  ({env.get('device', 'CPU')})", fontsize=11)


# --- kernel ----------------------------------------------------------------------------------------

def kernel_models(d: dict):
    """Fig. 13: one projection over all experts per model, speed relative to cuBLAS (log scale)."""
    plt = _plt()
    Ts = sorted({c["T"] for c in d["cases"]})
    peers = [("samoyeds-75", "samoyeds 75 %"), ("samoyeds-50", "samoyeds 2:4"), ("grouped_mm", "grouped_mm"),
             ("cusparselt", "cuSPARSELt 2:4")]
    fig, axes = plt.subplots(len(Ts), 1, figsize=(10, 2.2 * len(Ts) + 1.2), squeeze=False)
    per_T = {T: [f"{c['model']} {c['proj']}" for c in d["cases"] if c["T"] == T and _ms(c, "cublas")] for T in Ts}
    same = all(v == per_T[Ts[-1]] for v in per_T.values())
    for k, (ax, T) in enumerate(zip(axes[:, 0], Ts)):
        cases = [c for c in d["cases"] if c["T"] == T and _ms(c, "cublas")]
        labels = [f"{c['model']} {c['proj']}" for c in cases]
        width = 0.8 / len(peers)
        for i, (m, label) in enumerate(peers):
            xs, ys = [], []
            for j, c in enumerate(cases):
                t = _ms(c, m)
                if t:
                    xs.append(j + (i - (len(peers) - 1) / 2) * width)
                    ys.append(_ms(c, "cublas") / t)
            ax.bar(xs, ys, width, label=label, color=COLORS[m])
        ax.axhline(1.0, color="k", lw=0.8)
        _log_y(ax)
        ax.set_xticks(range(len(cases)))
        if k == len(Ts) - 1 or not same:  # same cases in every row: label the bottom one only
            ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
        else:
            ax.set_xticklabels([])
        ax.set_ylabel("speed vs cuBLAS")
        ax.set_title(f"T = {T} tokens", fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0, 0].legend(ncol=4, fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 1.12), frameon=False)
    _title(fig, "Kernel: one MoE projection over all experts (same routed tokens)", d)
    fig.tight_layout()
    return fig


def kernel_sweep_lines(d: dict):
    """Fig. 12: one expert, all tokens; each dimension swept with the other two at the center."""
    plt = _plt()
    c0 = d.get("settings", {}).get("center", 4096)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    for ax, dim, name in zip(axes, "MKN", ["M (weight rows)", "K (reduction)", "N (tokens)"]):
        others = [x for x in "MKN" if x != dim]
        cases = sorted((c for c in d["cases"] if all(c[o] == c0 for o in others)), key=lambda c: c[dim])
        for m, label in (("samoyeds-75", "samoyeds 75 %"), ("samoyeds-50", "samoyeds 2:4")):
            pts = [(c[dim], c["methods"][m]["speedup_vs_cublas"]) for c in cases
                   if "speedup_vs_cublas" in c["methods"].get(m, {})]
            if pts:
                ax.plot(*zip(*pts), "o-", label=label, color=COLORS[m])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(name)
        ax.set_title(", ".join(f"{o} = {c0}" for o in others), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed vs cuBLAS (same masked weights)")
    axes[0].legend(fontsize=8)
    _title(fig, "Kernel sweep: Y[N, M] = X[N, K] W[M, K]^T, one expert", d)
    fig.tight_layout()
    return fig


def kernel_sweep_heatmap(d: dict, method: str = "samoyeds-75"):
    """Speed vs cuBLAS over the cube: one (M, K) map per token count N."""
    plt = _plt()
    cube = d.get("settings", {}).get("cube") or sorted({c["N"] for c in d["cases"]})
    by = {(c["M"], c["K"], c["N"]): c["methods"].get(method, {}).get("speedup_vs_cublas") for c in d["cases"]}
    fig, axes = plt.subplots(1, len(cube), figsize=(3.4 * len(cube), 3.4), squeeze=False)
    vals = [v for v in by.values() if v]
    lim = max(abs(math.log2(v)) for v in vals) if vals else 1.0
    im = None
    for ax, N in zip(axes[0], cube):
        grid = [[by.get((M, K, N)) or float("nan") for K in cube] for M in cube]
        im = ax.imshow([[math.log2(v) if v == v else float("nan") for v in row] for row in grid], cmap="RdBu",
                       vmin=-lim, vmax=lim, origin="lower")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(cube)))
        ax.set_xticklabels(cube, fontsize=7)
        ax.set_yticks(range(len(cube)))
        ax.set_yticklabels(cube, fontsize=7)
        ax.set_xlabel("K")
        ax.set_title(f"N = {N}", fontsize=9)
    axes[0, 0].set_ylabel("M")
    if im is not None:
        fig.colorbar(im, ax=list(axes[0]), shrink=0.8, label="log2 speed vs cuBLAS")
    _title(fig, f"{method} vs cuBLAS over (M, K, N)", d)
    return fig


# --- MoE layer ----------------------------------------------------------------------------------------

def moe_layer(d: dict):
    """Fig. 14: transformers' MoE blocks, samoyeds vs grouped_mm (and eager) by token count; peak memory."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4))
    models = list(dict.fromkeys(c["model"] for c in d["cases"]))
    for m in models:
        pts = [(c["T"], c["methods"]["samoyeds"]["speedup_vs_grouped_mm"]) for c in d["cases"]
               if c["model"] == m and "speedup_vs_grouped_mm" in c["methods"].get("samoyeds", {})]
        if pts:
            a1.plot(*zip(*sorted(pts)), "o-", label=m)
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_xscale("log", base=2)
    a1.set_xlabel("tokens T")
    a1.set_ylabel("speed-up vs grouped_mm")
    a1.set_title("whole MoE block (router, experts, shared experts)", fontsize=9)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8)
    T = max((c["T"] for c in d["cases"]), default=0)
    big = [c for c in d["cases"] if c["T"] == T]
    width = 0.38
    for i, (meth, lab) in enumerate((("grouped_mm", "grouped_mm"), ("samoyeds", "samoyeds"))):
        ys = [c["methods"].get(meth, {}).get("peak_mib") or 0 for c in big]
        a2.bar([j + (i - 0.5) * width for j in range(len(big))], ys, width, label=lab, color=COLORS[meth])
    a2.set_xticks(range(len(big)))
    a2.set_xticklabels([c["model"] for c in big], fontsize=8, rotation=15)
    a2.set_ylabel("peak activation memory (MiB)")
    a2.set_title(f"peak memory of one forward, T = {T}", fontsize=9)
    a2.legend(fontsize=8)
    _title(fig, "MoE layer (bf16, format samoyeds-1:2:128)", d)
    fig.tight_layout()
    return fig


def breakdown(d: dict):
    """Fig. 17: the layer composed from samoyeds' ops with parts turned off."""
    plt = _plt()
    cases = d["cases"]
    labels = d.get("labels", {})
    fig, axes = plt.subplots(1, len(cases), figsize=(6.5 * len(cases), 3.8), squeeze=False)
    for ax, c in zip(axes[0], cases):
        names = [m for m in list(d.get("variants", [])) + ["dense_grouped_mm", "dense_eager"] if _ms(c, m)]
        ys = [_ms(c, m) for m in names]
        colors = ["#1f77b4" if m in d.get("variants", []) else COLORS["grouped_mm"] if "grouped" in m
                  else COLORS["eager"] for m in names]
        ax.barh(range(len(names)), ys, color=colors)
        for i, m in enumerate(names):
            g = c["methods"][m].get("gain_over_previous")
            ax.text(ys[i], i, f" {ys[i]:.2f} ms" + (f"  ({g:.2f}x)" if g else ""), va="center", fontsize=8)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([labels.get(m, m) for m in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per layer call")
        ax.set_xlim(0, max(ys, default=1) * 1.45)
        ax.set_title(f"{c['model']}, T = {c['T']} (H {c['H']}, I {c['I']}, E {c['E']}, top-{c['K']})", fontsize=9)
    _title(fig, "Breakdown: each part's gain (in brackets: over the line above)", d)
    fig.tight_layout()
    return fig


def moe_across_gpus(by_gpu: Dict[str, dict], T: int = 4096):
    """The MoE-layer speed-up vs grouped_mm on each GPU kind, at T tokens. Each bar's label names
    its file's device and commit; where the commits differ the title says so (the kernels differ
    too, so the bars compare runs, not GPUs)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    gpus = sorted(by_gpu)
    models = list(dict.fromkeys(c["model"] for d in by_gpu.values() for c in d["cases"]))
    width = 0.8 / max(1, len(gpus))
    commits = {}
    for i, g in enumerate(gpus):
        env = by_gpu[g].get("env", {})
        commits[g] = str(env.get("commit", "?"))[:7]
        sp = {c["model"]: c["methods"].get("samoyeds", {}).get("speedup_vs_grouped_mm")
              for c in by_gpu[g]["cases"] if c["T"] == T}
        xs = [j + (i - (len(gpus) - 1) / 2) * width for j, m in enumerate(models) if sp.get(m)]
        ax.bar(xs, [sp[m] for m in models if sp.get(m)], width,
               label=f"{env.get('device', g)}, commit {commits[g]}, {str(env.get('date', '?'))[:10]}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models, fontsize=8)
    ax.set_ylabel("speed-up vs grouped_mm")
    same = len(set(commits.values())) == 1
    ax.set_title(f"MoE layer at T = {T}, bench_moe.py on each GPU"
                 + ("" if same else " (different commits: the kernels differ between the runs)"), fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


# --- end to end, memory, accuracy ---------------------------------------------------------------------

def e2e(d: dict):
    """Fig. 15: whole models, samoyeds throughput relative to grouped_mm (prefill and decode)."""
    plt = _plt()
    cases = [c for c in d["cases"] if "methods" in c]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for ax, phase in zip(axes, ("prefill", "decode")):
        batches = sorted({r["batch"] for c in cases for r in c["methods"].get("samoyeds", {}).get(phase, [])})
        width = 0.8 / max(1, len(batches))
        for i, B in enumerate(batches):
            xs, ys = [], []
            for j, c in enumerate(cases):
                for r in c["methods"].get("samoyeds", {}).get(phase, []):
                    if r["batch"] == B and r.get("speedup_vs_grouped_mm"):
                        xs.append(j + (i - (len(batches) - 1) / 2) * width)
                        ys.append(r["speedup_vs_grouped_mm"])
            seq = d.get("settings", {}).get("seq", "")
            ax.bar(xs, ys, width, label=f"batch {B}" + (f" x {seq}" if phase == "prefill" else ""))
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{c['model']}\n{c['depth']}/{c['full_depth']} layers" for c in cases], fontsize=8)
        ax.set_ylabel("tokens/s vs grouped_mm")
        ax.set_title("prefill" if phase == "prefill" else "decode (greedy generate, KV cache)", fontsize=10)
        ax.legend(fontsize=8)
    _title(fig, "End to end: causal LMs from real configs, samoyeds vs transformers' grouped_mm", d)
    fig.tight_layout()
    return fig


def memory(d: dict):
    """Fig. 16: largest batch per method (decoder layer, whole model); the packed full-depth model."""
    plt = _plt()
    cases = [c for c in d["cases"] if c.get("scope") in ("layer", "model") and "methods" in c]
    packed = next((c for c in d["cases"] if c.get("scope") == "packed" and "params" in c), None)
    fig, axes = plt.subplots(1, 2 if packed else 1, figsize=(13 if packed else 7, 4), squeeze=False)
    ax = axes[0, 0]
    width = 0.38
    seq = d.get("settings", {}).get("seq", "")
    for i, meth in enumerate(("grouped_mm", "samoyeds")):
        for j, c in enumerate(cases):
            r = c["methods"].get(meth, {})
            if "max" not in r:
                continue
            x = j + (i - 0.5) * width
            ax.bar(x, r["max"], width, color=COLORS[meth], hatch="//" if r.get("capped") else None,
                   label=meth if j == 0 or not any("max" in cc["methods"].get(meth, {}) for cc in cases[:j]) else None)
            ax.text(x, r["max"], f"{r['max']}{'+' if r.get('capped') else ''}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{c['scope']}\n{c['model']}" for c in cases], fontsize=8)
    ax.set_ylabel(f"largest batch (x {seq} tokens)")
    ax.set_title("largest batch that runs (hatched: stopped by a cap, see JSON)", fontsize=9)
    ax.legend(fontsize=8)
    if packed:
        ax = axes[0, 1]
        GiB = 2**30
        bars = [("dense weights\n(bf16)", packed["dense_bytes"] / GiB, "#d62728"),
                ("GPU memory", (packed.get("device_bytes") or 0) / GiB, "#7f7f7f"),
                ("samoyeds model\nresident", packed.get("allocated_after_build_gib") or
                 packed.get("param_and_buffer_bytes", 0) / GiB, COLORS["samoyeds"]),
                (f"peak, prefill\n1 x {packed.get('prefill', {}).get('seq', '')}",
                 packed.get("prefill", {}).get("peak_gib") or 0, "#9ecae1")]
        ax.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
        for i, b in enumerate(bars):
            ax.text(i, b[1], f"{b[1]:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels([b[0] for b in bars], fontsize=8)
        ax.set_ylabel("GiB")
        mb = packed.get("max_batch", {}).get("max")
        ax.set_title(f"{packed['model']}, {packed['layers']} layers, {packed['params'] / 1e9:.1f} B parameters"
                     + (f"; largest batch {mb} x {seq}" if mb else ""), fontsize=9)
    _title(fig, "Memory", d)
    fig.tight_layout()
    return fig


def accuracy(d: dict):
    """Held-out perplexity of the pruned model per pattern and mask method, before and after fine-tuning."""
    plt = _plt()
    rows = [r for r in d.get("variants", []) if "ppl" in r]
    dense = next((r for r in rows if r["name"] == "dense"), None)
    rows = [r for r in rows if r["name"] != "dense"]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.6))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["ppl"] for r in rows], 0.4, label="pruned", color="#9ecae1")
    ft = [(y, r["finetuned"]["ppl"]) for y, r in zip(ys, rows) if "ppl" in (r.get("finetuned") or {})]
    if ft:
        ax.barh([y + 0.2 for y, _ in ft], [p for _, p in ft], 0.4, label="pruned + masked fine-tune",
                color=COLORS["samoyeds"])
    if dense:
        ax.axvline(dense["ppl"], color="k", lw=1, label=f"dense {dense['ppl']:.3f}")
        if "ppl" in (dense.get("finetuned") or {}):
            ax.axvline(dense["finetuned"]["ppl"], color="k", ls="--", lw=1,
                       label=f"dense + same fine-tune {dense['finetuned']['ppl']:.3f}")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    vals = [r["ppl"] for r in rows] + [p for _, p in ft] + ([dense["ppl"]] if dense else [])
    if vals:
        lo, hi = min(vals), max(vals)
        ax.set_xlim(lo - 0.15 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
    ax.set_xlabel("held-out perplexity (bytes; lower is better)")
    ax.legend(fontsize=8, loc="lower right")
    env = d.get("environment") or {}
    fig.suptitle(f"Accuracy: experts pruned to each pattern ({d.get('mode', '?')} mode, "
                 f"{env.get('device', d.get('device', ''))})", fontsize=11)
    fig.tight_layout()
    return fig


# --- all figures --------------------------------------------------------------------------------------

def accuracy_v2(d: dict):
    """Accuracy study v2: held-out code perplexity per variant, mean +- std over seeds, one-shot
    and after the 1 % experts-only fine-tune (masked dense path; samoyeds' own backward where
    the format packs), one panel per model."""
    plt = _plt()
    models = d.get("models") or {}
    n = max(1, len(models))
    rows_max = max((len(m.get("variants") or {}) for m in models.values()), default=1)
    fig, axes = plt.subplots(1, n, figsize=(7.5 * n, 0.28 * rows_max + 1.8), squeeze=False)
    for ax, (name, m) in zip(axes[0], models.items()):
        v = m.get("variants") or {}
        names = [k for k in v if k != "dense"]
        ys = range(len(names))

        def bar(off, getter, label, color):
            pts = [(y, getter(v[k])) for y, k in zip(ys, names)]
            pts = [(y, st) for y, st in pts if st and st.get("mean") is not None]
            if pts:
                ax.barh([y + off for y, _ in pts], [st["mean"] for _, st in pts], 0.28,
                        xerr=[st.get("std") or 0 for _, st in pts], label=label, color=color, error_kw={"lw": 0.8})

        bar(-0.3, lambda x: x["oneshot"]["code_ppl"], "one-shot", "#9ecae1")
        bar(0.0, lambda x: ((x.get("ft") or {}).get("experts-1%") or {}).get("masked", {}).get("code_ppl"),
            "+ 1 % experts-only fine-tune (masked dense)", COLORS["samoyeds"])
        bar(0.3, lambda x: ((x.get("ft") or {}).get("experts-1%") or {}).get("samoyeds", {}).get("code_ppl"),
            "+ the same through samoyeds' backward", "#08306b")
        dense = v.get("dense")
        if dense:
            ax.axvline(dense["oneshot"]["code_ppl"]["mean"], color="k", lw=1, label="dense")
            ft = ((dense.get("ft") or {}).get("experts-1%") or {}).get("masked")
            if ft:
                ax.axvline(ft["code_ppl"]["mean"], color="k", ls="--", lw=1, label="dense + same fine-tune")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(names, fontsize=7)
        ax.invert_yaxis()
        vals = [x["oneshot"]["code_ppl"]["mean"] for x in v.values() if x["oneshot"]["code_ppl"].get("mean")]
        floor = (v.get("floor (experts removed)") or {}).get("oneshot", {}).get("code_ppl", {}).get("mean")
        body = [x for x in vals if floor is None or x < floor] or vals
        if body:
            lo, hi = min(body), max(body)
            ax.set_xlim(lo - 0.1 * (hi - lo + 1e-9), hi + 0.15 * (hi - lo + 1e-9))
        ax.set_title(f"{name}: {m.get('parameters', 0) / 1e6:.1f} M parameters, seeds {m.get('seeds')}", fontsize=9)
        ax.set_xlabel("held-out code perplexity (tokens; lower is better)")
        ax.legend(fontsize=7, loc="lower right")
    env = d.get("environment") or {}
    fig.suptitle(f"Accuracy study v2 ({d.get('size', '?')} size, {env.get('device', '')}): 75 % of the expert weights "
                 "pruned, mean +- std over seeds", fontsize=10)
    fig.tight_layout()
    return fig


def dense_decode(d: dict):
    """Unpruned shared experts at decode sizes: samoyeds.dense_decode against the transformers MLP
    by token count (left), and the weight stream against the device copy rate (right)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    shapes = sorted({r["shape"] for r in d.get("rows", [])}, key=lambda n: [r["shape"] for r in d["rows"]].index(n))
    for name in shapes:
        rows = sorted((r for r in d["rows"] if r["shape"] == name), key=lambda r: r["T"])
        label = f"{name} ({rows[0]['H']} x {rows[0]['I']})"
        a1.plot([r["T"] for r in rows], [r["speedup"] for r in rows], "o-", label=label)
        a2.plot([r["T"] for r in rows], [100 * r["frac_of_copy"] for r in rows], "o-", label=label)
    a1.axhline(1.0, color="k", lw=0.8)
    a2.axhline(100.0, color="k", lw=0.8)
    ts = sorted({r["T"] for r in d.get("rows", [])})
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.set_xlabel("tokens T")
        ax.grid(alpha=0.3)
    a1.set_ylabel("speed vs the transformers MLP")
    a2.set_ylabel("weights read, % of the copy rate")
    a1.legend(fontsize=8)
    _title(fig, "Dense decode kernel: a shared-experts MLP (gate, up, SiLU; down)", {"env": d.get("env") or d})
    fig.tight_layout()
    return fig


def decode(d: dict):
    """The decode kernel (bench_decode.json): the routed experts' packed bytes per second as a
    share of the device copy rate measured in the same run, by tokens T, for gate_up (left) and
    down (right), uniform routing; filled where impl="auto" runs this kernel (S <= 128 routed
    rows or at most 16 per expert), hollow past that; dotted, where the file has them, the same
    calls back to back on rotated weight copies."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    rows = [r for r in d.get("rows", []) if r.get("proj") in ("gate_up", "down") and not r.get("skew")]
    models = sorted({r["model"] for r in rows}, key=lambda m: [r["model"] for r in rows].index(m))
    for ax, proj in zip(axes, ("gate_up", "down")):
        for i, model in enumerate(models):
            pts = sorted((r for r in rows if r["model"] == model and r["proj"] == proj), key=lambda r: r["T"])
            if not pts:
                continue
            color = f"C{i}"
            ax.plot([r["T"] for r in pts], [100 * r["frac_of_copy"] for r in pts], "-", color=color, label=model)
            b2b = [r for r in pts if "frac_of_copy_stream" in r]
            if b2b:
                ax.plot([r["T"] for r in b2b], [100 * r["frac_of_copy_stream"] for r in b2b], ":", color=color,
                        marker=".", label=f"{model}, back to back")
            for r in pts:
                auto = r["S"] <= 128 or r["S"] <= 16 * r["E"]
                ax.plot([r["T"]], [100 * r["frac_of_copy"]], "o", color=color,
                        markerfacecolor=color if auto else "white")
        ax.axhline(100.0, color="k", lw=0.8)
        ax.axhline(80.0, color="k", lw=0.8, ls="--")
        ts = sorted({r["T"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts, [str(t) for t in ts])
        ax.set_xlabel("tokens T")
        ax.set_title(proj, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("weights read, % of the copy rate")
    axes[0].legend(fontsize=8)
    _title(fig, f"Decode kernel ({d.get('format', '?')}): weight stream against the copy rate "
                "(dashed: 80 %; dotted: back to back)", {"env": d.get("env") or d})
    fig.tight_layout()
    return fig


FIGURES = [  # (png name, JSON file, function)
    ("kernel_models", "kernel.json", kernel_models),
    ("kernel_sweep", "sweep.json", kernel_sweep_lines),
    ("kernel_sweep_heatmap", "sweep.json", kernel_sweep_heatmap),
    ("moe_layer", "moe.json", moe_layer),
    ("breakdown", "breakdown.json", breakdown),
    ("e2e", "e2e.json", e2e),
    ("memory", "memory.json", memory),
    ("accuracy", "accuracy.json", accuracy),
    ("accuracy_v2", "accuracy_v2.json", accuracy_v2),
    ("dense_decode", "dense_decode.json", dense_decode),
    ("decode", "bench_decode.json", decode),
]


def save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


def results_by_gpu(root: str = os.path.join(HERE, "results"), name: str = "moe.json") -> Dict[str, dict]:
    """{gpu folder: parsed name} for every results/<gpu>/ that holds it."""
    out = {}
    for g in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        d = load(os.path.join(root, g), name)
        if d is not None:
            out[g] = d
    return out


def main(argv: Optional[List[str]] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results", "h100"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "figures"))
    args = ap.parse_args(argv)
    for png, js, fn in FIGURES:
        d = load(args.results, js)
        if d is None:
            print(f"{png}: no {js}, skipped")
            continue
        print("wrote", save(fn(d), os.path.join(args.out, png + ".png")))
    gpus = results_by_gpu(os.path.dirname(os.path.abspath(args.results)))
    if len(gpus) > 1:
        print("wrote", save(moe_across_gpus(gpus), os.path.join(args.out, "moe_across_gpus.png")))


if __name__ == "__main__":
    main()
