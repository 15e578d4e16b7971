"""The warp-specialised wgmma.sp kernel's projections at one ring depth: run once per
build, each built with other stage counts (cuda/ssmm_ws.cuh, SAM_WS_STAGES_*):

  SAMOYEDS_NVCC_FLAGS="-DSAM_WS_STAGES_M1_BT=2 -DSAM_WS_STAGES_M2_BT=3" pip install --no-build-isolation -e .
  python dev/lab/ring_depth.py TAG [--out DIR]

Mixtral-8x7B, GPT-OSS-20B and Qwen3-30B-A3B gate_up (tokens gathered by index, SwiGLU)
and down (rows in expert order, by TMA), 8192 routed rows, both formats, CUDA-graph
replay (median).  Each row keeps the sum of the output, so builds can be checked for
the same result.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from common import environment, time_graph  # noqa: E402

CASES = [("mixtral-8x7b", 8, 4096, 14336, 2), ("gpt-oss-20b", 32, 2880, 2880, 4), ("qwen3-30b-a3b", 128, 2048, 768, 8)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tag")
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for fmt in ("2:4", "samoyeds-1:2:128"):
        for name, E, H, I, K in CASES:
            T = a.S // K
            r = sm.route(torch.rand(T, E, generator=gen, device="cuda").topk(K, -1).indices, E)
            for proj in ("gate_up", "down"):
                R, C = (2 * I, H) if proj == "gate_up" else (H, I)
                w = torch.randn(E, R, C, generator=gen, device="cuda", dtype=torch.bfloat16) * C ** -0.5
                p = sm.pack(w, fmt, glu=proj == "gate_up")
                del w
                x = torch.randn(T if proj == "gate_up" else a.S, C, generator=gen, device="cuda", dtype=torch.bfloat16)
                tok = r.token_ids if proj == "gate_up" else None
                act = "swiglu" if proj == "gate_up" else "none"
                o = torch.empty(a.S, R // 2 if proj == "gate_up" else R, device="cuda", dtype=torch.bfloat16)

                def f():
                    sm.ssmm(x, p, r.offsets, tok, out=o, act=act, impl="wgmma_sp")
                ms = time_graph(f, budget_s=0.4)["ms"]
                rows.append({"tag": a.tag, "fmt": fmt, "case": name, "proj": proj, "ms": ms,
                             "sum": float(o.float().sum())})
                print(f"{a.tag:8} {fmt:17} {name:14} {proj:8} {ms:.4f} ms", flush=True)
                del p, x, o
    if a.out:
        with open(os.path.join(a.out, f"ring_{a.tag}.json"), "w") as fh:
            json.dump({"environment": environment(), "nvcc_flags": os.environ.get("SAMOYEDS_NVCC_FLAGS", ""),
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
