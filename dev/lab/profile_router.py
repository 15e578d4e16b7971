"""A few samoyeds.router calls at a model's size, for a profiler (ncu) to look at.
  python dev/lab/profile_router.py [--T 16384] [--E 64] [--H 2048] [--k 6] [--logits float32]"""
import argparse

import torch

import samoyeds as sm

ap = argparse.ArgumentParser()
ap.add_argument("--T", type=int, default=16384)
ap.add_argument("--E", type=int, default=64)
ap.add_argument("--H", type=int, default=2048)
ap.add_argument("--k", type=int, default=6)
ap.add_argument("--logits", default="float32")
ap.add_argument("--reps", type=int, default=4)
a = ap.parse_args()
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(a.T, a.H, generator=gen, device="cuda").to(torch.bfloat16)
w = (torch.randn(a.E, a.H, generator=gen, device="cuda") / a.H ** 0.5).to(torch.bfloat16)
for _ in range(a.reps):
    sm.router(x, w, a.k, logits_dtype=a.logits, weights_dtype="float32")
torch.cuda.synchronize()
