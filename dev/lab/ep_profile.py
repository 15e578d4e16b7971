"""Where one EP rank's time goes: a torch.profiler trace per rank of a prefill and of eager
decode steps, for a model built as benchmarks/bench_ep.py builds it (transformers' EP plan).

    python -m torch.distributed.run --standalone --nproc-per-node 2 dev/lab/ep_profile.py \
        --model mixtral-8x7b --layers 8
    python dev/lab/ep_profile.py --model mixtral-8x7b --layers 8          # EP = 1

Prints, per rank and implementation: wall ms, the summed device time of the kernels by
kind (nccl, samoyeds, gemm, attention, other), wall minus the kernels (what the GPU spent
idle: the host's time when larger than zero), and the top kernels.  Writes nothing unless
--out (a JSON per rank).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(1, ROOT)

import bench_ep  # noqa: E402
import common  # noqa: E402

KINDS = (("nccl", ("nccl",)),
         ("samoyeds", ("ssmm", "route", "combine", "gather_weights", "glu", "dense_decode", "samoyeds", "moe_")),
         ("attention", ("flash", "fmha", "attention", "sdpa")),
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "grouped")))


def kind(name: str) -> str:
    low = name.lower()
    for k, keys in KINDS:
        if any(s in low for s in keys):
            return k
    return "other"


def profile(fn, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile as tprofile

    fn()
    common.sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with tprofile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        issue = time.perf_counter() - t0
        common.sync(device)
        wall = time.perf_counter() - t0
    sums, top = {}, {}
    for ev in prof.key_averages():
        dt = getattr(ev, "self_device_time_total", None)
        if dt is None:
            dt = getattr(ev, "self_cuda_time_total", 0)
        if not dt or ev.device_type is None or "CUDA" not in str(ev.device_type):
            continue
        k = kind(ev.key)
        sums[k] = sums.get(k, 0.0) + dt / 1e3
        top[ev.key[:90]] = (dt / 1e3, ev.count)
    busy = sum(sums.values())
    return {"wall_ms": wall * 1e3, "issue_ms": issue * 1e3, "kernels_ms": busy, "idle_ms": wall * 1e3 - busy,
            "by_kind_ms": {k: round(v, 3) for k, v in sorted(sums.items())},
            "top": sorted(((v[0], v[1], k) for k, v in top.items()), reverse=True)[:10]}


def static_decode(model, device: str, batch: int) -> dict:
    """bench_e2e's static-cache decode row (generate compiles the step; CUDA graphs on the GPU)."""
    import bench_e2e

    bench_e2e.hold_experts_in_decode(model)
    ns = argparse.Namespace(prompt=128, new_tokens=16, decode_reps=3, compile_backend="inductor" if device == "cuda"
                            else "eager", compile_mode="reduce-overhead", fresh_static=False, gpu_time=device == "cuda",
                            device=device)
    t0 = time.perf_counter()
    row = bench_e2e.measure_decode(model, ns, device, torch.Generator(device=device).manual_seed(1), "static", batch)
    row["total_s"] = time.perf_counter() - t0
    row.pop("tokens", None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--impls", nargs="+", default=["samoyeds", "grouped_mm"])
    ap.add_argument("--prefill", type=int, nargs=2, default=[1, 4096], metavar=("B", "L"))
    ap.add_argument("--decode-batch", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--static", type=int, nargs="*", default=[],
                    help="decode batches to time with generate(cache static): the compiled step (bench_e2e's row)")
    ap.add_argument("--out")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), bench_ep.world()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    dtype = common.default_dtype(device)
    res = []
    for impl in args.impls:
        model = bench_ep.build(args.model, impl, device, dtype, args.tiny, 0, layers=args.layers)
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        B, L = args.prefill
        ids = torch.randint(3, vocab, (B, L), generator=gen).to(device)
        row = {"impl": impl, "rank": rank, "world": world, "layers": args.layers}
        with torch.no_grad():
            row["prefill"] = profile(lambda: model(ids, use_cache=False, logits_to_keep=1), device)
            from transformers import DynamicCache
            Bd, N = args.decode_batch, args.decode_steps
            pids = torch.randint(3, vocab, (Bd, 128), generator=gen).to(device)
            nxt = torch.randint(3, vocab, (Bd, N), generator=gen).to(device)

            def decode():
                cache = DynamicCache(config=model.config)
                model(pids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                common.sync(device)
                for j in range(N):
                    model(nxt[:, j:j + 1], past_key_values=cache, use_cache=True)

            row["decode_prompt_plus_steps"] = profile(decode, device)
        row["static"] = [static_decode(model, device, b) for b in args.static]
        res.append(row)
        for ph in ("prefill", "decode_prompt_plus_steps"):
            p = row[ph]
            print(f"[rank {rank}/{world}] {impl:10s} {ph:24s} wall {p['wall_ms']:8.2f} ms  kernels "
                  f"{p['kernels_ms']:8.2f}  host {p['issue_ms']:8.2f}  idle {p['idle_ms']:8.2f}  {p['by_kind_ms']}", flush=True)
            if rank == 0:
                for t in p["top"][:6]:
                    print(f"      {t[0]:8.2f} ms x{t[1]:<5d} {t[2]}", flush=True)
        del model
        common.free_memory(device)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"ep_profile_{args.model}_L{args.layers}_w{world}_r{rank}.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
