"""The MoE block (moe_forward) timed under each value of a launch-time environment setting,
in turns on the same inputs and token sets: a setting read at launch (SAMOYEDS_PDL,
SAMOYEDS_WS_PDL, SAMOYEDS_DECODE_ROWS_PER_EXPERT, ...) compared within one run, one build.

    python dev/lab/probe_block_env.py --env SAMOYEDS_WS_PDL --values 0,1,2
        [--models mixtral-8x7b,qwen3-30b-a3b] [--tokens 16,128,4096] [--impls auto,wgmma_sp] [--rounds 3]

Each (model, T, impl) is timed ROUNDS times per value, the values in turns (common.time_graph:
CUDA-graph replays; a graph is captured per timing, so the setting applies to its launches);
the median per value and its ratio to the first value are printed and written as JSON.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from samoyeds.moe import moe_forward  # noqa: E402
from common import environment, gpu_dir, time_graph, write_json  # noqa: E402

SHAPES = {  # model: experts E, hidden H, expert intermediate I, top-k K
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "olmoe": (64, 2048, 1024, 8),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    "gpt-oss-20b": (32, 2880, 2880, 4),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", required=True, help="the environment variable")
    ap.add_argument("--values", required=True, help="comma-separated values; 'unset' leaves it unset")
    ap.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b,olmoe")
    ap.add_argument("--tokens", default="16,128,4096")
    ap.add_argument("--impls", default="auto,wgmma_sp")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dev, dt = "cuda", torch.bfloat16
    values = args.values.split(",")
    rows = []
    for model in args.models.split(","):
        if model not in SHAPES:
            raise SystemExit(f"--models: unknown model {model!r}; expected some of {sorted(SHAPES)}")
        E, H, I, K = SHAPES[model]
        gu = sm.pack((torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(dt), args.format, glu=True)
        dn = sm.pack((torch.randn(E, H, I, device=dev) * I ** -0.5).to(dt), args.format)
        torch.cuda.empty_cache()
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, H, device=dev, dtype=dt)
            topk = torch.rand(T, E, device=dev).topk(K, dim=1).indices
            w = torch.softmax(torch.randn(T, K, device=dev), dim=1)
            for impl in args.impls.split(","):
                times = {v: [] for v in values}
                for _ in range(args.rounds):
                    for v in values:
                        if v == "unset":
                            os.environ.pop(args.env, None)
                        else:
                            os.environ[args.env] = v
                        times[v].append(time_graph(lambda: moe_forward(x, topk, w, gu, dn, impl=impl),
                                                   budget_s=0.15)["ms"])
                os.environ.pop(args.env, None)
                med = {v: statistics.median(t) for v, t in times.items()}
                base = med[values[0]]
                rows.append(dict(model=model, T=T, impl=impl, ms=med, all_ms=times,
                                 ratio={v: m / base for v, m in med.items()}))
                print(f"{model:16s} T={T:5d} {impl:8s} " + "  ".join(
                    f"{args.env}={v}: {m * 1e3:8.1f}us ({m / base:.3f})" for v, m in med.items()), flush=True)
        del gu, dn
        torch.cuda.empty_cache()
    write_json(os.path.join(gpu_dir(args.out), f"probe_block_env_{args.env.lower()}.json"),
               dict(environment(), env=args.env, values=values, format=args.format, rows=rows))


if __name__ == "__main__":
    main()
