"""Per-kernel device times of the input gradient (dX) of both projections of one MoE layer:
ssmm_dx's kernels (impl) against ssmm on the transposed 2:4 packing (refresh timed apart),
and ssmm_dw's copy kernel beside them (the same kind of product).  torch.profiler's CUDA
kernel times, averaged over --reps calls.  --ncu: one call of each, for ncu capture.

  python dev/lab/dx_probe.py --model mixtral-8x7b --tokens 16384 [--impls wgmma,mma]
"""
import argparse
import collections
import sys

import torch

sys.path[:0] = [".", "benchmarks"]
import samoyeds as sm  # noqa: E402
import bench_moe  # noqa: E402
from bench_train import dims, routing  # noqa: E402
from samoyeds.ops import ssmm_dw, ssmm_dx  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--impls", default="wgmma")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--no-dw", action="store_true")
    a = ap.parse_args()
    H, I, E, K = dims(bench_moe._block(a.model, False)[1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    fmt = "samoyeds-1:2:128"
    T = a.tokens
    gu = sm.pack((torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5).to(dt), fmt, glu=True)
    dn = sm.pack((torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5).to(dt), fmt)
    idx, w = routing(T, E, K, "cuda", dt, gen)
    r = sm.route(idx, E)
    S = T * K
    scale = torch.rand(S, device="cuda", generator=gen)
    dout = torch.randn(T, H, device="cuda", generator=gen).to(dt)
    dpre = torch.randn(S, 2 * I, device="cuda", generator=gen).to(dt)
    xg = torch.randn(T, H, device="cuda", generator=gen).to(dt)
    hu = torch.randn(S, I, device="cuda", generator=gen).to(dt)
    calls = {}
    for impl in a.impls.split(","):
        calls[f"dx_down_{impl}"] = lambda impl=impl: ssmm_dx(dout, dn, r.offsets, r.token_ids, scale, impl=impl)
        calls[f"dx_gate_up_{impl}"] = lambda impl=impl: ssmm_dx(dpre, gu, r.offsets, None, None, impl=impl)
    dnt, gut = dn.transposed(), gu.transposed()
    calls["dx_down_transposed"] = lambda: sm.ssmm(dout, dnt, r.offsets, r.token_ids, scale=scale)
    calls["dx_gate_up_transposed"] = lambda: sm.ssmm(dpre, gut, r.offsets, None)
    if not a.no_dw:
        dsort = dout[r.token_ids.long().clamp(max=T - 1)]   # the down projection's dy: sorted rows
        calls["dw_down_copy"] = lambda: ssmm_dw(dsort, hu, dn, r.offsets, None, scale, impl="copy")
        calls["dw_gate_up_copy"] = lambda: ssmm_dw(dpre, xg, gu, r.offsets, r.token_ids, None, impl="copy")
    reps = 1 if a.ncu else a.reps
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        if a.ncu:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        tot = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                tot[ev.name[:60]] += ev.device_time / 1000.0 / reps
        parts = ", ".join(f"{k} {v:.3f}" for k, v in tot.most_common(4))
        print(f"{a.model} T={T} {name:24s} total {sum(tot.values()):7.3f} ms  [{parts}]", flush=True)


if __name__ == "__main__":
    main()
