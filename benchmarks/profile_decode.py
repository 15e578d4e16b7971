"""Where a decode step's host time goes: cProfile of greedy generate on a
few-layer model of a real config, per experts implementation (GPU).
  python benchmarks/profile_decode.py [--model olmoe-1b-7b] [--layers 4] [--new-tokens 16]"""
import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm  # noqa: E402
import samoyeds as sm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="olmoe-1b-7b")
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--new-tokens", type=int, default=16)
a = ap.parse_args()
model = lm.build(a.model, "cuda", torch.bfloat16, layers=a.layers, seed=0)
model._optimize_model_for_decode = contextlib.nullcontext
ids = torch.randint(3, model.config.vocab_size, (1, 128), device="cuda")


def gen(n):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)


for impl in ("grouped_mm", "samoyeds"):
    if impl == "samoyeds":
        sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    else:
        lm.set_experts(model, impl)
    with torch.inference_mode():
        gen(a.new_tokens)
        torch.cuda.synchronize()
        t = time.perf_counter()
        gen(a.new_tokens)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        pr = cProfile.Profile()
        pr.enable()
        gen(a.new_tokens)
        torch.cuda.synchronize()
        pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"==== {impl}: generate {a.new_tokens} tokens {wall * 1e3:.1f} ms ({a.layers} layers)")
    print("\n".join(s.getvalue().splitlines()[:40]))
