"""A shared MLP's gate and up projections at prefill sizes: two cuBLAS matmuls against one on
the concatenated weight (also with the operands swapped, x^T as the right-hand side), the down
matmul and the whole transformers MLP, CUDA-graph replays (torch only, no samoyeds kernel).

    python dev/lab/probe_gate_up_concat.py   (writes $OUT/probe_gate_up_concat.json)
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
from common import time_graph  # noqa: E402

SHAPES = [("deepseek-v2-lite", 2048, 2816), ("qwen1.5-moe-a2.7b", 2048, 5632), ("deepseek-v3", 7168, 2048)]


def main():
    rows = []
    dt = torch.bfloat16
    for name, H, I in SHAPES:
        g, u, d = ((torch.randn(r, c, device="cuda") / c ** 0.5).to(dt) for r, c in ((I, H), (I, H), (H, I)))
        gu = torch.cat([g, u])
        for T in (4096, 16384):
            x = torch.randn(T, H, device="cuda", dtype=dt)
            a = F.linear(x, gu)
            fns = {
                "two_mm": lambda: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d),
                "gate_mm": lambda: F.linear(x, g),
                "cat_mm": lambda: F.linear(x, gu),
                "gate_mm_t": lambda: torch.mm(g, x.t()),
                "cat_mm_t": lambda: torch.mm(gu, x.t()),
                "cat_matmul_out": lambda: torch.matmul(x, gu.t()),
                "silu_mul_torch": lambda: F.silu(a[:, :I]) * a[:, I:],
                "down_mm": lambda: F.linear(torch.empty(T, I, device="cuda", dtype=dt), d),
            }
            res = {k: time_graph(f)["ms"] * 1e3 for k, f in fns.items()}
            rows.append({"model": name, "H": H, "I": I, "T": T, "us": res})
            print(name, T, {k: round(v, 1) for k, v in res.items()}, flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "probe_gate_up_concat.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "command": "python3 dev/lab/probe_gate_up_concat.py", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
