"""moe_forward with gate_up's token rows by index against a copy in expert order
(samoyeds.config(x_copy="never" | "always")), the five model shapes, same inputs, the two
timed in turns (CUDA-graph replays, medians); the data behind SAM_MOE_COPY_X_MIN_I.

  python dev/lab/x_copy.py [--tokens 4096,16384] [--rounds 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import samoyeds as sm  # noqa: E402
from common import environment, time_graph  # noqa: E402
from samoyeds.moe import moe_forward  # noqa: E402

# (E, K, H, I)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "gpt-oss-20b": (32, 4, 2880, 2880),
          "qwen3-30b-a3b": (128, 8, 2048, 768), "olmoe": (64, 8, 2048, 1024),
          "deepseek-v2-lite": (64, 6, 2048, 1408)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.models.split(","):
        E, K, H, I = SHAPES[name]
        gu = sm.pack(torch.randn(E, 2 * I, H, device="cuda", generator=gen).bfloat16() * H ** -0.5,
                     "samoyeds-1:2:128", glu=True)
        dn = sm.pack(torch.randn(E, H, I, device="cuda", generator=gen).bfloat16() * I ** -0.5, "samoyeds-1:2:128")
        for T in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
            w, idx = torch.softmax(torch.randn(T, E, device="cuda", generator=gen), -1).topk(K, dim=-1)
            out = torch.empty_like(x)
            t = {"never": [], "always": [], "auto": []}
            for _ in range(args.rounds):
                for mode in t:
                    with sm.config(x_copy=mode):
                        t[mode].append(time_graph(lambda: moe_forward(x, idx, w, gu, dn, out=out),
                                                  budget_s=0.3)["ms"])
            with sm.config(x_copy="never"):
                a = moe_forward(x, idx, w, gu, dn)
            with sm.config(x_copy="always"):
                b = moe_forward(x, idx, w, gu, dn)
            ms = {m: statistics.median(v) for m, v in t.items()}
            row = {"model": name, "T": T, "E": E, "K": K, "H": H, "I": I, "ms": ms, "all_ms": t,
                   "copy_speedup": ms["never"] / ms["always"], "bit_identical": bool(torch.equal(a, b))}
            rows.append(row)
            print(f"{name:<18} T={T:>6}  index {ms['never']:.3f}  copy {ms['always']:.3f}  auto {ms['auto']:.3f} ms"
                  f"  copy/index speedup {row['copy_speedup']:.3f}x  identical={row['bit_identical']}", flush=True)
            del x, out
        del gu, dn
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "x_copy.json"), "w") as fh:
            json.dump({"env": environment(), "command": " ".join(sys.argv), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
