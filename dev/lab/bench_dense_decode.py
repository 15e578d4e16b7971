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

    python dev/lab/bench_dense_decode.py [--out DIR] [--tokens 1,4,8,16,32,64]
                                            [--tiny --device cpu]   (a CPU smoke run: the C reference)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from common import (add_run_args, copy_rate_tb_s, default_dtype, environment, result_path, setup_run,  # noqa: E402
                    time_graph, time_ms, write_json)

SHAPES = [  # name, hidden H, shared MLP width I (shared experts x their width)
    ("deepseek-v2-lite", 2048, 2 * 1408),
    ("deepseek-v3", 7168, 2048),
    ("qwen1.5-moe-a2.7b", 2048, 5632),
    ("llama4-scout", 5120, 8192),
]
TINY = [("tiny", 64, 48)]
ROTATE_BYTES = 256 * 2**20  # weight copies rotated per replay: several times the L2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=None, help="token counts (default 1,4,8,16,32,64; --tiny 1,5)")
    add_run_args(ap, "toy shapes: a CPU check of the script (the C reference against torch)")
    args = ap.parse_args()
    setup_run(args)
    dev, dtype = args.device, default_dtype(args.device)
    torch.manual_seed(args.seed)
    tokens = [int(t) for t in (args.tokens or ("1,5" if args.tiny else "1,4,8,16,32,64")).split(",")]
    copy = copy_rate_tb_s() if dev == "cuda" else None
    rows = []
    for name, H, I in TINY if args.tiny else SHAPES:
        nbytes = 3 * I * H * torch.finfo(dtype).bits // 8
        n = max(2, ROTATE_BYTES // nbytes) if dev == "cuda" else 1
        ws = [[(torch.randn(r, c, device=dev) / c ** 0.5).to(dtype) for r, c in ((I, H), (I, H), (H, I))]
              for _ in range(n)]
        for T in tokens:
            x = torch.randn(T, H, device=dev).to(dtype)

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
            if dev == "cuda":
                t_hf, t_ours = (time_graph(fn, inner=n)["ms"] for fn in (hf, ours))
            else:
                t_hf, t_ours = (time_ms(fn, dev, budget_s=0.05)["ms"] for fn in (hf, ours))
            tb_s = nbytes / (t_ours * 1e-3) / 1e12
            row = {"shape": name, "H": H, "I": I, "T": T, "weight_bytes": nbytes, "copies": n,
                   "ms": {"transformers": t_hf, "dense_decode": t_ours},
                   "speedup": t_hf / t_ours,
                   "dense_decode_tb_s": tb_s,
                   "frac_of_copy": tb_s / copy if copy else None,
                   "transformers_frac_of_copy": nbytes / (t_hf * 1e-3) / 1e12 / copy if copy else None,
                   "rel_err_vs_fp64": err}
            rows.append(row)
            frac = f"{row['frac_of_copy']:.0%} of copy" if copy else "(CPU: the C reference)"
            print(f"{name:18s} T={T:3d}  transformers {t_hf * 1e3:7.1f} us  dense_decode {t_ours * 1e3:7.1f} us  "
                  f"{row['speedup']:.2f}x  {frac}  err {err:.1e}", flush=True)
        del ws
        if dev == "cuda":
            torch.cuda.empty_cache()
    payload = environment()
    payload.update(copy_tb_s=copy, rows=rows)
    path = result_path(args, "dense_decode.json")
    if path:
        write_json(path, payload)


if __name__ == "__main__":
    main()
