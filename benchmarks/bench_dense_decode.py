"""Unpruned shared experts at decode sizes: samoyeds.dense_decode (gate, up and SiLU in
one launch, down in a second whose weights stream while the first ends) against the
transformers MLP (``down(silu(gate(x)) * up(x))``: three cuBLAS matmuls and two
elementwise kernels) on the same weights and tokens, and against a device copy measured
in the same run.

For every (shape, T): CUDA-graph replays timed with CUDA events (common.time_graph),
each replay running the MLP on ROTATE copies of the weights in turn, so that no copy is
still in L2 when it is read again (the weights of one MLP fit in the 50 MB L2 of an H100);
the weight bytes / time = achieved bandwidth, and its ratio to the copy rate (read +
write counted) the fraction of the memory ceiling.

    python benchmarks/bench_dense_decode.py [--out DIR] [--tokens 1,4,8,16,32,64]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from common import copy_rate_tb_s, environment, gpu_dir, time_graph, write_json  # noqa: E402

SHAPES = [  # name, hidden H, shared MLP width I (shared experts x their width)
    ("deepseek-v2-lite", 2048, 2 * 1408),
    ("deepseek-v3", 7168, 2048),
    ("qwen1.5-moe-a2.7b", 2048, 5632),
    ("llama4-scout", 5120, 8192),
]
ROTATE_BYTES = 256 * 2**20  # weight copies rotated per replay: several times the L2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="1,4,8,16,32,64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(args.seed)
    tokens = [int(t) for t in args.tokens.split(",")]
    copy = copy_rate_tb_s()
    rows = []
    for name, H, I in SHAPES:
        nbytes = 3 * I * H * 2
        n = max(2, ROTATE_BYTES // nbytes)
        ws = [[(torch.randn(r, c, device="cuda") / c ** 0.5).to(torch.bfloat16) for r, c in ((I, H), (I, H), (H, I))]
              for _ in range(n)]
        for T in tokens:
            x = torch.randn(T, H, device="cuda").to(torch.bfloat16)

            def hf(x=x, ws=ws):
                for g, u, d in ws:
                    F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)

            def ours(x=x, ws=ws):
                for g, u, d in ws:
                    sm.dense_decode(sm.dense_decode(x, g, u, act="swiglu"), d, weights_ready=True)

            g, u, d = ws[0]
            want = F.linear(F.silu(F.linear(x.double(), g.double())) * F.linear(x.double(), u.double()), d.double())
            got = sm.dense_decode(sm.dense_decode(x, g, u, act="swiglu"), d, weights_ready=True)
            err = ((got.double() - want).norm() / want.norm()).item()
            t_hf = time_graph(hf, inner=n)["ms"]
            t_ours = time_graph(ours, inner=n)["ms"]
            row = {"shape": name, "H": H, "I": I, "T": T, "weight_bytes": nbytes, "copies": n,
                   "ms": {"transformers": t_hf, "dense_decode": t_ours},
                   "speedup": t_hf / t_ours,
                   "dense_decode_tb_s": nbytes / (t_ours * 1e-3) / 1e12,
                   "frac_of_copy": nbytes / (t_ours * 1e-3) / 1e12 / copy,
                   "transformers_frac_of_copy": nbytes / (t_hf * 1e-3) / 1e12 / copy,
                   "rel_err_vs_fp64": err}
            rows.append(row)
            print(f"{name:18s} T={T:3d}  transformers {t_hf * 1e3:7.1f} us  dense_decode {t_ours * 1e3:7.1f} us  "
                  f"{row['speedup']:.2f}x  {row['frac_of_copy']:.0%} of copy  err {err:.1e}", flush=True)
        del ws
        torch.cuda.empty_cache()
    payload = environment()
    payload.update(copy_tb_s=copy, rows=rows)
    write_json(os.path.join(gpu_dir(args.out), "dense_decode.json"), payload)


if __name__ == "__main__":
    main()
