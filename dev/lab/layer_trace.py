"""Where a MoE layer's GPU time goes: transformers' MoE block (the same blocks, weights
and inputs as bench_moe.py) run under torch.profiler with grouped_mm experts and with
samoyeds, every GPU kernel's time summed per call and grouped by what it does
(router, routing, expert matmuls, combine, other).  The expert matmuls' share is
what the kernel benchmark measures; the rest is the layer's glue.

  python dev/lab/layer_trace.py [--models a,b] [--tokens 4096,16384] [--shared-experts] [--out DIR]
                                   [--tiny --device cpu]   (a CPU smoke run)

--shared-experts packs the blocks' shared experts too (patch_model(shared_experts=True)) and
writes layer_trace_shared_experts.json: the shared MLP's matmuls then count as expert matmuls.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from bench_moe import _set_impl, block_arguments, block_run, random_block  # noqa: E402
from common import environment, result_path, write_json  # noqa: E402

CALLS = 5  # profiled calls per case (after two untimed ones)

# kernel name fragments -> group (first match wins; the order matters)
GROUPS = (
    ("dense_decode", "shared experts (dense decode)"),
    ("router_logits", "router (samoyeds)"),
    ("router_select", "router (samoyeds)"),
    ("router_tile", "router (samoyeds)"),
    ("glu_kernel", "elementwise / reductions"),
    ("ssmm", "expert matmuls"),
    ("grouped_mm", "expert matmuls"),
    ("cutlass", "expert matmuls"),
    ("sm90_xmma", "expert matmuls"),
    ("nvjet", "gemm (router / shared experts)"),
    ("gemm", "gemm (router / shared experts)"),
    ("route", "routing"),
    ("gather_weights", "routing"),
    ("sort", "routing"),
    ("scan", "routing"),
    ("histc", "routing"),
    ("bincount", "routing"),
    ("topk", "router top-k / softmax"),
    ("softmax", "router top-k / softmax"),
    ("combine", "combine"),
    ("index_add", "combine"),
    ("scatter", "combine"),
    ("index", "gather / index"),
    ("gather", "gather / index"),
)


def group_of(name: str) -> str:
    low = name.lower()
    for frag, grp in GROUPS:
        if frag in low:
            return grp
    if "elementwise" in low or "vectorized" in low or "reduce" in low:
        return "elementwise / reductions"
    return "other"


def kernel_times(fn, device: str, calls: int = CALLS) -> dict:
    """{kernel name: microseconds per call} of `calls` profiled calls."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    want = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    tot = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type != want:
            continue
        if device != "cuda" and "::" not in ev.name:
            continue
        tot[ev.name] += ev.time_range.elapsed_us() / calls
    return dict(tot)


def trace_model(name: str, tokens, fmt: str, device: str, dtype, tiny: bool, seed: int,
                shared: bool = False) -> list:
    dense, cfg = random_block(name, device, dtype, tiny, seed)
    packed = copy.deepcopy(dense)
    sm.patch_model(packed, fmt, progress=False, shared_experts=shared)
    _set_impl(dense, "grouped_mm")
    rows = []
    with torch.inference_mode():
        for T in tokens:
            gen = torch.Generator(device=device).manual_seed(seed + T)
            x = torch.randn(1, T, cfg.hidden_size, device=device, generator=gen).to(dtype)
            row = {"model": name, "T": T, "format": fmt, "shared_experts_packed": shared, "methods": {}}
            for method, holder in (("grouped_mm", dense), ("samoyeds", packed)):
                k = kernel_times(lambda: holder(x), device)
                groups = collections.defaultdict(float)
                for kname, us in k.items():
                    groups[group_of(kname)] += us
                top = sorted(k.items(), key=lambda kv: -kv[1])[:12]
                row["methods"][method] = {"total_us": sum(k.values()), "groups_us": dict(groups),
                                          "top_kernels_us": [[n[:160], us] for n, us in top]}
            rows.append(row)
            _print(row)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _print(row) -> None:
    print(f"\n{row['model']} T={row['T']}", flush=True)
    for method, m in row["methods"].items():
        parts = ", ".join(f"{g} {us:.0f}" for g, us in sorted(m["groups_us"].items(), key=lambda kv: -kv[1]))
        print(f"  {method:<11} {m['total_us']:9.1f} us of kernels: {parts}")
        for n, us in m["top_kernels_us"][:6]:
            print(f"      {us:9.1f} us  {n[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    block_arguments(ap, "4096,16384")
    args = ap.parse_args()
    dtype, tokens = block_run(args)
    rows = []
    for name in args.models.split(","):
        rows += trace_model(name, tokens, args.format, args.device, dtype, args.tiny, args.seed, args.shared_experts)
    path = result_path(args, "layer_trace_shared_experts.json" if args.shared_experts else "layer_trace.json")
    if path:
        write_json(path, {"env": environment(), "calls": CALLS, "cases": rows})


if __name__ == "__main__":
    main()
