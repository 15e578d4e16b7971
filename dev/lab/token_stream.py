"""What the token stream costs the warp-specialised wgmma.sp kernel: the same tokens and
the same packed weights, read three ways by one projection over all experts --

  gather   x read by index (token_ids), 16-byte cp.async copies: what gate_up does
  tma      the same rows already in expert order (x[token_ids], token_ids None): one
           TMA box per k-tile, what the down projection does with its intermediate rows
  cublas   torch.mm per expert on the rows in expert order (same masked weights)

Each by CUDA-graph replay (median).  The copy that "tma" assumes is not timed: it is
the gathered activation copy the Samoyeds format avoids, so this measures what reading
the routed tokens by index costs the kernel, not an option of the library.

  python dev/lab/token_stream.py [--out DIR]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from common import environment, time_graph, write_json  # noqa: E402

CASES = [  # name, E, R (gate_up: 2 I), C, top_k
    ("mixtral-8x7b gate_up", 8, 28672, 4096, 2),
    ("gpt-oss-20b gate_up", 32, 5760, 2880, 4),
    ("qwen3-30b-a3b gate_up", 128, 1536, 2048, 8),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=8192, help="routed rows (tokens x top_k)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for fmt in ("2:4", "samoyeds-1:2:128"):
        for name, E, R, C, K in CASES:
            w = torch.randn(E, R, C, generator=gen, device="cuda", dtype=torch.bfloat16) * C ** -0.5
            p = sm.pack(w, fmt, glu=True)
            wd = sm.unpack(p)
            del w
            T = a.S // K
            r = sm.route(torch.rand(T, E, generator=gen, device="cuda").topk(K, -1).indices, E)
            x = torch.randn(T, C, generator=gen, device="cuda", dtype=torch.bfloat16)
            xs = x[r.token_ids.long()].contiguous()
            out = {k: torch.full((a.S, R // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
                   for k in ("gather", "tma")}
            def tma():
                with sm.config(token_rows="tma"):
                    sm.ssmm(xs, p, r.offsets, None, out=out["tma"], act="swiglu", impl="wgmma_sp")
            fns = {"gather": lambda: sm.ssmm(x, p, r.offsets, r.token_ids, out=out["gather"], act="swiglu",
                                             impl="wgmma_sp"),
                   "tma": tma}
            for f in fns.values():
                f()
            torch.cuda.synchronize()
            same = bool(torch.equal(out["gather"], out["tma"]))
            row = {"case": name, "fmt": fmt, "E": E, "R": R, "C": C, "S": a.S, "outputs_identical": same}
            for k, f in fns.items():
                row[f"{k}_ms"] = time_graph(f)["ms"]
            counts = (r.offsets[1:] - r.offsets[:-1]).tolist()
            starts = r.offsets[:-1].tolist()
            yd = torch.empty(a.S, R, device="cuda", dtype=torch.bfloat16)

            def dense():
                for e in range(E):
                    if counts[e]:
                        torch.mm(xs[starts[e]:starts[e] + counts[e]], wd[e].t(), out=yd[starts[e]:starts[e] + counts[e]])
            row["cublas_ms"] = time_graph(dense)["ms"]
            row["tma_over_gather"] = row["gather_ms"] / row["tma_ms"]
            rows.append(row)
            print(f"{fmt:17} {name:24} gather {row['gather_ms']:.3f} ms  tma {row['tma_ms']:.3f} ms "
                  f"({row['tma_over_gather']:.2f}x)  cublas {row['cublas_ms']:.3f} ms  "
                  f"gather/cublas {row['cublas_ms'] / row['gather_ms']:.2f}x  tma/cublas {row['cublas_ms'] / row['tma_ms']:.2f}x"
                  f"  identical {same}", flush=True)
            del p, wd, x, xs, out, yd
            torch.cuda.empty_cache()
    if a.out:
        write_json(os.path.join(a.out, "token_stream.json"), {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
