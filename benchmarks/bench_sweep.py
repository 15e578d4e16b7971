"""Kernel sweep (paper Fig. 12/13): one expert, all tokens, over the matmul shape.

``Y [N, M] = X [N, K] @ W [M, K]^T`` with W pruned to the 75 % Samoyeds format
(samoyeds-1:2:128) and to 2:4, both run by ``samoyeds.ssmm`` (all N tokens, no
token ids), against cuBLAS (``torch.mm``) on the same masked weights.  M is the
weight's output rows, K the reduction, N the tokens.

Grid: the cube {256, 1024, 4096, 16384}^3 (64 shapes) plus, through 4096^3, each
dimension alone over 256..16384 in powers of 2 (9 more) -- 73 shapes, about two
minutes on an H100.  Times: CUDA-graph replays, CUDA events, median (as
bench_kernel.py); ceilings (dense bf16 matmul rate, copy bandwidth) measured in
the same run.

  python benchmarks/bench_sweep.py [--cube 256,1024,4096,16384] [--line 256,...,16384] [--out DIR]
                                   [--methods samoyeds-75,samoyeds-50,cublas] [--split-k auto,1]
                                   [--tiny --device cpu]

``--split-k`` times each format under each of the wgmma.sp kernel's ``split_k`` settings
(``samoyeds.config``: auto = the rule, 1 = no split, n = n splits); with more than one, a
format's results are named ``<format>@split-<value>`` (e.g. ``samoyeds-50@split-1``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from common import (add_run_args, default_dtype, environment, error_text, measure_ceilings,  # noqa: E402
                    result_path, setup_run, time_graph, time_ms, write_json)

FORMATS = {"samoyeds-75": "samoyeds-1:2:128", "samoyeds-50": "2:4"}


def grid(cube, line, center: int):
    """(M, K, N) shapes: the full cube over ``cube``, then each dimension over ``line``
    with the other two at ``center``; sorted by (M, K) so a weight is packed once."""
    shapes = {(m, k, n) for m in cube for k in cube for n in cube}
    for v in line:
        shapes |= {(v, center, center), (center, v, center), (center, center, v)}
    return sorted(shapes)


def run(args) -> dict:
    device, dtype = args.device, default_dtype(args.device)
    timer = (lambda fn: time_graph(fn, budget_s=args.budget)) if device == "cuda" else \
        (lambda fn: time_ms(fn, device, budget_s=args.budget, min_iters=3, max_iters=10, warmup=1))
    ceil = measure_ceilings() if device == "cuda" else None
    if ceil:
        print(f"ceilings: dense bf16 {ceil['dense_bf16_tflops']:.0f} TFLOP/s, copy {ceil['copy_tb_s']:.2f} TB/s",
              flush=True)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shapes = grid(args.cube, args.line, args.center)
    cases = []
    t_start = time.perf_counter()
    weights = None
    for M, K, N in shapes:
        if weights is None or weights[0] != (M, K):
            weights = None
            w = torch.randn(M, K, device=device, generator=gen).to(dtype) * K ** -0.5
            packed = {name: sm.pack(w, fmt) for name, fmt in FORMATS.items() if name in args.methods}
            dense = sm.unpack(packed["samoyeds-75"]) if "samoyeds-75" in packed else w
            del w
            weights = ((M, K), packed, dense)
        _, packed, dense = weights
        x = torch.randn(N, K, device=device, generator=gen).to(dtype)
        offs = torch.tensor([0, N], dtype=torch.int32, device=device)
        res = {"M": M, "K": K, "N": N, "dense_flop": 2.0 * M * N * K, "methods": {}}
        runs = [(f"{m}@split-{v}" if m in FORMATS and len(args.split_k) > 1 else m, m, v)
                for m in args.methods for v in (args.split_k if m in FORMATS else ["auto"])]
        for name, m, split in runs:
            out = torch.empty(N, M, device=device, dtype=dtype)
            try:
                if m in FORMATS:
                    p = packed[m]
                    fn = lambda p=p, out=out: sm.ssmm(x, p, offs, None, out=out)  # noqa: E731
                elif m == "cublas":
                    wt = dense.t()
                    fn = lambda wt=wt, out=out: torch.mm(x, wt, out=out)  # noqa: E731
                else:
                    raise ValueError(f"unknown method {m!r}")
                with sm.config(split_k=0 if split == "auto" else int(split)):  # (captured into the graph)
                    t = timer(fn)
                t["dense_equiv_tflops"] = res["dense_flop"] / (t["ms"] * 1e-3) / 1e12
                res["methods"][name] = t
            except Exception as exc:  # noqa: BLE001 - reported per method
                res["methods"][name] = {"error": error_text(exc)}
            del out
        _derive(res, packed, ceil)
        cases.append(res)
        del x
        ms = "  ".join(f"{m} {d['ms']:.3f}" if "ms" in d else f"{m} err" for m, d in res["methods"].items())
        print(f"M={M:>6} K={K:>6} N={N:>6}: {ms}  " + "  ".join(
            f"{m}/cublas {d['speedup_vs_cublas']:.2f}x" for m, d in res["methods"].items()
            if "speedup_vs_cublas" in d), flush=True)
    return {"ceilings": ceil, "shapes": len(shapes), "seconds": time.perf_counter() - t_start, "cases": cases}


def _derive(res: dict, packed: dict, ceil) -> None:
    base = res["methods"].get("cublas", {})
    for name, d in res["methods"].items():
        fmt = name.split("@")[0]
        if fmt not in FORMATS or "ms" not in d:
            continue
        if "ms" in base:
            d["speedup_vs_cublas"] = base["ms"] / d["ms"]
        if ceil:
            density = packed[fmt].fmt.density
            exec_flop = res["dense_flop"] * density * 2          # kept values on 2:4 cores (dense-equivalent)
            d["frac_sparse_ceiling"] = exec_flop / (d["ms"] * 1e-3) / (2 * ceil["dense_bf16_tflops"] * 1e12)
    if "ms" in base and ceil:
        base["frac_dense_ceiling"] = base["dense_equiv_tflops"] / ceil["dense_bf16_tflops"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cube", default="256,1024,4096,16384")
    ap.add_argument("--line", default="256,512,1024,2048,4096,8192,16384")
    ap.add_argument("--center", type=int, default=4096)
    ap.add_argument("--methods", default="samoyeds-75,samoyeds-50,cublas")
    ap.add_argument("--budget", type=float, default=0.15, help="seconds of timed replays per method and shape")
    ap.add_argument("--split-k", default="auto",
                    help="the wgmma.sp kernel's split_k settings to time each format under: auto, 1, n, ...")
    add_run_args(ap)
    args = ap.parse_args()
    setup_run(args)
    if args.tiny:
        args.cube, args.line, args.center = "128,256", "128,256,512", 256
    args.cube = [int(v) for v in str(args.cube).split(",")]
    args.line = [int(v) for v in str(args.line).split(",")]
    args.methods = args.methods.split(",")
    args.split_k = args.split_k.split(",")
    for v in args.split_k:
        if v != "auto" and not (v.isdigit() and int(v) >= 1):
            ap.error(f"--split-k: expected auto or counts >= 1, got {v!r}")
    torch.backends.cuda.matmul.allow_tf32 = False
    res = run(args)
    path = result_path(args, "sweep.json")
    if path:
        write_json(path, {"env": environment(), "settings": {"cube": args.cube, "line": args.line,
                                                             "center": args.center, "formats": FORMATS,
                                                             "budget_s": args.budget, "split_k": args.split_k},
                           **res})
    print(f"{res['shapes']} shapes in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
