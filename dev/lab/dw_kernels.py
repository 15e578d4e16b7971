"""GPU time of ssmm_dw's kernels alone (torch.profiler: the dW kernel and dy's transposed copy,
summed over N calls, per call), on the models' projections with bench_train's inputs
(bench_train.dw_problems); rows for dev/lab/ab_summary.py (before / after a kernel change in
one call).  Host time, allocation
and launch latency are left out, which bench_train's per-call timing counts.

    python dev/lab/dw_kernels.py [--models a,b] [--tokens 4096,16384] [--calls 10] --out DIR
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import bench_train  # noqa: E402
from common import environment, write_json  # noqa: E402

import samoyeds as sm  # noqa: E402


def kernel_ms(fn, calls):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {"dw": 0.0, "dyt": 0.0}
    for ev in prof.key_averages():
        t = ev.device_time_total / 1e3 / calls  # (us -> ms) per call
        if "ssmm_dw" in ev.key:
            out["dw"] += t
        elif "dyt_fill" in ev.key:
            out["dyt"] += t
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b,olmoe")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    density = sm.SparseFormat.parse(a.format).density
    for name in a.models.split(","):
        for pb in bench_train.dw_problems(name, [int(t) for t in a.tokens.split(",")], a.format, "cuda",
                                          torch.bfloat16, False, a.seed):
            out = torch.empty_like(pb["w"].values)
            k = kernel_ms(lambda: bench_train.run_dw(pb, out, "copy"), a.calls)
            rows.append({"model": name, "T": pb["T"], "proj": pb["proj"], "kernel_dw_ms": k["dw"],
                         "dyt_fill_ms": k["dyt"], "flop_kept": 2.0 * pb["S"] * pb["R"] * pb["C"] * density})
            print(f"{name:<16} T={pb['T']:>6} {pb['proj']:<8} dW kernel {k['dw']:7.3f} ms  "
                  f"dyt_fill {k['dyt']:7.3f} ms", flush=True)
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "dw_kernels.json"), {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
