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
the cp.async gather instead (SAMOYEDS_WGMMA_TOKENS_TMA=0).

  python benchmarks/ssmm_kernels.py [--S 8192] [--out DIR]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from common import environment, time_graph, write_json  # noqa: E402

KERNELS = [("mma_sp", "mma_sp", None), ("wgmma", "wgmma_sp", "1"), ("wgmma_ws_1tile", "wgmma_sp", "3"),
           ("wgmma_ws", "wgmma_sp", "2"), ("wgmma_ws_pingpong", "wgmma_sp", "4"),
           ("wgmma_ws_cluster", "wgmma_sp", "5"), ("wgmma_ws_dynamic", "wgmma_sp", "6"),
           ("wgmma_ws_gather", "wgmma_sp", "2")]


def kernels(fmt):
    """The kernels that run `fmt` (ping-pong consumers: 2:4 only)."""
    return [k for k in KERNELS if fmt == "2:4" or k[0] != "wgmma_ws_pingpong"]


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
    for kname, impl, env in kernels(fmt):
        if env is not None:
            os.environ["SAMOYEDS_WGMMA_KERNEL"] = env
        os.environ["SAMOYEDS_WGMMA_TOKENS_TMA"] = "0" if kname == "wgmma_ws_gather" else "1"
        out = torch.full((S, cols), float("nan"), device="cuda", dtype=torch.bfloat16)
        sm.ssmm(x, p, offs, tok, out=out, act=act, impl=impl)
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float().clone()
            row[f"{kname}_err"] = 0.0
        else:
            row[f"{kname}_err"] = float((out.float() - ref).norm() / ref.norm())
        row[f"{kname}_ms"] = time_graph(lambda: sm.ssmm(x, p, offs, tok, out=out, act=act, impl=impl))["ms"]
    os.environ.pop("SAMOYEDS_WGMMA_KERNEL", None)
    os.environ.pop("SAMOYEDS_WGMMA_TOKENS_TMA", None)
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
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    S = a.S
    cases = [("mixtral gate_up 1-expert", 1, 28672, 4096, "swiglu", False),
             ("mixtral down 1-expert", 1, 4096, 14336, "none", False),
             ("mixtral gate_up routed", 8, 28672, 4096, "swiglu", True),
             ("qwen3 gate_up routed", 128, 1536, 2048, "swiglu", True),
             ("qwen3 down routed", 128, 2048, 768, "none", True)]
    for fmt in ("2:4", "samoyeds-1:2:128"):
        for name, E, R, C, act, routed in cases:
            row = run_case(name, E, R, C, S, fmt, act, gen, routed=routed, top_k=8 if E == 128 else 2)
            rows.append(row)
            print(f"{fmt:17} {name:26} " + "  ".join(
                f"{k} {row[k + '_ms']:.3f} ms" for k in ("mma_sp", "wgmma", "wgmma_ws_1tile", "wgmma_ws", "cublas"))
                + f"  ws/cublas {row['cublas_ms'] / row['wgmma_ws_ms']:.2f}x  ws/wgmma {row['wgmma_ms'] / row['wgmma_ws_ms']:.2f}x"
                + f"  persistent/1tile {row['wgmma_ws_1tile_ms'] / row['wgmma_ws_ms']:.2f}x"
                + (f"  pingpong {row['wgmma_ws_pingpong_ms']:.3f} ms ({row['wgmma_ws_ms'] / row['wgmma_ws_pingpong_ms']:.2f}x,"
                   f" err {row['wgmma_ws_pingpong_err']:.1e})" if "wgmma_ws_pingpong_ms" in row else "")
                + f"  cluster {row['wgmma_ws_cluster_ms']:.3f} ms ({row['wgmma_ws_ms'] / row['wgmma_ws_cluster_ms']:.2f}x,"
                f" err {row['wgmma_ws_cluster_err']:.1e})"
                + f"  dynamic {row['wgmma_ws_dynamic_ms']:.3f} ms ({row['wgmma_ws_ms'] / row['wgmma_ws_dynamic_ms']:.2f}x,"
                f" err {row['wgmma_ws_dynamic_err']:.1e})"
                + f"  gather {row['wgmma_ws_gather_ms']:.3f} ms (TMA rows {row['wgmma_ws_gather_ms'] / row['wgmma_ws_ms']:.2f}x)"
                + f"  err wgmma {row['wgmma_err']:.1e} ws {row['wgmma_ws_err']:.1e}", flush=True)
    if a.out:
        write_json(os.path.join(a.out, "ssmm_kernels.json"), {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
