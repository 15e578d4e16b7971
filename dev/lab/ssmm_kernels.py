"""The GPU kernels of ssmm side by side on the same inputs: mma.sp, the
single-role wgmma.sp kernel and the warp-specialised wgmma.sp kernel
(SAMOYEDS_WGMMA_KERNEL=1), the warp-specialised one with one work item per CTA (=3),
on its persistent grid (=2, the default), for 2:4 with ping-pong consumers (=4), in clusters
of two CTAs sharing the weights by TMA multicast (=5) and taking the items from a counter in
global memory (=6), with cuBLAS on the same masked weights and the
same (gathered) tokens as the dense reference.  One expert holding all S tokens
(the kernel's steady state) and whole MoE projections.  Each kernel's output is
compared with the mma.sp kernel's (relative Frobenius difference).

The gate_up cases read x by token index; the down cases read it without a row map
(token_ids None), as a MoE layer's down projection reads its intermediate rows, which
the warp-specialised kernel loads as TMA boxes; wgmma_ws_gather is the same kernel with
the cp.async gather instead (SAMOYEDS_WGMMA_TOKENS_TMA=0).  For 1:2:V those two take the
tile the library picks; wgmma_ws_tall / _tall_gather force the tile of 256 storage rows x
64 tokens (SAMOYEDS_WS_TILE=1), wgmma_ws_tall96 / _tall96_gather 256 x 96 (=2) and
wgmma_ws_128 / _128_gather the one of 128 x 128 (=0).

  python dev/lab/ssmm_kernels.py [--S 8192] [--kernels wgmma_ws,wgmma_ws_tall,...] [--fmt FMT]
                                    [--repeat N] [--cases "mixtral gate_up routed,..."] [--out DIR]

--repeat N times the kernels in N rounds, taking turns, and keeps each one's median (and the
rounds' timings).
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from common import environment, time_graph, write_json  # noqa: E402

KERNELS = [("mma_sp", "mma_sp", None), ("wgmma", "wgmma_sp", "1"), ("wgmma_ws_1tile", "wgmma_sp", "3"),
           ("wgmma_ws", "wgmma_sp", "2"), ("wgmma_ws_pingpong", "wgmma_sp", "4"),
           ("wgmma_ws_cluster", "wgmma_sp", "5"), ("wgmma_ws_dynamic", "wgmma_sp", "6"),
           ("wgmma_ws_gather", "wgmma_sp", "2"), ("wgmma_ws_tall", "wgmma_sp", "2"),
           ("wgmma_ws_tall_gather", "wgmma_sp", "2"), ("wgmma_ws_tall96", "wgmma_sp", "2"),
           ("wgmma_ws_tall96_gather", "wgmma_sp", "2"), ("wgmma_ws_128", "wgmma_sp", "2"),
           ("wgmma_ws_128_gather", "wgmma_sp", "2")]
SELECTED = None  # --kernels: the kernels to time (the first one is the reference of the _err columns)
REPEAT = 1       # --repeat: rounds in which the kernels' timings take turns


def kernels(fmt):
    """The kernels that run `fmt` (ping-pong consumers: 2:4 only; the choice of tile: 1:2:V only)."""
    def runs(name):
        if name == "wgmma_ws_pingpong":
            return fmt == "2:4"
        return not name.startswith(("wgmma_ws_tall", "wgmma_ws_128")) or fmt != "2:4"
    return [k for k in KERNELS if runs(k[0]) and (SELECTED is None or k[0] in SELECTED)]


def run_case(name, E, R, C, S, fmt, act, gen, routed=False, top_k=2):
    glu = act != "none"
    w = torch.randn(E, R, C, generator=gen, device="cuda", dtype=torch.bfloat16)
    p = sm.pack(w, fmt, glu=glu)
    wd = sm.unpack(p)  # masked dense
    del w
    if routed:
        T = S // top_k
        idx = torch.rand(T, E, generator=gen, device="cuda").topk(top_k, -1).indices
        r = sm.route(idx, E)
        offs, tok = r.offsets, r.token_ids
    else:
        offs = torch.tensor([0, S], dtype=torch.int32, device="cuda")
        tok = torch.arange(S, device="cuda", dtype=torch.int32)
    if glu:
        x = torch.randn(S // top_k if routed else S, C, generator=gen, device="cuda", dtype=torch.bfloat16)
    else:  # down: the intermediate rows, in expert order
        x = torch.randn(S, C, generator=gen, device="cuda", dtype=torch.bfloat16)
        tok = None
    cols = R // 2 if glu else R
    row = {"case": name, "E": E, "R": R, "C": C, "S": S, "fmt": fmt, "act": act}
    ref = None

    def select(kname, env):  # the kernel's switches (read at launch, so also by a graph's capture)
        if env is not None:
            os.environ["SAMOYEDS_WGMMA_KERNEL"] = env
        else:
            os.environ.pop("SAMOYEDS_WGMMA_KERNEL", None)
        os.environ["SAMOYEDS_WGMMA_TOKENS_TMA"] = "0" if kname.endswith("_gather") else "1"
        if kname.startswith(("wgmma_ws_tall", "wgmma_ws_128")):
            os.environ["SAMOYEDS_WS_TILE"] = "2" if "tall96" in kname else "1" if "tall" in kname else "0"
        else:
            os.environ.pop("SAMOYEDS_WS_TILE", None)

    out = torch.full((S, cols), float("nan"), device="cuda", dtype=torch.bfloat16)
    for kname, impl, env in kernels(fmt):
        select(kname, env)
        out.fill_(float("nan"))
        sm.ssmm(x, p, offs, tok, out=out, act=act, impl=impl)
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float().clone()
            row[f"{kname}_err"] = 0.0
        else:
            row[f"{kname}_err"] = float((out.float() - ref).norm() / ref.norm())
    # the kernels' timings take turns, REPEAT rounds (each a CUDA-graph median); the row keeps their median
    times = {k[0]: [] for k in kernels(fmt)}
    for _ in range(REPEAT):
        for kname, impl, env in kernels(fmt):
            select(kname, env)
            times[kname].append(time_graph(lambda: sm.ssmm(x, p, offs, tok, out=out, act=act, impl=impl))["ms"])
    for kname, ts in times.items():
        row[f"{kname}_ms"] = statistics.median(ts)
        if REPEAT > 1:
            row[f"{kname}_ms_rounds"] = ts
    os.environ.pop("SAMOYEDS_WGMMA_KERNEL", None)
    os.environ.pop("SAMOYEDS_WGMMA_TOKENS_TMA", None)
    os.environ.pop("SAMOYEDS_WS_TILE", None)
    # cuBLAS: every expert's tokens gathered, dense masked weights (no activation)
    counts = (offs[1:] - offs[:-1]).tolist()
    xs = x[tok.long()] if tok is not None else x
    chunks = []
    s0 = 0
    for e, n in enumerate(counts):
        chunks.append((e, s0, n))
        s0 += n
    yd = torch.empty(S, R, device="cuda", dtype=torch.bfloat16)

    def dense():
        for e, a, n in chunks:
            if n:
                torch.mm(xs[a:a + n], wd[e].t(), out=yd[a:a + n])
    row["cublas_ms"] = time_graph(dense)["ms"]
    dense_flop = 2.0 * S * R * C
    for k, _, _ in kernels(fmt) + [("cublas", None, None)]:
        row[f"{k}_tflops_dense_equiv"] = dense_flop / (row[f"{k}_ms"] * 1e-3) / 1e12
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--kernels", default=None, help="comma-separated kernel names (default: all)")
    ap.add_argument("--fmt", default=None, help="one format (default: 2:4 and samoyeds-1:2:128)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time the kernels in turns, this many rounds, and keep each one's median")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    global SELECTED, REPEAT
    if a.repeat < 1:
        ap.error("--repeat: at least 1")
    REPEAT = a.repeat
    if a.kernels:
        SELECTED = a.kernels.split(",")
        unknown = set(SELECTED) - {k[0] for k in KERNELS}
        if unknown:
            ap.error(f"--kernels: unknown {sorted(unknown)}; known: {[k[0] for k in KERNELS]}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    S = a.S
    cases = [("mixtral gate_up 1-expert", 1, 28672, 4096, "swiglu", False),
             ("mixtral down 1-expert", 1, 4096, 14336, "none", False),
             ("mixtral gate_up routed", 8, 28672, 4096, "swiglu", True),
             ("mixtral down routed", 8, 4096, 14336, "none", True),
             ("qwen3 gate_up routed", 128, 1536, 2048, "swiglu", True),
             ("qwen3 down routed", 128, 2048, 768, "none", True)]
    wanted = a.cases.split(",") if a.cases else None
    unknown = set(wanted or ()) - {c[0] for c in cases}
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)}; known: {[c[0] for c in cases]}")
    for fmt in [a.fmt] if a.fmt else ["2:4", "samoyeds-1:2:128"]:
        for name, E, R, C, act, routed in cases:
            if wanted and name not in wanted:
                continue
            row = run_case(name, E, R, C, S, fmt, act, gen, routed=routed, top_k=8 if E == 128 else 2)
            rows.append(row)
            names = [k[0] for k in kernels(fmt)]
            base = "wgmma_ws" if "wgmma_ws" in names else names[0]
            print(f"{fmt:17} {name:26} cublas {row['cublas_ms']:.3f} ms  " + "  ".join(
                f"{k} {row[k + '_ms']:.3f} ms ({row[base + '_ms'] / row[k + '_ms']:.2f}x of {base}, "
                f"{row['cublas_ms'] / row[k + '_ms']:.2f}x cublas, err {row[k + '_err']:.1e})" for k in names), flush=True)
    if a.out:
        write_json(os.path.join(a.out, "ssmm_kernels.json"), {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
