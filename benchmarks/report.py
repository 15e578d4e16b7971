"""Markdown tables from the results JSON (the README's numbers come from here).

  python benchmarks/report.py [--gpu h100]
  python benchmarks/report.py --merge-moe OUT A.json B.json ...   (bench_moe.py runs of other models, one file)
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
    rows = ["| model | T | projection | samoyeds 75 % | vs cuBLAS | vs grouped_mm | vs cuSPARSELt | samoyeds 2:4 vs cuBLAS | dense-equiv. TFLOP/s | of wgmma.sp rate (75 % / 2:4) |",
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
                    f"{_f(s75.get('dense_equiv_tflops'), '.0f')} | {_f(s75.get('frac_wgmma_sp'), '.0%')} / "
                    f"{_f(s50.get('frac_wgmma_sp'), '.0%')} |")
    return "\n".join(rows)


def fill_ceiling(ceil: dict) -> float:
    """The data ceiling of the wgmma.sp kernels: the fastest of the shared-memory fill rates
    (TB/s) measured with the ceilings by the ways those kernels load (TMA boxes, the gather,
    stages of both); 0 without (bench_kernel.py sets each case against it)."""
    return max((ceil.get(f"fill_{k}_tb_s") or 0.0) for k in ("tma", "cp_async_gather", "tma_and_gather"))


def fill_table(d: dict) -> str:
    """The wgmma.sp kernel's stream from L2 into shared memory against the fill rates
    measured in the same run (kernel.json cases the wgmma.sp kernel runs), and what its
    tiles would reach against cuBLAS at the fastest of them; empty for a file without them."""
    c0 = d.get("ceilings", {})
    fill = fill_ceiling(c0)
    if not fill:
        return ""
    ways = [("TMA boxes", "tma"), ("cp.async rows in order", "cp_async"), ("cp.async rows by index", "cp_async_gather"),
            ("box + gathered rows", "tma_and_gather")]
    have = ", ".join(f"{n} {c0[f'fill_{k}_tb_s']:.2f} TB/s ({_f(c0.get(f'fill_{k}_b_per_clk_sm'), '.1f')} B/clk/SM)"
                     for n, k in ways if c0.get(f"fill_{k}_tb_s"))
    rows = [f"shared-memory fill rates in the same run, 128 KB in flight per SM: {have}; "
            f"SM clock {_f(c0.get('fill_tma_sm_mhz'), '.0f')} MHz\n",
            "| model | T | projection | 75 %: stream TB/s | of the fill rate | vs cuBLAS now | at the fill rate | "
            "2:4: stream TB/s | of the fill rate | vs cuBLAS now | at the fill rate |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in d["cases"]:
        s75, s50 = c["methods"].get("samoyeds-75", {}), c["methods"].get("samoyeds-50", {})
        if "stream_tb_s" not in s75 and "stream_tb_s" not in s50:
            continue
        cells = []
        for x in (s75, s50):
            st = x.get("stream_tb_s")
            cells += [_f(st, ".2f"), _f(st / fill if st else None, ".0%"), _f(x.get("speedup_vs_cublas"), ".2f") + "x",
                      _f(x.get("speedup_vs_cublas_at_fill"), ".2f") + "x"]
        rows.append(f"| {c['model']} | {c['T']} | {c['proj']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def fill_rate_table(d: dict) -> str:
    """fill_rate.json: the shared-memory fill rate by way and by SMs taking part."""
    rows = ["| way | SMs | KB in flight per SM | TB/s | GB/s per SM | B/clk/SM | SM clock |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(d["rows"], key=lambda r: (r["kind"], -r["ctas"], -r.get("in_flight_kb", 128))):
        rows.append(f"| {r['kind']} | {r['ctas']} | {r.get('in_flight_kb', 128)} | {r['tb_per_s']:.2f} | {r['gb_per_s_per_sm']:.1f} | "
                    f"{r['bytes_per_clock_per_sm']:.1f} | {r['sm_clock_mhz']:.0f} MHz |")
    return "\n".join(rows)


def moe_table(d: dict) -> str:
    rows = ["| model | T | eager | grouped_mm | samoyeds | vs grouped_mm | vs eager | vs grouped_mm, back to back | "
            "vs grouped_mm, GPU time | peak MiB grouped_mm / samoyeds | expert weights |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in d["cases"]:
        m = c["methods"]

        def ms(k):
            return f"{m[k]['ms']:.3f} ms" if "ms" in m.get(k, {}) else "-"
        s = m.get("samoyeds", {})
        peak = f"{_f(m.get('grouped_mm', {}).get('peak_mib'), '.0f')} / {_f(s.get('peak_mib'), '.0f')}"
        wb = f"{c['expert_bytes_dense'] / 2**30:.2f} → {c['expert_bytes_samoyeds'] / 2**30:.2f} GiB"
        rows.append(f"| {c['model']} | {c['T']} | {ms('eager')} | {ms('grouped_mm')} | {ms('samoyeds')} | "
                    f"{_f(s.get('speedup_vs_grouped_mm'), '.2f')}x | {_f(s.get('speedup_vs_eager'), '.2f')}x | "
                    f"{_f(s.get('speedup_stream_vs_grouped_mm'), '.2f')}x | {_f(s.get('speedup_gpu_vs_grouped_mm'), '.2f')}x | "
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
                            f"{cell(rs)} | {_x(sp) if sp else '-'} |")
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
                    f"{('>= ' if s.get('capped') else '') + f'{ratio:.2f}x' if ratio else '-'} | "
                    f"{s.get('cap_reason', '') if s.get('capped') else 'memory'} |")
    out = "\n".join(rows)
    if packed:
        p, dd, mb = packed, packed.get("decode", {}), packed.get("max_batch") or {}
        out += (f"\n\n{p['model']} at full depth ({p['layers']} layers, {p['params'] / 1e9:.1f} B parameters): dense "
                f"bf16 weights {p['dense_bytes'] / GiB:.1f} GiB"
                + (f" vs {p['device_bytes'] / GiB:.1f} GiB of GPU memory" if p.get("device_bytes") else "")
                + f"; built packed in {p.get('build_s', 0):.0f} s, resident "
                f"{p.get('allocated_after_build_gib') or p.get('param_and_buffer_bytes', 0) / GiB:.1f} GiB; prefill "
                f"1 x {p.get('prefill', {}).get('seq')} at {_f(p.get('prefill', {}).get('tokens_per_s'), ',.0f')} "
                f"tokens/s (peak {_f(p.get('prefill', {}).get('peak_gib'), '.1f')} GiB); decode "
                f"{_f(dd.get('ms_per_step'), '.1f')} ms/token; largest batch "
                f"{mb.get('max')} x {p.get('prefill', {}).get('seq')}"
                + (f" (search stopped by its time budget; {mb['first_failure']} fails)"
                   if mb.get("capped") and mb.get("first_failure") else ""))
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


def layer_trace_table(d: dict) -> str:
    """GPU kernel time per MoE block call, grouped_mm experts against samoyeds, and the
    share of each method's kernel time that is its expert matmuls."""
    rows = ["| model | T | grouped_mm: kernels | of which expert matmuls | samoyeds: kernels | of which expert "
            "matmuls | samoyeds' other kernels (largest) | grouped_mm / samoyeds |",
            "|---|---:|---:|---:|---:|---:|---|---:|"]
    for c in d["cases"]:
        g, s = c["methods"]["grouped_mm"], c["methods"]["samoyeds"]
        ge, se = g["groups_us"].get("expert matmuls", 0.0), s["groups_us"].get("expert matmuls", 0.0)
        other = sorted(((k, v) for k, v in s["groups_us"].items() if k != "expert matmuls"), key=lambda kv: -kv[1])
        rest = ", ".join(f"{k} {v:.0f} us" for k, v in other[:3])
        rows.append(f"| {c['model']} | {c['T']} | {g['total_us']:.0f} us | {ge / g['total_us']:.0%} | "
                    f"{s['total_us']:.0f} us | {se / s['total_us']:.0%} | {rest} | "
                    f"{g['total_us'] / s['total_us']:.2f}x |")
    return "\n".join(rows)


def _range(xs, fmt="{:.2f}x", bold=False):
    """lo-hi of xs; with ``bold``, the part below 1 (where samoyeds loses) in **bold**."""
    xs = [x for x in xs if x]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    b = lambda s, v: f"**{s}**" if bold and v < 1 else s  # noqa: E731
    if abs(hi - lo) < 0.005:
        return b(fmt.format(lo), lo)
    if bold and hi < 1:
        return f"**{fmt.format(lo)}-{fmt.format(hi)}**"
    return f"{b(fmt.format(lo), lo)}-{fmt.format(hi)}"


def _x(v: float) -> str:
    """A ratio, in **bold** below 1."""
    return f"**{v:.2f}x**" if v < 1 else f"{v:.2f}x"


def accuracy_table(d: dict) -> str:
    """Held-out perplexity per variant (before / after the masked fine-tune), the targets, the checkpoint."""
    rows = ["| variant | sparsity | perplexity | after masked fine-tune |", "|---|---:|---:|---:|"]
    for r in d.get("variants", []):
        if "ppl" not in r:
            rows.append(f"| {r.get('name')} | | error: {str(r.get('error', '?'))[:60]} | |")
            continue
        ft = (r.get("finetuned") or {}).get("ppl")
        rows.append(f"| {r['name']} | {r.get('sparsity', 0):.0%} | {r['ppl']:.3f} | {f'{ft:.3f}' if ft else '-'} |")
    out = "\n".join(rows)
    t = d.get("targets") or {}
    lines = []
    a = t.get("calibrated_loses_at_most_half_of_magnitude")
    if a:
        lines.append(f"- calibrated ({a['method']}) pruning loses at most half of what magnitude pruning loses: "
                     f"perplexity +{a['calibrated_ppl_increase']:.3f} vs +{a['magnitude_ppl_increase']:.3f} over "
                     f"dense: {'met' if a.get('met') else 'NOT met'}")
    b = t.get("finetuned_within_10pct_of_dense")
    if b:
        lines.append(f"- after the masked fine-tune within 10 % of dense: {b['ppl']:.3f} vs {b['dense_ppl']:.3f} "
                     f"({b['ppl'] / b['dense_ppl'] - 1:+.1%}): {'met' if b.get('met') else 'NOT met'}")
    c = t.get("finetuned_at_least_as_good_as_venom")
    if c:
        lines.append(f"- after the fine-tune at least as good as VENOM-style 75 % ({c.get('venom_method')}): "
                     f"{c['samoyeds']:.3f} vs {c['venom']:.3f}: {'met' if c.get('met') else 'NOT met'}")
    ck = (d.get("packed") or {}).get("checkpoint_bfloat16")
    if ck:
        p = d["packed"]
        lines.append(f"- packed checkpoint ({ck['format']}, bf16): experts file {ck['experts_file_bytes']:,} B = "
                     f"{ck['file_fraction']:.1%} of the dense expert bytes ({ck['dense_experts_bytes']:,} B); "
                     f"reloaded perplexity {p.get('reloaded_ppl', float('nan')):.4f}, identical: "
                     f"{p.get('reloaded_equal')}")
    return out + ("\n\n" + "\n".join(lines) if lines else "")


def decode_table(d: dict) -> str:
    """The decode kernel: achieved bandwidth over the routed experts' packed bytes, and the block;
    "back to back": calls on rotated weight copies back to back in one graph (bench_decode.py)."""
    rs = d.get("rows", [])
    same = any("copy_same_bytes_ms" in r for r in rs)
    b2b = any("decode_stream_ms" in r for r in rs)
    rows = ["| model | projection | T | routed rows S | experts read | MB read | decode kernel | TB/s | of device copy "
            + ("| of a copy of the same bytes " if same else "")
            + ("| back to back | TB/s | of device copy | of same-bytes copies back to back " if b2b else "")
            + "| mma.sp | wgmma.sp |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if same else "") + ("---:|" * 4 if b2b else "")
            + "---:|---:|"]
    blk_rows = [r for r in rs if r.get("proj") == "block"]
    serial = any("auto/serial" in r.get("ms", {}) for r in blk_rows)
    bb = any("auto_stream_ms" in r for r in blk_rows)
    blocks = ["| model | T | MoE block, impl auto | " + ("launches one after another | " if serial else "")
              + "decode | mma.sp | wgmma.sp | auto vs mma.sp |"
              + (" weights MB | of device copy | back to back | of device copy |" if bb else ""),
              "|---|---:|---:|" + ("---:|" if serial else "") + "---:|---:|---:|---:|" + ("---:|" * 4 if bb else "")]
    for r in rs:
        m = r.get("ms", {})
        if r.get("proj") == "block":
            if m.get("auto") and m.get("mma_sp"):
                ser = f"{_f(m.get('auto/serial'), '.3f')} ms | " if serial else ""
                tail = ""
                if bb:
                    tail = (f" {r['bytes'] / 1e6:.1f} | {r['frac_of_copy']:.0%} | {r['auto_stream_ms']:.3f} ms | "
                            f"{r['frac_of_copy_stream']:.0%} |" if "auto_stream_ms" in r else " - | - | - | - |")
                blocks.append(f"| {r['model']} | {r['T']} | {m['auto']:.3f} ms | {ser}{_f(m.get('decode'), '.3f')} ms | "
                              f"{m['mma_sp']:.3f} ms | {_f(m.get('wgmma_sp'), '.3f')} ms | {_x(m['mma_sp'] / m['auto'])} |"
                              + tail)
            continue
        if "decode_ms" not in r:
            continue
        stream = ""
        if b2b:
            stream = (f"{r['decode_stream_ms']:.3f} ms | {r['decode_stream_tb_s']:.2f} | {r['frac_of_copy_stream']:.0%} | "
                      f"{r['frac_of_copy_same_bytes_stream']:.0%} | " if "decode_stream_ms" in r else "- | - | - | - | ")
        rows.append(f"| {r['model']} | {r['proj']} | {r['T']} | {r['S']} | {r['routed_experts']} | "
                    f"{r['bytes'] / 1e6:.1f} | {r['decode_ms']:.3f} ms | {r['decode_tb_s']:.2f} | "
                    f"{r['frac_of_copy']:.0%} | "
                    + (f"{r['frac_of_copy_same_bytes']:.0%} | " if same else "") + stream
                    + f"{_f(m.get('mma_sp'), '.3f')} ms | {_f(m.get('wgmma_sp'), '.3f')} ms |")
    return "\n".join(rows) + "\n\n" + "\n".join(blocks)


def _md(cols: list, body: list) -> str:
    """A Markdown table: column titles (the first column left-aligned, the others right-aligned
    unless the title starts with "<"), then the rows of cells."""
    titles = [c.lstrip("<") for c in cols]
    align = ["---" if i == 0 or c.startswith("<") else "---:" for i, c in enumerate(cols)]
    lines = ["| " + " | ".join(titles) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    return "\n".join(lines)


def dense_decode_table(d: dict) -> str:
    """dense_decode.json: unpruned shared experts at decode sizes, samoyeds.dense_decode against the
    transformers MLP, and the weight bandwidth against the device copy of the same run."""
    return _md(["shared MLP", "H", "I", "T", "transformers", "dense_decode", "speed-up", "TB/s", "of device copy"],
               [[r["shape"], r["H"], r["I"], r["T"], f"{r['ms']['transformers'] * 1e3:.1f} us",
                 f"{r['ms']['dense_decode'] * 1e3:.1f} us", _x(r["speedup"]), f"{r['dense_decode_tb_s']:.2f}",
                 f"{r['frac_of_copy']:.0%}"] for r in d.get("rows", [])])


def router_table(d: dict) -> str:
    """router.json: each family's transformers router module against its patched forward
    (samoyeds.router), CUDA-graph replays; bytes against the device copy of the same run; where
    the file has them, samoyeds.router with SAMOYEDS_ROUTER_KERNELS=1 (the kernels before the
    tile kernel and the keys) in the same run."""
    prev = any(r["ms"].get("samoyeds_previous_kernels") for r in d.get("rows", []))
    body = []
    for r in d.get("rows", []):
        m = r["ms"]
        p = m.get("samoyeds_previous_kernels")
        body.append([r["model"], r["H"], r["E"], r["k"], r["T"], f"{m['transformers'] * 1e3:.1f} us",
                     f"{m['samoyeds'] * 1e3:.1f} us", _x(r["speedup"]), _f(r.get("frac_of_copy"), ".0%"),
                     f"{r['rows_choosing_differently']} ({'yes' if r['differences_are_ties'] else 'no'})"]
                    + ([f"{p * 1e3:.1f} us ({_x(p / m['samoyeds'])})" if p else ""] if prev else []))
    return _md(["router", "H", "experts", "k", "T", "transformers", "samoyeds", "speed-up", "of device copy",
                "<tokens choosing other experts (all ties)"] + (["previous kernels (speed-up)"] if prev else []), body)


def shared_mlp_table(d: dict) -> str:
    """shared_mlp.json: unpruned shared experts at prefill sizes, the patched path (cuBLAS's
    matmuls with samoyeds.glu) against the transformers MLP, and the activation alone."""
    return _md(["shared MLP", "H", "I", "T", "transformers", "samoyeds", "speed-up", "silu * up", "glu",
                "glu of device copy"],
               [[r["shape"], r["H"], r["I"], r["T"], f"{r['ms']['transformers'] * 1e3:.1f} us",
                 f"{r['ms']['samoyeds'] * 1e3:.1f} us", _x(r["speedup"]), f"{r['ms']['act_torch'] * 1e3:.1f} us",
                 f"{r['ms']['act_glu'] * 1e3:.1f} us", _f(r.get("glu_frac_of_copy"), ".0%")]
                for r in d.get("rows", [])])


def ssmm_kernels_table(d: dict) -> str:
    """The GPU kernels of ssmm and cuBLAS on the same inputs: mma.sp, single-role wgmma.sp, the
    warp-specialised one with one item per CTA, on its persistent grid (auto's), with ping-pong
    consumers (2:4), in clusters sharing the weights by multicast and with a work counter; and the
    persistent kernel with the cp.async gather of the token rows against its default (rows by TMA
    where x is read without a row map: the down cases)."""
    rows = ["| format | case | E | R x C, S tokens | mma.sp | wgmma.sp | warp-spec., one item per CTA | "
            "warp-spec., persistent | cuBLAS | ping-pong | clusters of 2 | work counter | persistent vs one item per CTA | "
            "ping-pong / clusters / counter vs persistent | persistent vs cuBLAS | token rows by gather | "
            "default vs gather |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d.get("rows", []):
        ws = r.get("wgmma_ws_ms")
        rel = lambda k: _x(ws / r[k]) if ws and r.get(k) else "-"  # noqa: E731
        rows.append(f"| {r['fmt']} | {r['case']} | {r['E']} | {r['R']} x {r['C']}, {r['S']} | "
                    f"{_f(r.get('mma_sp_ms'), '.3f')} ms | {_f(r.get('wgmma_ms'), '.3f')} ms | "
                    f"{_f(r.get('wgmma_ws_1tile_ms'), '.3f')} ms | {_f(ws, '.3f')} ms | "
                    f"{_f(r.get('cublas_ms'), '.3f')} ms | {_f(r.get('wgmma_ws_pingpong_ms'), '.3f', '- ')} ms | "
                    f"{_f(r.get('wgmma_ws_cluster_ms'), '.3f')} ms | {_f(r.get('wgmma_ws_dynamic_ms'), '.3f')} ms | "
                    f"{_x(r['wgmma_ws_1tile_ms'] / ws) if ws and r.get('wgmma_ws_1tile_ms') else '-'} | "
                    f"{rel('wgmma_ws_pingpong_ms')} / {rel('wgmma_ws_cluster_ms')} / {rel('wgmma_ws_dynamic_ms')} | "
                    f"{_x(r['cublas_ms'] / ws) if ws and r.get('cublas_ms') else '-'} | "
                    f"{_f(r.get('wgmma_ws_gather_ms'), '.3f')} ms | "
                    f"{_x(r['wgmma_ws_gather_ms'] / ws) if ws and r.get('wgmma_ws_gather_ms') else '-'} |")
    return "\n".join(rows)


def headline(gpu: str) -> str:
    """The README's headline ratios, each linked to its JSON (only the files that exist)."""
    link = lambda n: f"[{n}](benchmarks/results/{gpu}/{n})"  # noqa: E731
    rows = ["| what | samoyeds vs peer | from |", "|---|---:|---|"]
    d, _ = _load(gpu, "moe.json")
    if d:
        for key, how in (("speedup_vs_grouped_mm", ""), ("speedup_stream_vs_grouped_mm", ", back to back"),
                         ("speedup_gpu_vs_grouped_mm", ", GPU time")):
            by_T = {}
            for c in d["cases"]:
                by_T.setdefault(c["T"], []).append(c["methods"].get("samoyeds", {}).get(key))
            if not any(v for vs in by_T.values() for v in vs):
                continue  # files from before the back-to-back timing
            big = max(by_T)
            rows.append(f"| MoE layer vs transformers' grouped_mm{how}, T = 4096 | {_range(by_T.get(4096, []), bold=True)} | {link('moe.json')} |")
            rows.append(f"| MoE layer vs grouped_mm{how}, T = {big} | {_range(by_T[big], bold=True)} | {link('moe.json')} |")
            small = [x for T in by_T if T <= 16 for x in by_T[T]]
            rows.append(f"| MoE layer vs grouped_mm{how}, decode (T <= 16) | {_range(small, bold=True)} | {link('moe.json')} |")
        pk = [c["methods"]["grouped_mm"]["peak_mib"] / c["methods"]["samoyeds"]["peak_mib"] for c in d["cases"]
              if c["T"] >= 4096 and c["methods"].get("samoyeds", {}).get("peak_mib")
              and c["methods"].get("grouped_mm", {}).get("peak_mib")]
        rows.append(f"| MoE layer peak activation memory, grouped_mm / samoyeds, T >= 4096 | {_range(pk, bold=True)} | {link('moe.json')} |")
        rows.append(f"| expert weight bytes, samoyeds / dense | "
                    f"{_range([c['expert_bytes_samoyeds'] / c['expert_bytes_dense'] for c in d['cases']], '{:.0%}')} | "
                    f"{link('moe.json')} |")
    d, _ = _load(gpu, "kernel.json")
    if d:
        for T in sorted({c["T"] for c in d["cases"]}):
            sp = [c["methods"].get("samoyeds-75", {}).get("speedup_vs_cublas") for c in d["cases"] if c["T"] == T]
            rows.append(f"| kernel, one projection, 75 % vs cuBLAS, T = {T} | {_range(sp, bold=True)} | {link('kernel.json')} |")
        for T in sorted({c["T"] for c in d["cases"]}):
            if T < 4096:
                continue
            sp = [c["methods"].get("samoyeds-50", {}).get("speedup_vs_cublas") for c in d["cases"] if c["T"] == T]
            rows.append(f"| kernel, one projection, 2:4 vs cuBLAS, T = {T} | {_range(sp, bold=True)} | {link('kernel.json')} |")
        rate = d.get("ceilings", {}).get("wgmma_sp_tflops")
        if rate:
            for fmt, name in (("samoyeds-75", "75 %"), ("samoyeds-50", "2:4")):
                fr = [c["methods"].get(fmt, {}).get("frac_wgmma_sp") for c in d["cases"] if c["T"] >= 4096]
                rows.append(f"| kernel, {name}, T >= 4096: fraction of the wgmma.sp issue rate ({rate:.0f} TFLOP/s, "
                            f"same run) | {_range(fr, '{:.0%}')} | {link('kernel.json')} |")
            for fmt, name in (("samoyeds-75", "75 %"), ("samoyeds-50", "2:4")):
                fr = [c["methods"].get(fmt, {}).get("frac_form") for c in d["cases"] if c["T"] >= 4096]
                if any(f is not None for f in fr):
                    at = [c["methods"].get(fmt, {}).get("speedup_vs_cublas_at_form") for c in d["cases"]
                          if c["T"] >= 4096 and c["S"] >= 1024 * c["E"]]
                    rows.append(f"| kernel, {name}, T >= 4096: fraction of the issue rate of the wgmma.sp form its "
                                f"tiles issue (A from shared memory, N = the tile's tokens; same run) | "
                                f"{_range(fr, '{:.0%}')} | {link('kernel.json')} |")
                    rows.append(f"| kernel, {name}, >= 1024 tokens per expert: vs cuBLAS if its tensor cores ran at "
                                f"that form's rate and nothing else cost time | {_range(at)} | {link('kernel.json')} |")
        fill = fill_ceiling(d.get("ceilings", {}))
        if fill:
            big = [c for c in d["cases"] if c["T"] >= 4096 and c["S"] >= 1024 * c["E"]]
            for fmt, name in (("samoyeds-75", "75 %"), ("samoyeds-50", "2:4")):
                fr = [c["methods"].get(fmt, {}).get("stream_tb_s") for c in d["cases"] if c["T"] >= 4096]
                rows.append(f"| kernel, {name}, T >= 4096: operand stream into shared memory, fraction of the "
                            f"fill rate ({fill:.2f} TB/s, same run) | {_range([f / fill for f in fr if f], '{:.0%}')} | "
                            f"{link('kernel.json')} |")
                at = [c["methods"].get(fmt, {}).get("speedup_vs_cublas_at_fill") for c in big]
                rows.append(f"| kernel, {name}, >= 1024 tokens per expert: vs cuBLAS if the stream ran at the fill "
                            f"rate (the data ceiling of its tiles) | {_range(at)} | {link('kernel.json')} |")
    d, _ = _load(gpu, "sweep.json")
    if d:
        sp = [c["methods"].get("samoyeds-75", {}).get("speedup_vs_cublas") for c in d["cases"]]
        rows.append(f"| kernel sweep, one expert, 75 % vs cuBLAS (geomean; range) | {_x(_geomean(sp))}; {_range(sp, bold=True)} | "
                    f"{link('sweep.json')} |")
    d, _ = _load(gpu, "e2e.json")
    if d:
        for phase in ("prefill", "decode"):
            sp = [r.get("speedup_vs_grouped_mm") for c in d["cases"] if "methods" in c
                  for r in c["methods"].get("samoyeds", {}).get(phase, [])]
            rows.append(f"| whole model {phase} tokens/s vs grouped_mm | {_range(sp, bold=True)} | {link('e2e.json')} |")
    d, _ = _load(gpu, "memory.json")
    if d:
        for c in d["cases"]:
            if c.get("samoyeds_over_grouped_mm"):
                capped = c["methods"].get("samoyeds", {}).get("capped")
                rows.append(f"| largest batch, {c['scope']} {c['model']}, vs grouped_mm | "
                            f"{'>= ' if capped else ''}{_x(c['samoyeds_over_grouped_mm'])} | {link('memory.json')} |")
            if c.get("scope") == "packed" and c.get("prefill"):
                rows.append(f"| {c['model']} full depth ({c['params'] / 1e9:.1f} B parameters, "
                            f"{c['dense_bytes'] / 2**30:.0f} GiB dense) on one GPU | runs, "
                            f"{_f(c.get('allocated_after_build_gib'), '.1f')} GiB resident | {link('memory.json')} |")
    d, _ = _load(gpu, "breakdown.json")
    if d:
        for c in d["cases"]:
            m = c["methods"]
            a, e = m.get("a_sparse_weights", {}).get("ms"), m.get("e_grouped_launch", {}).get("ms")
            if a and e:
                rows.append(f"| breakdown {c['model']} T = {c['T']}: (e) full layer vs (a) sparse weights only | "
                            f"{_x(a / e)} | {link('breakdown.json')} |")
    port = os.path.join(HERE, "results", "portability.json")
    if os.path.exists(port):
        with open(port) as fh:
            p = json.load(fh)
        archs = p.get("archs", {})
        ok = all(r.get("ok") for r in archs.values()) and p.get("package_build", {}).get("ok")
        rows.append(f"| builds for {', '.join(archs)} (one binary) | {'yes' if ok else '**no**'} | "
                    f"[portability.json](benchmarks/results/portability.json) |")
    d, _ = _load(gpu, "layer_trace.json")
    if d:
        share = [c["methods"]["samoyeds"]["groups_us"].get("expert matmuls", 0.0) / c["methods"]["samoyeds"]["total_us"]
                 for c in d["cases"]]
        rows.append(f"| MoE layer, T >= 4096: expert matmuls' share of samoyeds' GPU kernel time | "
                    f"{_range(share, '{:.0%}')} | {link('layer_trace.json')} |")
    d, _ = _load(gpu, "dense_decode.json")
    if d and d.get("rows"):
        small = [r for r in d["rows"] if r["T"] <= 16]
        rows.append(f"| unpruned shared experts, T <= 16: dense_decode vs the transformers MLP; weight stream, "
                    f"of the device copy rate | {_range([r['speedup'] for r in small], bold=True)}; "
                    f"{_range([r['frac_of_copy'] for r in small], '{:.0%}')} | {link('dense_decode.json')} |")
    d, _ = _load(gpu, "router.json")
    if d and d.get("rows"):
        big, small = [r for r in d["rows"] if r["T"] >= 4096], [r for r in d["rows"] if r["T"] <= 16]
        rows.append(f"| router (logits, softmax, top-k) vs the transformers router module, T <= 16; T >= 4096 | "
                    f"{_range([r['speedup'] for r in small], bold=True)}; {_range([r['speedup'] for r in big], bold=True)}"
                    f" | {link('router.json')} |")
    d, _ = _load(gpu, "shared_mlp.json")
    if d and d.get("rows"):
        big = [r for r in d["rows"] if r["T"] >= 4096]
        rows.append(f"| unpruned shared experts, T >= 4096: SiLU-times-up, samoyeds.glu vs torch; the MLP | "
                    f"{_range([r['act_speedup'] for r in big], bold=True)}; {_range([r['speedup'] for r in big], bold=True)}"
                    f" | {link('shared_mlp.json')} |")
    d, _ = _load(gpu, "accuracy.json")
    if d and d.get("targets"):
        t = d["targets"]
        met = sum(bool(v.get("met")) for v in t.values())
        b = t.get("finetuned_within_10pct_of_dense", {})
        ppl = (f"perplexity {b['ppl']:.3f} vs dense {b['dense_ppl']:.3f}; " if b.get("ppl") and b.get("dense_ppl")
               else "")
        rows.append(f"| accuracy study ({d.get('mode')} mode), Samoyeds 75 % pruned + masked fine-tune | {ppl}"
                    f"{met} of {len(t)} targets met | {link('accuracy.json')} |")
    return "\n".join(rows)


def shared_stream_table(d: dict) -> str:
    """probe_shared_stream.json: a patched block with its shared MLP on a second stream against
    the same block on one stream (and grouped_mm), GPU time, from an idle GPU, host enqueue."""
    rows = ["| T | one stream: GPU time | two streams: GPU time | gain | vs `grouped_mm` (one / two) | "
            "from an idle GPU: one / two | host enqueue: one / two |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        g, m, h = r["ms_gpu"], r["ms"], r["host_ms"]
        rows.append(f"| {r['T']} | {g['one_stream'] * 1e3:.1f} us | {g['two_streams'] * 1e3:.1f} us | "
                    f"{g['one_stream'] / g['two_streams']:.2f}x | {g['grouped_mm'] / g['one_stream']:.2f}x / "
                    f"{g['grouped_mm'] / g['two_streams']:.2f}x | {m['one_stream'] * 1e3:.0f} / "
                    f"{m['two_streams'] * 1e3:.0f} us | {h['one_stream'] * 1e3:.0f} / {h['two_streams'] * 1e3:.0f} us |")
    return "\n".join(rows)


def merge_moe(out: str, parts: list) -> None:
    """One moe.json from bench_moe.py runs over disjoint model lists (one call on the GPU machine
    has a time limit): the cases and token-rounding rows of each, every run's environment under
    "runs" (the first is "env"), complete only where each run was."""
    runs = []
    for p in parts:
        with open(p) as fh:
            runs.append(json.load(fh))
    models = [m for r in runs for m in r.get("models", sorted({c["model"] for c in r["cases"]}))]
    if len(models) != len(set(models)):
        raise SystemExit(f"--merge-moe: a model appears in more than one run: {models}")
    merged = {"env": runs[0]["env"], "runs": [r["env"] for r in runs],
              "complete": all(r.get("complete", True) for r in runs), "models": models,
              "cases": [c for r in runs for c in r["cases"]],
              "token_rounding": [t for r in runs for t in r.get("token_rounding", [])]}
    with open(out, "w") as fh:
        json.dump(merged, fh, indent=1, allow_nan=False)
    print(f"wrote {out}: {len(merged['cases'])} cases of {', '.join(models)} from {len(runs)} runs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--headline", action="store_true", help="only the README's headline table")
    ap.add_argument("--merge-moe", nargs="+", metavar=("OUT", "RUN"), help="merge bench_moe.py runs into OUT")
    a = ap.parse_args()
    if a.merge_moe:
        if len(a.merge_moe) < 3:
            ap.error("--merge-moe: OUT and at least two runs")
        merge_moe(a.merge_moe[0], a.merge_moe[1:])
        return
    if a.headline:
        print(headline(a.gpu))
        return
    for name, fn in (("moe.json", moe_table), ("kernel.json", kernel_table), ("sweep.json", sweep_table),
                     ("e2e.json", e2e_table), ("memory.json", memory_table), ("breakdown.json", breakdown_table),
                     ("accuracy.json", accuracy_table), ("bench_decode.json", decode_table),
                     ("ssmm_kernels.json", ssmm_kernels_table), ("fill_rate.json", fill_rate_table),
                     ("layer_trace.json", layer_trace_table), ("dense_decode.json", dense_decode_table),
                     ("router.json", router_table), ("shared_mlp.json", shared_mlp_table),
                     ("experiments/probe_shared_stream.json", shared_stream_table)):
        d, path = _load(a.gpu, name)
        if d is None:
            print(f"(no {path})")
            continue
        env = d.get("env") or d.get("environment") or d
        print(f"\n{name}: {env.get('device')}, commit {env.get('commit', '?')[:10]}, {env.get('date')}, "
              f"torch {env.get('torch')}; `{env.get('command')}`\n")
        for r in d.get("runs", [])[1:]:
            print(f"  and {r.get('device')}, commit {r.get('commit', '?')[:10]}, {r.get('date')}; `{r.get('command')}`\n")
        if d.get("ceilings"):
            c = d["ceilings"]
            print(f"ceilings measured in the same run: dense bf16 {c['dense_bf16_tflops']:.0f} TFLOP/s, "
                  f"copy {c['copy_tb_s']:.2f} TB/s\n")
        print(fn(d))
        if name == "kernel.json" and fill_table(d):
            print("\n" + fill_table(d))
    print("\n" + headline(a.gpu))


if __name__ == "__main__":
    main()
