"""Where a decode step's time goes, per MoE block: kernel launches, host syncs and GPU time of
one block call at decode sizes, transformers' grouped_mm experts against samoyeds, eager and
compiled (what generate's static-cache decode step runs, inside a CUDA graph).

Per (model, T tokens, method, mode) with mode
  eager     the block as generate's dynamic-cache steps run it;
  compiled  torch.compile(block) with inductor's default mode (no CUDA graphs, so that the
            profiler sees each kernel the graph would replay; the same kernels as
            mode="reduce-overhead"):
it records, per block call (torch.profiler over --calls calls, after two untimed ones):
  kernels     GPU kernels (plus memcpy / memset on the device, counted apart),
  launches    host launch calls (cudaLaunchKernel*, cuLaunchKernel*),
  syncs       host synchronisations (cudaStreamSynchronize, cudaDeviceSynchronize,
              cudaEventSynchronize, blocking cudaMemcpy): each stalls the host, and a block
              with one cannot be captured in a CUDA graph,
  kernel_us   GPU kernel time, also grouped (router, routing, expert matmuls, combine, ...:
              dev/lab/layer_trace.py's groups),
  wall_us     a call from an idle GPU (host enqueue + GPU),
  graph_us    the call replayed as a CUDA graph (benchmarks/common.py time_graph): what the call
              costs inside generate's compiled decode step; "not capturable: ..." where capture
              fails.
The summary line per model gives layers x graph_us: the MoE blocks' share of one decode token
in a compiled static-cache step (compare bench_e2e's ms_per_step).

  python dev/lab/decode_launches.py [--models qwen3-30b-a3b,olmoe] [--tokens 1,32] [--no-compile]
                                    [--out DIR]      (GPU; dev/lab/results/<gpu>/decode_launches.json)

Without a GPU it prints what it would run and exits.
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, HERE)

LAYERS = {"qwen3-30b-a3b": 48, "olmoe": 16, "mixtral-8x7b": 32, "deepseek-v2-lite": 26, "gpt-oss-20b": 24}
LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel")
SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
CALLS = 10


def count_call(fn, calls: int = CALLS) -> dict:
    """Per-call counts and GPU time of fn() from torch.profiler (module docstring)."""
    from layer_trace import group_of
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    kernel_us = collections.defaultdict(float)
    copies = launches = syncs = 0
    runtime = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if ev.name.startswith(("Memcpy", "Memset")):
                copies += 1
                continue
            kernels[ev.name] += 1
            kernel_us[ev.name] += ev.time_range.elapsed_us()
        elif ev.name.startswith(("cuda", "cu")):
            runtime[ev.name] += 1
            if ev.name in LAUNCH:
                launches += 1
            elif ev.name in SYNC:
                syncs += 1
    # the profiling window ends with one torch.cuda.synchronize of its own
    syncs = max(0, syncs - runtime.get("cudaDeviceSynchronize", 0))
    groups = collections.defaultdict(lambda: [0.0, 0.0])
    for name, n in kernels.items():
        g = groups[group_of(name)]
        g[0] += n / calls
        g[1] += kernel_us[name] / calls
    top = sorted(kernel_us.items(), key=lambda kv: -kv[1])[:10]
    return {"kernels": sum(kernels.values()) / calls, "launches": launches / calls, "syncs": syncs / calls,
            "device_copies": copies / calls, "kernel_us": sum(kernel_us.values()) / calls,
            "groups": {g: {"kernels": v[0], "us": v[1]} for g, v in sorted(groups.items(), key=lambda kv: -kv[1][1])},
            "top_kernels": [[n[:140], kernels[n] / calls, us / calls] for n, us in top],
            "runtime_calls": {k: v / calls for k, v in runtime.most_common(12)}}


def graph_us(fn) -> object:
    from common import time_graph
    try:
        return time_graph(fn, budget_s=0.2)["ms"] * 1e3
    except Exception as exc:  # noqa: BLE001 - a host sync or an uncapturable op: the answer itself
        torch.cuda.synchronize()
        return f"not capturable: {type(exc).__name__}: {str(exc)[:160]}"


def wall_us(fn) -> float:
    from common import call_times
    import statistics
    return statistics.median(call_times(fn, "cuda", budget_s=0.2)) * 1e3


def run_case(name: str, tokens, fmt: str, compile_: bool, seed: int) -> list:
    import samoyeds as sm
    from bench_moe import _set_impl, random_block

    dense, cfg = random_block(name, "cuda", torch.bfloat16, False, seed)
    packed = copy.deepcopy(dense)
    sm.patch_model(packed, fmt, progress=False)
    _set_impl(dense, "grouped_mm")
    rows = []
    with torch.inference_mode():
        for T in tokens:
            x = torch.randn(1, T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(seed + T))
            for method, holder in (("grouped_mm", dense), ("samoyeds", packed)):
                modes = [("eager", holder)]
                if compile_:
                    torch._dynamo.reset()
                    modes.append(("compiled", torch.compile(holder)))
                for mode, fn_mod in modes:
                    fn = lambda: fn_mod(x)  # noqa: E731
                    row = {"model": name, "T": T, "method": method, "mode": mode}
                    try:
                        row.update(count_call(fn))
                        row["wall_us"] = wall_us(fn)
                        row["graph_us"] = graph_us(fn)
                    except Exception as exc:  # noqa: BLE001 - reported, the next case runs
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    rows.append(row)
                    _print(row)
            torch.cuda.empty_cache()
    return rows


def _print(r: dict) -> None:
    if "error" in r:
        print(f"{r['model']:<15}{r['T']:>4} {r['method']:<11}{r['mode']:<9} error: {r['error']}", flush=True)
        return
    g = r["graph_us"]
    gs = f"{g:9.1f}" if isinstance(g, float) else "     none"
    print(f"{r['model']:<15}{r['T']:>4} {r['method']:<11}{r['mode']:<9}{r['kernels']:>8.1f}{r['launches']:>9.1f}"
          f"{r['syncs']:>6.1f}{r['kernel_us']:>10.1f}{r['wall_us']:>9.1f}{gs}   " +
          ", ".join(f"{k} {v['kernels']:.0f}/{v['us']:.0f}" for k, v in list(r["groups"].items())[:5]), flush=True)
    if not isinstance(g, float):
        print(f"{'':>20}{g}", flush=True)


HEADER = (f"{'model':<15}{'T':>4} {'method':<11}{'mode':<9}{'kernels':>8}{'launches':>9}{'syncs':>6}"
          f"{'kernel us':>10}{'wall us':>9}{'graph us':>9}   groups (kernels/us)")


def summary(rows: list) -> None:
    print("\nMoE blocks per decode token (compiled, CUDA graph): layers x graph_us")
    by = {}
    for r in rows:
        if r.get("mode") == "compiled" and isinstance(r.get("graph_us"), float):
            by[(r["model"], r["T"], r["method"])] = r["graph_us"]
    for (model, T, method), us in sorted(by.items()):
        L = LAYERS.get(model, 0)
        other = by.get((model, T, "grouped_mm" if method == "samoyeds" else "samoyeds"))
        ratio = f", grouped_mm / samoyeds {other / us:.2f}x" if method == "samoyeds" and other else ""
        print(f"  {model} T={T} {method}: {L} x {us:.1f} us = {L * us / 1e3:.2f} ms per token{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,olmoe")
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    models = args.models.split(",")
    if not torch.cuda.is_available():
        print("decode_launches: no CUDA GPU here; on a GPU this would, for each of")
        for m in models:
            print(f"  {m} (MoE block of the real config; {LAYERS.get(m, '?')} layers in the model)")
        print(f"at T = {tokens} tokens, for grouped_mm experts and samoyeds ({args.format}), "
              f"{'eager and torch.compile(inductor)' if args.compile else 'eager'}:")
        print(f"  profile {CALLS} block calls (torch.profiler, CPU + CUDA) and count per call the GPU kernels, the "
              "host's launch calls and synchronisations, GPU kernel time by group (router, routing, expert matmuls, "
              "combine, ...);")
        print("  time one call from an idle GPU and as a CUDA-graph replay (the compiled decode step's cost);")
        print("  print one row per case and layers x graph time per decode token, and write "
              "dev/lab/results/<gpu>/decode_launches.json.")
        print("\n" + HEADER)
        return
    from common import environment, gpu_dir, write_json
    print(HEADER, flush=True)
    rows = []
    for m in models:
        try:
            rows += run_case(m, tokens, args.format, args.compile, args.seed)
        except Exception as exc:  # noqa: BLE001
            rows.append({"model": m, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"{m}: {rows[-1]['error']}", flush=True)
    summary(rows)
    out = args.out or os.path.join(ROOT, "dev", "lab", "results", os.path.basename(gpu_dir(None)))
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "decode_launches.json"), {"env": environment(), "calls": CALLS, "rows": rows})


if __name__ == "__main__":
    main()
