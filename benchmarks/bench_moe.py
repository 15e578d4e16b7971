"""MoE layer benchmark: transformers' own MoE blocks (router, experts, shared
experts) at real model sizes, run with the "eager" and "grouped_mm" experts
implementations and with samoyeds (patch_model), on the same inputs and the
same (masked) weights.  Three CUDA-event timings of whole block forwards: ms, the
median of calls started from an idle GPU (the latency of one block, the host's
enqueue time included); ms_stream, the mean of calls enqueued back to back (one
block's share of a model's forward, where launches overlap the previous block's GPU
work); ms_gpu, the median of calls enqueued while a spin kernel keeps the GPU busy
(the block's kernels back to back without waiting for the host: what a CUDA-graph
replay sees).  The methods take turns in ROUNDS rounds per case.  Peak GPU memory of
one forward is reported per method next to the expert-weight bytes.

  python benchmarks/bench_moe.py [--models a,b] [--tokens 1,16,64,256,4096,16384] [--format samoyeds-1:2:128]
                                 [--shared-experts] [--out DIR] [--tiny --device cpu]   (a CPU smoke run)

Method samoyeds_index is samoyeds with ``samoyeds.config(x_copy="never")`` (gate_up reads x's
rows by index, as before the copy rule): a before/after of that rule in one run.  On the GPU
each samoyeds row also records its experts' dense-equivalent TFLOP/s (from the GPU time) and
the fraction of the block roofline: max(the experts' dense-equivalent FLOP at twice the
``wgmma.sp`` issue rate (75 % format), their unavoidable bytes at the copy rate) over the
GPU time, with both rates measured in the same run (common.measure_ceilings).

--shared-experts packs the blocks' shared experts too (patch_model(shared_experts=True);
every method then runs the same masked shared weights) and writes moe_shared_experts.json.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from common import (back_to_back_ms, call_times, environment, measure_ceilings, peak_mib, result_path, setup_run,  # noqa: E402
                    write_json)


def _block(name: str, tiny: bool):
    """(label, MoE block class, config) of one decoder layer's MoE block."""
    import transformers as tf
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as dsv2
    from transformers.models.gpt_oss import modeling_gpt_oss as go
    from transformers.models.mixtral import modeling_mixtral as mx
    from transformers.models.olmoe import modeling_olmoe as ol
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3

    s = 16 if tiny else 1  # tiny: shapes divided by 16 (and few experts), for a CPU smoke run
    common = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    if name == "qwen3-30b-a3b":
        cfg = tf.Qwen3MoeConfig(hidden_size=2048 // s, moe_intermediate_size=768 // s, num_experts=128 // s,
                                num_experts_per_tok=8 // (2 if tiny else 1), norm_topk_prob=True, **common)
        return q3.Qwen3MoeSparseMoeBlock, cfg
    if name == "mixtral-8x7b":
        cfg = tf.MixtralConfig(hidden_size=4096 // s, intermediate_size=14336 // s, num_local_experts=8,
                               num_experts_per_tok=2, **common)
        return mx.MixtralSparseMoeBlock, cfg
    if name == "olmoe":
        cfg = tf.OlmoeConfig(hidden_size=2048 // s, intermediate_size=1024 // s, num_experts=64 // s,
                             num_experts_per_tok=8 // (2 if tiny else 1), **common)
        return ol.OlmoeSparseMoeBlock, cfg
    if name == "deepseek-v2-lite":
        cfg = tf.DeepseekV2Config(hidden_size=2048 // s, moe_intermediate_size=1408 // s, n_routed_experts=64 // s,
                                  num_experts_per_tok=6 // (2 if tiny else 1), n_shared_experts=2,
                                  kv_lora_rank=512 // s, q_lora_rank=None, qk_rope_head_dim=64 // s,
                                  qk_nope_head_dim=128 // s, v_head_dim=128 // s, first_k_dense_replace=0,
                                  n_group=1, topk_group=1, intermediate_size=10944 // s, **common)
        return dsv2.DeepseekV2Moe, cfg
    if name == "gpt-oss-20b":
        cfg = tf.GptOssConfig(hidden_size=2880 // s, intermediate_size=2880 // s, num_local_experts=32 // s,
                              num_experts_per_tok=4 // (2 if tiny else 1), head_dim=64 // s, **common)
        return go.GptOssMLP, cfg
    raise ValueError(f"unknown model {name!r}")


class Holder(nn.Module):
    """A module holding one MoE block, so that patch_model can find its experts."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def _set_impl(holder: Holder, impl: str) -> None:
    for mod in holder.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_experts_implementation_internal"):
            cfg._experts_implementation_internal = impl
        elif cfg is not None:
            cfg._experts_implementation = impl


BUDGET_S = 0.4  # seconds of timed calls per case (--tiny: 0.02)


ROUNDS = 5    # the methods' timings interleave in this many rounds per case


def _time(fn, device: str, budget_s: float = None, min_iters: int = 5, max_iters: int = 50) -> float:
    """Median ms of single calls started from an idle GPU."""
    budget_s = BUDGET_S if budget_s is None else budget_s
    return statistics.median(call_times(fn, device, budget_s=budget_s, min_iters=min_iters, max_iters=max_iters))


def _time_stream(fn, device: str, per_call_ms: float, budget_s: float = None) -> float:
    """Mean ms per call of calls enqueued back to back (one synchronisation at the end):
    what each block costs inside a model's forward, where the next layer's launches
    overlap this one's GPU work; for host-bound sizes, the host's time per call."""
    budget_s = BUDGET_S if budget_s is None else budget_s
    n = max(5, min(200, int(budget_s * 1e3 / 2 / max(per_call_ms, 1e-3))))
    return back_to_back_ms(fn, device, n)


_CYCLES_PER_MS = None


def _spin_cycles_per_ms() -> float:
    """Clock cycles per ms of torch.cuda._sleep on this GPU (measured once)."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # clocks up
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS = 1e7 / a.elapsed_time(b)
    return _CYCLES_PER_MS


def _times_gpu(fn, device: str, budget_s: float, min_iters: int = 2, max_iters: int = 50) -> list:
    """ms of the GPU's work of single calls, each enqueued while a spin kernel keeps the GPU
    busy for twice the host's enqueue time: the events around the call then time the block's
    kernels back to back, without the wait for the host (what a CUDA-graph replay, or a host
    running ahead of the GPU, sees).  Empty on the CPU."""
    if device != "cuda" or not hasattr(torch.cuda, "_sleep"):
        return []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    cycles = int((2 * host_ms + 0.2) * _spin_cycles_per_ms())
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_iters or (len(times) < max_iters and time.perf_counter() < t_end):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def random_block(name: str, device: str, dtype, tiny: bool, seed: int):
    """(a Holder of model `name`'s MoE block with N(0, 0.02) weights, the block's config)."""
    cls, cfg = _block(name, tiny)
    torch.manual_seed(seed)
    with torch.device(device):
        block = cls(cfg).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return Holder(block).eval(), cfg


def block_arguments(ap: argparse.ArgumentParser, tokens: str) -> None:
    """The options of the scripts that run transformers' MoE blocks (this one, layer_trace.py)."""
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b,olmoe,deepseek-v2-lite,gpt-oss-20b")
    ap.add_argument("--tokens", default=tokens)
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="shapes / 16, T <= 64: a quick CPU check of the script")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared-experts", action="store_true",
                    help="pack the blocks' shared experts too (models without them are an error)")


def block_run(args):
    """Starts the run of parsed block_arguments: (dtype, token counts; --tiny: at most 64)."""
    setup_run(args)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.tiny:
        tokens = sorted({min(t, 64) for t in tokens})
    return dtype, tokens


def bench_model(name: str, tokens, fmt: str, methods, device: str, dtype, tiny: bool, seed: int,
                shared: bool = False) -> list:
    t0 = time.perf_counter()
    holder, cfg = random_block(name, device, dtype, tiny, seed)
    block = holder.block
    t1 = time.perf_counter()
    print(f"{name}: block built in {t1 - t0:.1f} s", flush=True)
    # the same masked weights for every method: pack, then unpack to masked dense
    sm.patch_model(holder, fmt, progress=False, shared_experts=shared)
    print(f"{name}: packed in {time.perf_counter() - t1:.1f} s", flush=True)
    packed_bytes = sm.hf.experts_weight_nbytes(holder, shared)
    sm.unpatch_model(holder)
    dense_bytes = sm.hf.experts_weight_nbytes(holder, shared)
    # one holder per kind of weights: the dense one switches between the dense methods
    holders = {}
    for method in methods:
        if method in ("samoyeds", "samoyeds_index"):
            if "samoyeds" not in holders:
                holders["samoyeds"] = copy.deepcopy(holder)
                sm.patch_model(holders["samoyeds"], fmt, progress=False, shared_experts=shared)
            holders[method] = holders["samoyeds"]
        else:
            holders[method] = holder

    def run(method, x):
        if method == "samoyeds_index":
            with sm.config(x_copy="never"):
                return holders[method](x)
        if method != "samoyeds":
            _set_impl(holder, method)
        return holders[method](x)

    H = cfg.hidden_size
    rows, outs = [], {}
    with torch.inference_mode():
        for T in tokens:
            gen = torch.Generator(device=device).manual_seed(seed + T)
            x = torch.randn(1, T, H, device=device, generator=gen).to(dtype)
            res = {"model": name, "T": T, "format": fmt, "shared_experts_packed": shared, "expert_bytes_dense": dense_bytes,
                   "expert_bytes_samoyeds": packed_bytes, "methods": {}}
            rows.append(res)
            live = []
            for method in methods:
                try:
                    outs[(method, T)] = run(method, x).float().cpu()
                    live.append(method)
                except Exception as exc:  # a method that cannot run this size is reported
                    res["methods"][method] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            # the methods take turns, ROUNDS times: a drift of the machine's state
            # (clocks, host load) reaches every method alike
            lat = {m: [] for m in live}
            stream = {m: [] for m in live}
            gpu = {m: [] for m in live}
            for rnd in range(ROUNDS):
                for method in live:
                    fn = lambda: run(method, x)  # noqa: E731
                    # (warm-up calls in the first round only: later rounds follow timed calls)
                    lat[method] += call_times(fn, device, budget_s=BUDGET_S / ROUNDS, min_iters=2,
                                              warmup=2 if rnd == 0 else 0)
                    stream[method].append(_time_stream(fn, device, statistics.median(lat[method]),
                                                       BUDGET_S / ROUNDS))
                    if method != "eager":  # (eager's expert loop waits for the GPU: no host ahead)
                        gpu[method] += _times_gpu(fn, device, BUDGET_S / ROUNDS)
            for method in live:
                res["methods"][method] = {"ms": statistics.median(lat[method]),
                                          "ms_stream": statistics.median(stream[method]),
                                          "ms_gpu": statistics.median(gpu[method]) if gpu[method] else None,
                                          "calls": len(lat[method]),
                                          "peak_mib": peak_mib(lambda: run(method, x), device)}
            if device == "cuda":
                torch.cuda.empty_cache()
    flop, nbytes = _expert_work(cfg, packed_bytes)
    for res in rows:
        res["expert_dense_equiv_flop"], res["expert_min_bytes"] = flop(res["T"]), nbytes(res["T"])
    for res in rows:
        T, m = res["T"], res["methods"]
        ref = outs.get(("grouped_mm", T), outs.get(("eager", T)))
        if ref is not None and ("samoyeds", T) in outs:
            got = outs[("samoyeds", T)]
            res["rel_err_vs_dense_masked"] = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        for peer in ("eager", "grouped_mm", "samoyeds_index"):
            if "ms" in m.get("samoyeds", {}) and "ms" in m.get(peer, {}):
                m["samoyeds"][f"speedup_vs_{peer}"] = m[peer]["ms"] / m["samoyeds"]["ms"]
                m["samoyeds"][f"speedup_stream_vs_{peer}"] = m[peer]["ms_stream"] / m["samoyeds"]["ms_stream"]
                if m[peer]["ms_gpu"] and m["samoyeds"]["ms_gpu"]:
                    m["samoyeds"][f"speedup_gpu_vs_{peer}"] = m[peer]["ms_gpu"] / m["samoyeds"]["ms_gpu"]
    holders.clear()  # the blocks' GPU memory goes back before the next model (run() refers to holder)
    del block
    holder = None
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _expert_work(cfg, packed_bytes: int):
    """(T -> the routed experts' dense-equivalent FLOP, T -> their unavoidable bytes): three
    matmuls of H x I per (token, expert) pair; x read and the output written once, and the
    packed weights of the experts T tokens reach, expected under uniform routing
    (E (1 - (1 - 1/E)^(T K)) of them)."""
    H = cfg.hidden_size
    I = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.n_routed_experts
    K = cfg.num_experts_per_tok

    def flop(T):
        return 2.0 * T * K * H * 3 * I

    def nbytes(T):
        return 2.0 * 2 * T * H + packed_bytes * (1.0 - (1.0 - 1.0 / E) ** (T * K))
    return flop, nbytes


def add_roofline(r: dict, ceil: dict, fmt: str) -> None:
    """dense_equiv_tflops and frac_roofline of a samoyeds row (GPU time), against twice the
    wgmma.sp issue rate (the 75 % format skips half the rows; 2:4 at the rate) and the copy
    rate measured in the same run."""
    rate, s = ceil.get("wgmma_sp_tflops"), r["methods"].get("samoyeds", {})
    if not rate or not s.get("ms_gpu"):
        return
    rate *= 2 if fmt.startswith("samoyeds-1:2") else 1
    s["dense_equiv_tflops"] = r["expert_dense_equiv_flop"] / (s["ms_gpu"] * 1e-3) / 1e12
    s["roofline_ms"] = max(r["expert_dense_equiv_flop"] / (rate * 1e12),
                           r["expert_min_bytes"] / (ceil["copy_tb_s"] * 1e12)) * 1e3
    s["frac_roofline"] = s["roofline_ms"] / s["ms_gpu"]


def bench_rounding(name: str, tokens, fmt: str, device: str, dtype, tiny: bool, seed: int) -> list:
    """moe_forward on the same packed experts with the router's top-k and with
    token rounding (tile 128): time, and how much of the routing changed."""
    from samoyeds.moe import moe_forward
    cls, cfg = _block(name, tiny)
    H = cfg.hidden_size
    I = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.n_routed_experts
    K = cfg.num_experts_per_tok
    gen = torch.Generator(device=device).manual_seed(seed)
    gu = sm.pack(torch.randn(E, 2 * I, H, device=device, generator=gen).to(dtype) * H ** -0.5, fmt, glu=True)
    dn = sm.pack(torch.randn(E, H, I, device=device, generator=gen).to(dtype) * I ** -0.5, fmt)
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device=device, generator=gen).to(dtype)
        probs = torch.softmax(torch.randn(T, E, device=device, generator=gen), -1)
        w, idx = probs.topk(K, dim=-1)
        ridx, rw = sm.token_rounding(probs, idx, w, tile=128)
        changed = (sm.route(ridx, E).offsets[-1] - T * K).abs().item()
        t_plain = _time(lambda: moe_forward(x, idx, w, gu, dn), device)
        t_round = _time(lambda: moe_forward(x, ridx, rw, gu, dn), device)
        rows.append({"model": name, "T": T, "format": fmt, "plain_ms": t_plain, "rounded_ms": t_round,
                     "speedup": t_plain / t_round, "pairs_before": T * K,
                     "pairs_after": int(sm.route(ridx, E).offsets[-1]), "net_pairs_changed": int(changed)})
        print(f"token rounding {name:<16} T={T:>6}: top-k {t_plain:.3f} ms, rounded {t_round:.3f} ms "
              f"({t_plain / t_round:.2f}x; {T * K} -> {rows[-1]['pairs_after']} (token, expert) pairs)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    block_arguments(ap, "1,16,64,256,4096,16384")
    ap.add_argument("--methods", default="eager,grouped_mm,samoyeds")
    args = ap.parse_args()
    dtype, tokens = block_run(args)
    if args.tiny:
        global BUDGET_S
        BUDGET_S = 0.02
    methods = args.methods.split(",")
    rows, rounding = [], []
    path = result_path(args, "moe_shared_experts.json" if args.shared_experts else "moe.json")
    env = environment()
    ceil = measure_ceilings() if args.device == "cuda" and not args.tiny else {}

    def save(complete: bool) -> None:  # after every model, so that a run cut short keeps what it measured
        if path:
            write_json(path, {"env": env, "complete": complete, "models": args.models.split(","), "ceilings": ceil,
                              "cases": rows, "token_rounding": rounding})
    for name in args.models.split(","):
        for r in bench_model(name, tokens, args.format, methods, args.device, dtype, args.tiny, args.seed,
                             args.shared_experts):
            if not args.shared_experts:  # (the roofline counts the routed experts only)
                add_roofline(r, ceil, args.format)
            rows.append(r)
            _print_row(r, methods)
        save(False)
    big = [t for t in tokens if t >= (64 if args.tiny else 4096)]
    for name in args.models.split(","):
        if big and "samoyeds" in methods and not args.shared_experts:
            rounding += bench_rounding(name, big, args.format, args.device, dtype, args.tiny, args.seed)
    save(True)
    print("\nmodel              T    " + "".join(f"{m:>12} ms" for m in methods) +
          "  sam/grp  sam/eager  sam/grp back-to-back  sam/grp GPU time   peak MiB (" + "/".join(methods) + ")   rel err")
    for r in rows:
        _print_row(r, methods)


def _print_row(r, methods) -> None:
    m = r["methods"]
    cells = "".join(f"{m[k]['ms']:>15.3f}" if "ms" in m.get(k, {}) else f"{'err':>15}" for k in methods)
    s = m.get("samoyeds", {})
    peaks = "/".join(f"{m[k].get('peak_mib', float('nan')):.0f}" for k in methods if k in m)
    print(f"{r['model']:<16}{r['T']:>6}{cells}  {s.get('speedup_vs_grouped_mm', float('nan')):7.2f}"
          f"  {s.get('speedup_vs_eager', float('nan')):8.2f}  {s.get('speedup_stream_vs_grouped_mm', float('nan')):20.2f}"
          f"  {s.get('speedup_gpu_vs_grouped_mm', float('nan')):16.2f}"
          f"   {peaks:>18}   {r.get('rel_err_vs_dense_masked', float('nan')):.1e}"
          f"   {s.get('dense_equiv_tflops', float('nan')):6.0f} TFLOP/s {s.get('frac_roofline', float('nan')):.0%}"
          f"   vs index {s.get('speedup_gpu_vs_samoyeds_index', float('nan')):.3f}x",
          flush=True)


if __name__ == "__main__":
    main()
