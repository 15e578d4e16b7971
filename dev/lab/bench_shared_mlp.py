"""Unpruned shared experts at prefill sizes: the path a patched block runs above the dense
decode limit (cuBLAS's three matmuls with SiLU and the product in one samoyeds.glu pass)
against the transformers MLP (the same matmuls, then torch's silu and product: two passes)
on the same weights and tokens; and the activation alone (glu against silu * up) with its
bytes against a device copy measured in the same run.

CUDA-graph replays timed with CUDA events (common.time_graph).

    python dev/lab/bench_shared_mlp.py [--out DIR] [--tokens 256,4096,16384]
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
from samoyeds import torch_ops  # noqa: E402
from common import (add_run_args, copy_rate_tb_s, default_dtype, environment, result_path, setup_run,  # noqa: E402
                    time_graph, time_ms, write_json)

SHAPES = [  # name, hidden H, shared MLP width I
    ("deepseek-v2-lite", 2048, 2 * 1408),
    ("deepseek-v3", 7168, 2048),
    ("qwen1.5-moe-a2.7b", 2048, 5632),
]
TINY = [("tiny", 64, 48)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=None, help="token counts (default 256,4096,16384; --tiny 40)")
    add_run_args(ap, "toy shapes: a CPU check of the script (the C reference against torch)")
    args = ap.parse_args()
    setup_run(args)
    dev, dtype = args.device, default_dtype(args.device)
    torch.manual_seed(args.seed)
    tokens = [int(t) for t in (args.tokens or ("40" if args.tiny else "256,4096,16384")).split(",")]
    copy = copy_rate_tb_s() if dev == "cuda" else None
    rows = []
    for name, H, I in TINY if args.tiny else SHAPES:
        g, u, d = ((torch.randn(r, c, device=dev) / c ** 0.5).to(dtype) for r, c in ((I, H), (I, H), (H, I)))
        for T in tokens:
            x = torch.randn(T, H, device=dev).to(dtype)
            a, b = F.linear(x, g), F.linear(x, u)
            fns = {
                "transformers": lambda: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d),
                "samoyeds": lambda: torch_ops.shared_mlp_eager(x, g, u, d, decode_rows=16),
                "act_torch": lambda: F.silu(a) * b,
                "act_glu": lambda: sm.glu(a, b),
            }
            want = F.linear(F.silu(F.linear(x.double(), g.double())) * F.linear(x.double(), u.double()), d.double())
            errs = {k: ((fns[k]().double() - want).norm() / want.norm()).item() for k in ("transformers", "samoyeds")}
            if dev == "cuda":
                ms = {k: time_graph(f)["ms"] for k, f in fns.items()}
            else:
                ms = {k: time_ms(f, dev, budget_s=0.05)["ms"] for k, f in fns.items()}
            act_bytes = 3 * T * I * torch.finfo(dtype).bits // 8
            tb_s = act_bytes / (ms["act_glu"] * 1e-3) / 1e12
            row = {"shape": name, "H": H, "I": I, "T": T, "ms": ms,
                   "speedup": ms["transformers"] / ms["samoyeds"], "act_speedup": ms["act_torch"] / ms["act_glu"],
                   "glu_tb_s": tb_s, "glu_frac_of_copy": tb_s / copy if copy else None,
                   "rel_err_vs_fp64": errs}
            rows.append(row)
            frac = f"glu at {row['glu_frac_of_copy']:.0%} of copy" if copy else "(CPU: the C reference)"
            print(f"{name:18s} T={T:5d}  transformers {ms['transformers'] * 1e3:8.1f} us  samoyeds "
                  f"{ms['samoyeds'] * 1e3:8.1f} us  {row['speedup']:.2f}x   act {ms['act_torch'] * 1e3:6.1f} -> "
                  f"{ms['act_glu'] * 1e3:6.1f} us  {frac}  err {errs['samoyeds']:.1e} (torch {errs['transformers']:.1e})",
                  flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    payload = environment()
    payload.update(copy_tb_s=copy, rows=rows)
    path = result_path(args, "shared_mlp.json")
    if path:
        write_json(path, payload)


if __name__ == "__main__":
    main()
