"""Per-kernel device times of the input gradient (dX) of both projections of one MoE layer:
ssmm_dx's kernels (impl) against ssmm on the transposed 2:4 packing (refresh timed apart),
and ssmm_dw's copy kernel beside them (the same kind of product).  torch.profiler's CUDA
kernel times, averaged over --reps calls.  --ncu: one call of each, for ncu capture.

  python dev/lab/dx_probe.py --model mixtral-8x7b --tokens 16384 [--impls wgmma,mma]
                             [--dw-impls copy,gather] [--dx-impls ""] [--out DIR]

--out DIR writes the totals as DIR/dx_probe.json rows ({"case", "total_ms"}: what
dev/lab/ab_builds.sh compares).
"""
import argparse
import collections
import json
import os
import sys

import torch

# benchmarks/ after the leading entries (PYTHONPATH's samoyeds, e.g. ab_builds.sh's copies, first)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import samoyeds as sm  # noqa: E402
import bench_moe  # noqa: E402
from bench_train import dims, routing  # noqa: E402
from samoyeds.ops import ssmm_dw, ssmm_dx  # noqa: E402


def probe(a, model):
    H, I, E, K = dims(bench_moe._block(model, False)[1])
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
    for impl in filter(None, a.impls.split(",")):
        calls[f"dx_down_{impl}"] = lambda impl=impl: ssmm_dx(dout, dn, r.offsets, r.token_ids, scale, impl=impl)
        calls[f"dx_gate_up_{impl}"] = lambda impl=impl: ssmm_dx(dpre, gu, r.offsets, None, None, impl=impl)
    if not a.no_transposed:
        dnt, gut = dn.transposed(), gu.transposed()
        calls["dx_down_transposed"] = lambda: sm.ssmm(dout, dnt, r.offsets, r.token_ids, scale=scale)
        calls["dx_gate_up_transposed"] = lambda: sm.ssmm(dpre, gut, r.offsets, None)
    if not a.no_dw:
        dsort = dout[r.token_ids.long().clamp(max=T - 1)]   # the down projection's dy: sorted rows
        for impl in filter(None, a.dw_impls.split(",")):
            calls[f"dw_down_{impl}"] = lambda impl=impl: ssmm_dw(dsort, hu, dn, r.offsets, None, scale, impl=impl)
            calls[f"dw_gate_up_{impl}"] = lambda impl=impl: ssmm_dw(dpre, xg, gu, r.offsets, r.token_ids, None,
                                                                    impl=impl)
    reps = 1 if a.ncu else a.reps
    rows = []
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
        print(f"{model} T={T} {name:24s} total {sum(tot.values()):7.3f} ms  [{parts}]", flush=True)
        rows.append({"case": f"{model} T={T} {name}", "total_ms": sum(tot.values())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mixtral-8x7b", help="one or more, comma-separated")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--impls", default="wgmma")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--no-dw", action="store_true")
    ap.add_argument("--no-transposed", action="store_true")
    ap.add_argument("--dw-impls", default="copy")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for model in a.model.split(","):
        rows += probe(a, model)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "dx_probe.json"), "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
