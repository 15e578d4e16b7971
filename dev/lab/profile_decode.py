"""Where a decode step's host time goes: cProfile of greedy generate on a
few-layer model of a real config, per experts implementation (GPU).
  python dev/lab/profile_decode.py [--model olmoe-1b-7b] [--layers 4] [--new-tokens 16] [--batch 1] [--e2e]"""
import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import lm  # noqa: E402
import samoyeds as sm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="olmoe-1b-7b")
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--new-tokens", type=int, default=16)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--e2e", action="store_true",
                help="as bench_e2e.py: attention mask and pad token, samoyeds measured first")
a = ap.parse_args()
model = lm.build(a.model, "cuda", torch.bfloat16, layers=a.layers, seed=0)
model._optimize_model_for_decode = contextlib.nullcontext
ids = torch.randint(3, model.config.vocab_size, (a.batch, 128), device="cuda")
extra = {"attention_mask": torch.ones_like(ids), "pad_token_id": 0} if a.e2e else {}


def gen(n):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)


for impl in (("samoyeds", "grouped_mm") if a.e2e else ("grouped_mm", "samoyeds")):
    if impl == "samoyeds":
        lm.set_experts(model, "grouped_mm")
        sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    elif a.e2e:
        sm.unpatch_model(model)
        lm.set_experts(model, impl)
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
    print(f"==== {impl}: generate {a.new_tokens} tokens {wall * 1e3:.1f} ms ({a.layers} layers, batch {a.batch})")
    print("\n".join(s.getvalue().splitlines()[:40]))
