"""ssmm_dw alone on the five models' projections (benchmarks/bench_train.py's bench_dw: the
rule's kernel, each wgmma producer, the mma.sync kernel and cuBLAS's dense dW, same inputs),
written as rows for dev/lab/ab_summary.py (before / after a kernel change in one call).

    python dev/lab/dw_bench.py [--models a,b] [--tokens 4096,16384] --out DIR
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import bench_train  # noqa: E402
from common import environment, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=bench_train.MODELS)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = []
    for name in a.models.split(","):
        rows += bench_train.bench_dw(name, [int(t) for t in a.tokens.split(",")], a.format, "cuda", torch.bfloat16,
                                     False, a.seed)
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "dw_bench.json"), {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
