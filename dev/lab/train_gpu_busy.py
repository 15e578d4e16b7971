"""Is a training step of the MoE layer bound by the GPU or by the host?  For each model and T,
samoyeds' and grouped_mm's forward + backward (bench_train.py's fwd_bwd, the same inputs) run
under torch.profiler: per step the wall time (CUDA events, back to back, not from an idle GPU),
the GPU's kernel time (the sum of kernel durations, with overlaps counted once), the number of
kernels, and the idle share of the GPU.

    python dev/lab/train_gpu_busy.py [--models qwen3-30b-a3b,mixtral-8x7b] [--tokens 4096] [--out DIR]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_moe  # noqa: E402
import bench_train as bt  # noqa: E402
import common  # noqa: E402


def busy_ms(events) -> float:
    """Union of the kernels' [start, end) intervals, ms."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, cur_s, cur_e = 0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    rows = []
    for name in args.models.split(","):
        H, I, E, K = bt.dims(bench_moe._block(name, False)[1])
        gen = torch.Generator(device="cuda").manual_seed(0)
        act = "gptoss" if name.startswith("gpt-oss") else "swiglu"
        methods = {"samoyeds": bt.SamoyedsExperts(E, H, I, "samoyeds-1:2:128", act, act == "gptoss", "cuda",
                                                   torch.bfloat16, gen),
                   "grouped_mm": bt.GroupedMMExperts(name, "cuda", torch.bfloat16, False, 0)}
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
            idx, w = bt.routing(T, E, K, "cuda", torch.bfloat16, gen)
            w.requires_grad_(True)
            gout = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            for key, m in methods.items():
                for _ in range(3):
                    bt.fwd_bwd(m, x, idx, w, gout)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    a.record()
                    for _ in range(args.steps):
                        bt.fwd_bwd(m, x, idx, w, gout)
                    b.record()
                    torch.cuda.synchronize()
                wall = a.elapsed_time(b) / args.steps
                kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
                busy = busy_ms(kernels) / args.steps
                row = {"model": name, "T": T, "method": key, "ms_step": wall, "ms_gpu_busy": busy,
                       "kernels_per_step": len(kernels) / args.steps, "gpu_idle_share": 1 - busy / wall}
                rows.append(row)
                print(f"{name:16s} T={T:6d} {key:11s} step {wall:7.3f} ms  GPU busy {busy:7.3f} ms  "
                      f"idle {row['gpu_idle_share']:5.1%}  kernels/step {row['kernels_per_step']:.0f}", flush=True)
        methods.clear()
        common.free_memory("cuda")
    if args.out:
        common.write_json(str(Path(common.gpu_dir(args.out)) / "train_gpu_busy.json"),
                          {"env": common.environment(), "rows": rows})


if __name__ == "__main__":
    main()
