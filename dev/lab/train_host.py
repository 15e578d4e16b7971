"""Host time of a training step of the MoE layer: samoyeds' forward + backward (bench_train.py's
fwd_bwd, the same inputs) issued N times without a sync (the host's issue time per step, as long
as the launch queue does not fill), the same with a sync at the end (the step's wall time), and
cProfile's top entries by own time over those steps.

    python dev/lab/train_host.py [--model qwen3-30b-a3b] [--tokens 4096] [--steps 20]
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_trace import samoyeds_step  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    name, T, n = args.model, args.tokens, args.steps
    step = samoyeds_step(name, T)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"{name} T={T}: host issue {1e3 * (t1 - t0) / n:.3f} ms/step, wall {1e3 * (t2 - t0) / n:.3f} ms/step")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
