"""Where does ssmm's time go?  Times one-expert ssmm over shapes, epilogues,
row pitches and token orders (graph replay, CUDA events).
  python dev/lab/ssmm_sweep.py [--fmt samoyeds-1:2:128] [--S 8192]"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from common import time_graph  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--fmt", default="samoyeds-1:2:128")
ap.add_argument("--S", type=int, default=8192)
a = ap.parse_args()
gen = torch.Generator(device="cuda").manual_seed(0)
rows = []
for R, C, act, order, pad in [(28672, 4096, "none", "id", 0), (28672, 4096, "swiglu", "id", 0),
                              (28672, 4096, "none", "rand", 0), (28672, 4096, "none", "id", 64),
                              (28672, 4160, "none", "id", 0), (4096, 14336, "none", "id", 0),
                              (4096, 14336, "none", "rand", 0), (14336, 8192, "none", "id", 0),
                              (28672, 1024, "none", "id", 0), (2048, 28672, "none", "id", 0)]:
    S = a.S
    xw = torch.randn(S, C + pad, generator=gen, device="cuda", dtype=torch.bfloat16)
    x = xw[:, :C]
    w = torch.randn(1, R, C, generator=gen, device="cuda", dtype=torch.bfloat16)
    p = sm.pack(w, a.fmt, glu=act != "none")
    del w
    offs = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    tok = (torch.randperm(S, generator=gen, device="cuda") if order == "rand" else torch.arange(S, device="cuda")).to(torch.int32)
    out = torch.empty(S, R if act == "none" else R // 2, device="cuda", dtype=torch.bfloat16)
    t = time_graph(lambda: sm.ssmm(x, p, offs, tok, out=out, act=act))["ms"]
    rp = p.values.shape[1]
    ctas = -(-rp // 128) * -(-S // 128)
    kt = p.values.shape[2] * 2 // 64
    exec_tf = 2 * S * rp * p.values.shape[2] * 2 / (t * 1e-3) / 1e12
    rows.append((R, C, act, order, pad, t, ctas, kt, exec_tf))
    print(f"R={R:6} C={C:6} act={act:7} order={order:4} pad={pad:3}: {t:7.3f} ms  CTAs={ctas:6} k-tiles={kt:4} "
          f"us/CTA-wave={t * 1e3 / (ctas / 132):8.1f}  executed {exec_tf:6.0f} TFLOP/s", flush=True)
    del p, x, xw, out
    torch.cuda.empty_cache()
