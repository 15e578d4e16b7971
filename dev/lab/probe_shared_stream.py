"""The patched MoE block with its shared experts on a second stream (at every size here:
SAMOYEDS_SHARED_STREAM_MIN_ROWS=1) against the same block with every kernel on one stream
(SAMOYEDS_SHARED_STREAM=0), and against transformers' grouped_mm, on the same weights and
inputs: bench_moe's idle and GPU timings, the settings taking turns in rounds, and the host's
enqueue time of one call; the outputs of both samoyeds settings compared bit for bit.

  python dev/lab/probe_shared_stream.py [--models deepseek-v2-lite] [--tokens 1,16,...] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
import bench_moe as bm  # noqa: E402
from common import call_times, environment, result_path, write_json  # noqa: E402

SETTINGS = ("two_streams", "one_stream", "grouped_mm")
MODE = {"two_streams": "1", "one_stream": "0"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bm.block_arguments(ap, "1,16,64,256,1024,4096,16384")
    ap.set_defaults(models="deepseek-v2-lite")
    args = ap.parse_args()
    dtype, tokens = bm.block_run(args)
    dev = args.device
    rows = []
    for name in args.models.split(","):
        holder, cfg = bm.random_block(name, dev, dtype, args.tiny, args.seed)
        sm.patch_model(holder, args.format, progress=False, shared_experts=args.shared_experts)
        dense = copy.deepcopy(holder)
        sm.unpatch_model(dense)
        bm._set_impl(dense, "grouped_mm")
        blocks = [type(m).__name__ for m in holder.modules() if getattr(type(m), "_samoyeds_block", False)]

        def run(setting, x):
            if setting == "grouped_mm":
                return dense(x)
            os.environ["SAMOYEDS_SHARED_STREAM"] = MODE[setting]
            os.environ["SAMOYEDS_SHARED_STREAM_MIN_ROWS"] = "1"   # every size, to see where it pays
            try:
                return holder(x)
            finally:
                os.environ.pop("SAMOYEDS_SHARED_STREAM", None)
                os.environ.pop("SAMOYEDS_SHARED_STREAM_MIN_ROWS", None)

        with torch.inference_mode():
            for T in tokens:
                gen = torch.Generator(device=dev).manual_seed(args.seed + T)
                x = torch.randn(1, T, cfg.hidden_size, device=dev, generator=gen).to(dtype)
                outs = {s: run(s, x).float() for s in SETTINGS}
                lat = {s: [] for s in SETTINGS}
                gpu = {s: [] for s in SETTINGS}
                for rnd in range(bm.ROUNDS):
                    for s in SETTINGS:
                        fn = lambda: run(s, x)  # noqa: E731
                        lat[s] += call_times(fn, dev, budget_s=bm.BUDGET_S / bm.ROUNDS, min_iters=2,
                                             warmup=2 if rnd == 0 else 0)
                        gpu[s] += bm._times_gpu(fn, dev, bm.BUDGET_S / bm.ROUNDS)
                host = {}
                for s in SETTINGS:  # the host's enqueue time of one call, the GPU kept busy
                    ts = []
                    for _ in range(30):
                        if dev == "cuda":
                            torch.cuda._sleep(2_000_000)
                        t0 = time.perf_counter()
                        run(s, x)
                        ts.append((time.perf_counter() - t0) * 1e3)
                        if dev == "cuda":
                            torch.cuda.synchronize()
                    host[s] = statistics.median(ts)
                row = {"model": name, "T": T, "swapped_blocks": blocks, "host_ms": host,
                       "bit_identical": all(torch.equal(outs[s], outs["one_stream"]) for s in MODE),
                       "ms": {s: statistics.median(lat[s]) for s in SETTINGS},
                       "ms_gpu": {s: statistics.median(gpu[s]) if gpu[s] else None for s in SETTINGS}}
                for k in ("ms", "ms_gpu"):
                    t = row[k]
                    if t["two_streams"] and t["one_stream"] and t["grouped_mm"]:
                        row[f"{k}_speedup_two_vs_one"] = t["one_stream"] / t["two_streams"]
                        row[f"{k}_vs_grouped_mm"] = {s: t["grouped_mm"] / t[s] for s in MODE}
                rows.append(row)
                print(f"{name:18s} T={T:6d} " + "  ".join(
                    f"{s} {row['ms'][s] * 1e3:8.1f} / {(row['ms_gpu'][s] or float('nan')) * 1e3:8.1f} us"
                    for s in SETTINGS) + f"  identical={row['bit_identical']}  host "
                    + " ".join(f"{host[s] * 1e3:.0f}" for s in SETTINGS) + " us", flush=True)
                if dev == "cuda":
                    torch.cuda.empty_cache()
        del holder, dense
    path = result_path(args, "probe_shared_stream.json")
    if path:
        write_json(path, dict(environment(), command="python3 " + " ".join(sys.argv), rows=rows))
        print("wrote", path)


if __name__ == "__main__":
    main()
