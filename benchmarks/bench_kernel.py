"""Kernel benchmark: one MoE projection (all experts) per case.

Every method gets the same activations, the same routed token sets and the
same (masked) weights:
  samoyeds-75   ssmm, format samoyeds-1:2:128, tokens gathered by index in-kernel,
                fused epilogue (SwiGLU for gate_up, routing weight for down)
  samoyeds-50   ssmm, plain 2:4
  cublas        torch.mm per expert on pre-gathered tokens (matmul only)
  grouped_mm    torch._grouped_mm over all experts on pre-gathered, sorted tokens
  cusparselt    torch._cslt_sparse_mm per expert (2:4, searched algorithm) on
                pre-gathered tokens
The peers' gathers and activations are not timed.  Each method is captured in
a CUDA graph and timed by replay with CUDA events (median).  Ceilings (dense
bf16 matmul rate, copy bandwidth, the tensor cores' issue rate per instruction
form, the shared-memory fill rates) are measured in the same run; frac_wgmma_sp
(also written as frac_issue_rate) is a samoyeds case's executed sparse work against the wgmma.sp issue rate, the
instruction its Hopper kernels run on.  Where the default dispatch runs the
warp-specialised wgmma.sp kernel (more than 128 routed rows and more than 16 per
expert on average), stream_tb_s is the rate at which that kernel's k-tile stages
(weights, tokens, metadata) went from L2 into shared memory, and frac_fill_tma /
frac_fill_gather / frac_fill_mixed set it against the fill rate of TMA boxes, of
the cp.async gather and of stages holding both, measured in the same run
(dev/peak/peak.py): the data ceiling.  speedup_vs_cublas_at_fill is what
the kernel's tiles would reach against cuBLAS if their stream ran at the fastest
of those fill rates.  form is the wgmma.sp instruction form that kernel's tile
issues (the packed values read from shared memory, N = the tile's tokens), and
frac_form the executed work against that form's issue rate in the same run
(dev/lab/tc_forms.py: the forms that read more shared memory per flop issue
slower); speedup_vs_cublas_at_form is what the case would reach against cuBLAS
with its tensor cores at that rate and nothing else costing time.

  python benchmarks/bench_kernel.py [--quick] [--models a,b] [--tokens 256,4096] [--out DIR]
                                    [--tiny --device cpu]   (a CPU smoke run: shapes / 16, wall clock)
"""
from __future__ import annotations

import argparse
import math
import warnings
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from common import (SHAPES, MoEShape, add_run_args, ceilings_line, default_dtype, environment,  # noqa: E402
                    free_memory, measure_ceilings, result_path, setup_run, time_graph, time_ms, write_json,
                    WS_TILE_FORM, ws_stream_bytes, ws_tall_tile, ws_tile_name)
from report import fill_ceiling  # noqa: E402

FORMATS = {"samoyeds-75": "samoyeds-1:2:128", "samoyeds-50": "2:4"}


def routing(T: int, E: int, K: int, gen: torch.Generator, device: str = "cuda"):
    logits = torch.randn(T, E, generator=gen, device=device)
    w, idx = torch.softmax(logits, -1).topk(K, dim=-1)
    return idx, w / w.sum(-1, keepdim=True)


def run_case(shape, T: int, proj: str, gen: torch.Generator, methods, ceil: dict, device: str = "cuda") -> dict:
    H, I, E, K = shape.hidden, shape.inter, shape.experts, shape.top_k
    dtype = default_dtype(device)
    timer = time_graph if device == "cuda" else (lambda fn: time_ms(fn, device, budget_s=0.05, max_iters=10))
    R, C = (2 * I, H) if proj == "gate_up" else (H, I)
    act = "swiglu" if proj == "gate_up" else "none"
    idx, rw = routing(T, E, K, gen, device)
    r = sm.route(idx, E)
    offs = r.offsets.cpu()
    counts = (offs[1:] - offs[:-1]).tolist()
    S = T * K
    scale = sm.gather_weights(rw, r)
    if proj == "gate_up":
        x = torch.randn(T, C, generator=gen, device=device, dtype=dtype)
        tok = r.token_ids
        x_sorted = x[tok.long()]
    else:
        x = torch.randn(S, C, generator=gen, device=device, dtype=dtype)
        tok = None
        x_sorted = x
    w = (torch.randn(E, R, C, generator=gen, device=device, dtype=dtype) * C ** -0.5)
    res = {"model": shape.name, "T": T, "proj": proj, "E": E, "K": K, "R": R, "C": C, "S": S,
           "tokens_per_expert_max": max(counts), "tokens_per_expert_mean": S / E, "counts": counts,
           "dense_flop": 2.0 * S * R * C, "methods": {}}
    packed = {}
    for name, fmt in FORMATS.items():
        packed[name] = sm.pack(w, fmt, glu=proj == "gate_up")
    masked75 = sm.unpack(packed["samoyeds-75"])  # peers: the same weights, [gate; up] order
    del w
    out_cols = R // 2 if act == "swiglu" else R
    starts = offs[:-1].tolist()

    def ours(name):
        p = packed[name]
        out = torch.empty(S, out_cols, device=device, dtype=dtype)
        sc = scale if proj == "down" else None
        return lambda: sm.ssmm(x, p, r.offsets, tok, out=out, act=act, scale=sc)

    def cublas():
        outs = [torch.empty(c, R, device=device, dtype=dtype) for c in counts]
        xs = [x_sorted[s:s + c] for s, c in zip(starts, counts)]

        def fn():
            for e in range(E):
                if counts[e]:
                    torch.mm(xs[e], masked75[e].T, out=outs[e])
        return fn

    def grouped():
        wt = masked75.transpose(1, 2)
        off32 = r.offsets[1:].to(torch.int32)
        return lambda: torch._grouped_mm(x_sorted, wt, offs=off32)

    def cslt():
        # cuSPARSELt wants a row-major dense operand with 16-aligned extents: tokens are
        # gathered, transposed and padded outside the timed region
        comp = [torch._cslt_compress(masked75[e].contiguous()) for e in range(E)]
        xsT = []
        for s, c in zip(starts, counts):
            pad = -c % 16
            b = torch.zeros(C, c + pad, device=device, dtype=dtype)
            b[:, :c] = x_sorted[s:s + c].T
            xsT.append(b)
        algs = {}
        for e in range(E):
            if counts[e]:
                try:
                    algs[e] = int(torch._cslt_sparse_mm_search(comp[e], xsT[e]))
                except (RuntimeError, AttributeError):
                    algs[e] = 0

        def fn():
            for e in range(E):
                if counts[e]:
                    torch._cslt_sparse_mm(comp[e], xsT[e], alg_id=algs[e], transpose_result=True)
        return fn

    makers = {"samoyeds-75": lambda: ours("samoyeds-75"), "samoyeds-50": lambda: ours("samoyeds-50"),
              "cublas": cublas, "grouped_mm": grouped, "cusparselt": cslt}
    for m in methods:
        try:
            fn = makers[m]()
            t = timer(fn)
            res["methods"][m] = t
        except Exception as exc:  # a peer that cannot run this shape is reported, not fatal
            res["methods"][m] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        free_memory(device)

    # derived numbers
    if ceil is None:
        ceil = {"dense_bf16_tflops": float("nan"), "copy_tb_s": float("nan")}
    dense_rate = ceil["dense_bf16_tflops"] * 1e12
    bw = ceil["copy_tb_s"] * 1e12
    wgmma_sp = ceil.get("wgmma_sp_tflops")  # None off sm_90 / without sm_90a
    fill = fill_ceiling(ceil)  # the data ceiling (TB/s); 0 off sm_90 / without sm_90a
    for m, t in res["methods"].items():
        if "ms" not in t:
            continue
        t["dense_equiv_tflops"] = res["dense_flop"] / (t["ms"] * 1e-3) / 1e12
        if m.startswith("samoyeds"):
            p = packed[m]
            density = p.fmt.density
            # executed sparse-core work (dense-equivalent) at 2x the dense rate
            exec_flop = res["dense_flop"] * density * 2
            used = sum(1 for c in counts if c)
            w_bytes = p.nbytes * used / E
            io_bytes = (T if proj == "gate_up" else S) * C * 2 + S * out_cols * 2
            t_floor = max(exec_flop / (2 * dense_rate), (w_bytes + io_bytes) / bw)
            t["frac_sparse_ceiling"] = exec_flop / (t["ms"] * 1e-3) / (2 * dense_rate)
            t["frac_wgmma_sp"] = exec_flop / (t["ms"] * 1e-3) / (wgmma_sp * 1e12) if wgmma_sp else None
            t["frac_issue_rate"] = t["frac_wgmma_sp"]  # the name the targets use
            t["time_floor_ms"] = t_floor * 1e3
            t["frac_floor"] = t_floor / (t["ms"] * 1e-3)
            # the default dispatch runs the wgmma.sp kernel above the decode kernel's row limits
            # (docs/KERNELS.md, "Selection"; the benchmark keeps samoyeds.config's defaults)
            if wgmma_sp and S > 128 and S > 16 * E:
                sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                tall = ws_tall_tile(p.dims.rp, S, E, tok is None, sms) if p.fmt.m == 2 else 0
                t["tile"] = ws_tile_name(p.fmt.m, tall)
                t["form"] = WS_TILE_FORM[t["tile"]]
                form_rate = ceil.get(f"{t['form']}_tflops")
                t["form_time_ms"] = exec_flop / (form_rate * 1e12) * 1e3 if form_rate else None
                t["frac_form"] = t["form_time_ms"] / t["ms"] if form_rate else None
                t["stream_bytes"] = ws_stream_bytes(p.fmt.m, p.dims.rp, C, counts, tall)
                rate = t["stream_bytes"] / (t["ms"] * 1e-3) / 1e12
                t["stream_tb_s"] = rate
                for key, k in (("tma", "tma"), ("gather", "cp_async_gather"), ("mixed", "tma_and_gather")):
                    way = ceil.get(f"fill_{k}_tb_s")
                    t[f"frac_fill_{key}"] = rate / way if way else None
    base = res["methods"]
    for ours_name in FORMATS:
        if "ms" not in base.get(ours_name, {}):
            continue
        for peer in ("cublas", "grouped_mm", "cusparselt"):
            if "ms" in base.get(peer, {}):
                base[ours_name][f"speedup_vs_{peer}"] = base[peer]["ms"] / base[ours_name]["ms"]
        if fill and "stream_bytes" in base[ours_name] and "ms" in base.get("cublas", {}):
            t_fill = base[ours_name]["stream_bytes"] / (fill * 1e12)
            base[ours_name]["speedup_vs_cublas_at_fill"] = base["cublas"]["ms"] * 1e-3 / t_fill
        if base[ours_name].get("form_time_ms") and "ms" in base.get("cublas", {}):
            base[ours_name]["speedup_vs_cublas_at_form"] = base["cublas"]["ms"] / base[ours_name]["form_time_ms"]
    del packed, masked75
    free_memory(device)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="256,4096,16384")
    ap.add_argument("--proj", default="gate_up,down")
    ap.add_argument("--methods", default="samoyeds-75,samoyeds-50,cublas,grouped_mm,cusparselt")
    ap.add_argument("--quick", action="store_true", help="two models, T=4096 only")
    ap.add_argument("--format75", default=FORMATS["samoyeds-75"],
                    help="the format the samoyeds-75 method runs (another slice width V: samoyeds-1:2:V)")
    add_run_args(ap, "shapes / 16 and T = 64: a quick CPU check of the script")
    args = ap.parse_args()
    setup_run(args)
    FORMATS["samoyeds-75"] = sm.SparseFormat.parse(args.format75).name
    if args.quick:
        args.models, args.tokens = "mixtral-8x7b,qwen3-30b-a3b", "4096"
    if args.tiny:
        args.models, args.tokens = "mixtral-8x7b,qwen3-30b-a3b", "64"
    device = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    warnings.filterwarnings("ignore", message=".*_cslt_sparse_mm_search is deprecated.*")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ceil = None
    if device == "cuda":
        ceil = measure_ceilings()
        print(ceilings_line(ceil))
    methods = args.methods.split(",")
    cases = []
    for name in args.models.split(","):
        shape = SHAPES[name]
        if args.tiny:
            shape = MoEShape(shape.name, shape.hidden // 16, max(32, shape.inter // 16), min(shape.experts, 8),
                             min(shape.top_k, 2))
        for T in [int(t) for t in args.tokens.split(",")]:
            for proj in args.proj.split(","):
                res = run_case(shape, T, proj, gen, methods, ceil, device)
                cases.append(res)
                _print_row(res)
    name = "kernel_quick" if args.quick else "kernel"
    if FORMATS["samoyeds-75"] != "samoyeds-1:2:128":
        name += "_" + FORMATS["samoyeds-75"].replace(":", "_")
    path = result_path(args, name + ".json")
    if path:
        write_json(path, {"env": environment(), "ceilings": ceil, "formats": dict(FORMATS), "cases": cases})
    _print_table(cases)


def _ms(res, m):
    t = res["methods"].get(m, {})
    return f"{t['ms']:8.3f}" if "ms" in t else "     err"


def _num(v):
    return math.nan if v is None else v


def _print_row(res):
    ms = " ".join(f"{m}={_ms(res, m).strip()}" for m in res["methods"])
    print(f"{res['model']:>16} T={res['T']:>5} {res['proj']:>7}: {ms}", flush=True)


def _print_table(cases):
    print("\nmodel              T      proj     s75 ms  s50 ms  cublas  grp_mm  cslt   | s75/cub s75/grp s75/cslt s50/cub "
          "| s75 TF/s  frac-ceil frac-wgsp frac-form frac-floor")
    for c in cases:
        m = c["methods"]
        s75 = m.get("samoyeds-75", {})
        s50 = m.get("samoyeds-50", {})

        def sp(d, k):
            v = d.get(k)
            return f"{v:7.2f}" if v else "    -  "
        print(f"{c['model']:<16} {c['T']:>6} {c['proj']:>8} {_ms(c, 'samoyeds-75')}{_ms(c, 'samoyeds-50')}"
              f"{_ms(c, 'cublas')}{_ms(c, 'grouped_mm')}{_ms(c, 'cusparselt')} |"
              f"{sp(s75, 'speedup_vs_cublas')} {sp(s75, 'speedup_vs_grouped_mm')} {sp(s75, 'speedup_vs_cusparselt')}"
              f" {sp(s50, 'speedup_vs_cublas')} | {s75.get('dense_equiv_tflops', math.nan):7.0f}"
              f"   {s75.get('frac_sparse_ceiling', math.nan):6.2f}    {_num(s75.get('frac_wgmma_sp')):6.2f}"
              f"    {_num(s75.get('frac_form')):6.2f}    {s75.get('frac_floor', math.nan):6.2f}")


if __name__ == "__main__":
    main()
