"""Where the gathered token rows of a gate_up projection come from, and what that costs the
warp-specialised wgmma.sp kernel: the same packed weights, the same expert offsets and the same
number of gathered rows per expert, timed with the rows read

  routed      by the routing's token ids from x of T rows (T x C x 2 bytes: larger than L2 at T = 16384)
  l2          by the same ids modulo T_L2 from x of T_L2 rows (a few MB: resident in L2 after the first pass)
  contiguous  by ids 0 .. S-1 from x of S rows (each row read by its own token tile only)
  tma         without ids (token_ids None) from the same S rows: one TMA box per k-tile

and the routed case under each work order (SAMOYEDS_SSMM_GM row tiles per rasterisation group).
Outputs of `routed` under every order are compared bit for bit.

  python dev/lab/gather_locality.py [--model mixtral-8x7b] [--T 16384] [--t-l2 2048] [--gm 1,4,16,64] [--out DIR]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from common import SHAPES, environment, time_graph, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--t-l2", type=int, default=2048, help="rows of the L2-resident x")
    ap.add_argument("--gm", default="1,4,16,64", help="work orders to time the routed case under")
    ap.add_argument("--fmt", default="samoyeds-1:2:128")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    s = SHAPES[a.model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    E, K, R, C, T = s.experts, s.top_k, 2 * s.inter, s.hidden, a.T
    w = torch.randn(E, R, C, generator=gen, device="cuda", dtype=torch.bfloat16) * C ** -0.5
    p = sm.pack(w, a.fmt, glu=True)
    del w
    idx = torch.rand(T, E, generator=gen, device="cuda").topk(K, -1).indices
    r = sm.route(idx, E)
    S = T * K
    offs, ids = r.offsets, r.token_ids
    x = torch.randn(T, C, generator=gen, device="cuda", dtype=torch.bfloat16)
    xl2 = x[:a.t_l2].contiguous()
    xs = torch.randn(S, C, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(S, R // 2, device="cuda", dtype=torch.bfloat16)
    ways = {"routed": (x, ids), "l2": (xl2, ids % a.t_l2),
            "contiguous": (xs, torch.arange(S, device="cuda", dtype=torch.int32)), "tma": (xs, None)}
    rows = {}
    dense_flop = 2.0 * S * R * C

    def timed(name, xx, tt):
        fn = lambda: sm.ssmm(xx, p, offs, tt, out=out, act="swiglu", impl="wgmma_sp")  # noqa: E731
        ms = time_graph(fn)["ms"]
        rows[name] = {"ms": ms, "tflops_dense_equiv": dense_flop / ms / 1e9}
        print(f"{a.model} gate_up T={T} {name:14} {ms:.3f} ms", flush=True)

    for name, (xx, tt) in ways.items():
        timed(name, xx, tt)
    ref = None
    for gm in [int(v) for v in a.gm.split(",") if v]:
        os.environ["SAMOYEDS_SSMM_GM"] = str(gm)
        timed(f"routed_gm{gm}", x, ids)
        sm.ssmm(x, p, offs, ids, out=out, act="swiglu", impl="wgmma_sp")
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
        rows[f"routed_gm{gm}"]["same_as_first"] = bool(torch.equal(out, ref))
    os.environ.pop("SAMOYEDS_SSMM_GM", None)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        write_json(os.path.join(a.out, "gather_locality.json"),
                   {"environment": environment(), "model": a.model, "T": T, "t_l2": a.t_l2, "fmt": a.fmt, "rows": rows})


if __name__ == "__main__":
    main()
