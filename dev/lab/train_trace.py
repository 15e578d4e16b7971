"""Where a training step of the MoE layer spends the GPU's time and where the GPU waits: one
model's samoyeds forward + backward (bench_train.py's fwd_bwd, the same inputs) under
torch.profiler with CPU and CUDA activity.  Prints per kernel (name, calls and ms per step),
the idle gaps between kernels longer than --gap us with the kernels on either side, and the
CUDA runtime calls that block the host (synchronize, memcpy, malloc/free).

    python dev/lab/train_trace.py [--model qwen3-30b-a3b] [--tokens 4096] [--out DIR]
"""
import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_moe  # noqa: E402
import bench_train as bt  # noqa: E402
import common  # noqa: E402


def samoyeds_step(name: str, T: int):
    """One training step of samoyeds' layer for model ``name`` at T tokens (bench_train.py's
    fwd_bwd on its inputs, bf16, samoyeds-1:2:128; GPT-OSS with its activation and biases),
    as a function of no arguments."""
    H, I, E, K = bt.dims(bench_moe._block(name, False)[1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    act = "gptoss" if name.startswith("gpt-oss") else "swiglu"
    m = bt.SamoyedsExperts(E, H, I, "samoyeds-1:2:128", act, act == "gptoss", "cuda", torch.bfloat16, gen)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    idx, w = bt.routing(T, E, K, "cuda", torch.bfloat16, gen)
    w.requires_grad_(True)
    gout = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    return lambda: bt.fwd_bwd(m, x, idx, w, gout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gap", type=float, default=4.0, help="us")
    ap.add_argument("--out")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    name, T = args.model, args.tokens
    step = samoyeds_step(name, T)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    ev = prof.events()
    kern = sorted((e for e in ev if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in kern:
        per[e.name][0] += 1
        per[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
    n = args.steps
    rows = sorted(({"kernel": k, "calls": c / n, "ms": t / n} for k, (c, t) in per.items()), key=lambda r: -r["ms"])
    print(f"{name} T={T}: {len(kern) / n:.0f} kernels per step, busy {sum(r['ms'] for r in rows):.3f} ms")
    for r in rows:
        print(f"  {r['ms']:7.3f} ms  x{r['calls']:4.1f}  {r['kernel'][:110]}")
    gaps = collections.defaultdict(lambda: [0, 0.0])
    for a, b in zip(kern, kern[1:]):
        g = b.time_range.start - a.time_range.end
        if g > args.gap:
            key = (a.name[:60], b.name[:60])
            gaps[key][0] += 1
            gaps[key][1] += g / 1e3
    print(f"gaps > {args.gap} us (ms per step, after -> before):")
    for (a, b), (c, t) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"  {t / n:7.3f} ms  x{c / n:4.1f}  {a}  ->  {b}")
    api = collections.defaultdict(lambda: [0, 0.0])
    for e in ev:
        if e.device_type.name == "CPU" and e.name.startswith("cuda") and any(
                s in e.name for s in ("Synchronize", "Memcpy", "Malloc", "Free", "FuncSetAttribute", "EventSync")):
            api[e.name][0] += 1
            api[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
    print("runtime calls (per step):")
    for k, (c, t) in sorted(api.items(), key=lambda kv: -kv[1][1]):
        print(f"  {t / n:7.3f} ms  x{c / n:5.1f}  {k}")
    if args.out:
        common.write_json(str(Path(common.gpu_dir(args.out)) / f"train_trace_{name}_{T}.json"),
                          {"env": common.environment(), "kernels": rows,
                           "gaps": [{"after": a, "before": b, "per_step": c / n, "ms": t / n}
                                    for (a, b), (c, t) in gaps.items()],
                           "runtime": [{"call": k, "per_step": c / n, "ms": t / n} for k, (c, t) in api.items()]})


if __name__ == "__main__":
    main()
