"""One ssmm launch at a realistic size, for a profiler (ncu) to look at; --dw: the weight
gradient (ssmm_dw, --impl auto | mma) of the same projection instead.
  python dev/lab/profile_ssmm.py [--model mixtral-8x7b] [--T 4096] [--proj gate_up] [--fmt samoyeds-1:2:128]
                                 [--dw [--impl mma]]"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from common import SHAPES  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="mixtral-8x7b")
ap.add_argument("--T", type=int, default=4096)
ap.add_argument("--proj", default="gate_up")
ap.add_argument("--fmt", default="samoyeds-1:2:128")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--dw", action="store_true", help="time ssmm_dw (dy [S, R], x as ssmm reads it)")
ap.add_argument("--impl", default="auto", help="--dw: ssmm_dw's kernel, auto or mma")
a = ap.parse_args()
s = SHAPES[a.model]
gen = torch.Generator(device="cuda").manual_seed(0)
R, C = (2 * s.inter, s.hidden) if a.proj == "gate_up" else (s.hidden, s.inter)
idx = torch.rand(a.T, s.experts, generator=gen, device="cuda").topk(s.top_k, -1).indices
r = sm.route(idx, s.experts)
x = torch.randn(a.T if a.proj == "gate_up" else a.T * s.top_k, C, generator=gen, device="cuda", dtype=torch.bfloat16)
w = torch.randn(s.experts, R, C, generator=gen, device="cuda", dtype=torch.bfloat16)
p = sm.pack(w, a.fmt, glu=a.proj == "gate_up")
del w
act = "swiglu" if a.proj == "gate_up" else "none"
tok = r.token_ids if a.proj == "gate_up" else None
if a.dw:
    from samoyeds.ops import ssmm_dw
    dy = torch.randn(r.token_ids.shape[0], R, generator=gen, device="cuda", dtype=torch.bfloat16)

    def call():
        ssmm_dw(dy, x, p, r.offsets, tok, impl=a.impl)
else:
    def call():
        sm.ssmm(x, p, r.offsets, tok, act=act)
for _ in range(a.reps):
    call()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
call()
end.record()
end.synchronize()
print(f"{a.model} T={a.T} {a.proj} {a.fmt}{' dw ' + a.impl if a.dw else ''}: {start.elapsed_time(end):.3f} ms")
