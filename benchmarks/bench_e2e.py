"""End-to-end benchmark (paper Fig. 15): whole causal LMs of real MoE models
(published configs, random weights, nothing downloaded) with transformers'
``grouped_mm`` experts and with samoyeds, same attention (sdpa), same weights.

Per model: as many decoder layers as the dense model fits in the GPU's memory
with room for the largest prefill (the real depth where it fits; the depth used
is reported).  The model is built once; ``samoyeds.patch_model`` packs its
experts (magnitude masks), samoyeds is measured, ``unpatch_model`` puts the
masked dense weights back and ``grouped_mm`` is measured on exactly those.

  prefill   forward of batch x seq tokens (no KV cache, last-position logits only,
            as generate's prefill), tokens/s = batch * seq / median time;
  decode    greedy ``generate`` from a prompt of --prompt tokens, per KV cache (--cache):
            tokens/s = batch * (N - 1) / (time(N new tokens) - time(1 new token));
            the row's prefill_tokens_per_s = batch * prompt / time(1 new token).

Caches (--cache dynamic,static):
  dynamic   transformers' default DynamicCache; every decode step runs eagerly (host-bound
            at small batches);
  static    a StaticCache, with which ``generate`` compiles the decode step
            (``torch.compile(model.__call__, **CompileConfig())``: inductor, mode
            "reduce-overhead", i.e. CUDA graphs) as ``generate(..., cache_implementation=
            "static")`` does.  One StaticCache of prompt + N positions is made per (method,
            batch) and reset before each call (``generate(..., cache=...)``): a fresh cache per
            call would give the CUDA graphs new static addresses and re-record them in every
            timed call.  Dynamo is reset before each (method, batch), so compile_s (the
            warm-up call's time beyond a timed one: tracing, inductor, graph recording) is
            that configuration's own; the warm-up is never timed.  fresh_cache_generate_s: one
            call of ``generate(..., cache_implementation="static")`` as a user writes it
            (fresh cache; graphs re-recorded), for reference.  graph_breaks and graphs: what
            dynamo counted while compiling (0 breaks expected for both methods).
            On the CPU (--device cpu) generate compiles only when told to
            (CompileConfig._compile_all_devices) and the backend is "eager" by default.

Each method runs its own experts implementation in decode too: on a GPU,
transformers' ``generate`` swaps ``grouped_mm`` for ``batched_mm`` during decoding
(``GenerationMixin._optimize_model_for_decode``; batched_mm gathers a copy of the
selected experts' weights per token: up to 10.5 GiB per Mixtral layer at batch 16), which
would time batched_mm under grouped_mm's name.  The swap is turned off for the model
here; --hf-decode-switch keeps transformers' default, and ``--methods
grouped_mm,batched_mm,samoyeds`` measures batched_mm as a method of its own.

On the GPU each model runs in its own process (a failure ends that model only).

``--methods ...,no_moe`` adds the bound that no MoE implementation can pass: the same model
with every MoE block (router, experts, shared experts) returning zeros; attention, norms,
embeddings, the head and generate's loop still run.  Each samoyeds row then gets
max_speedup_vs_grouped_mm = no_moe / grouped_mm (Amdahl's bound for that row) and
share_of_bound = (t_grouped_mm - t_samoyeds) / (t_grouped_mm - t_no_moe), the part of the
time that removing the MoE blocks would save which samoyeds saves.

  python benchmarks/bench_e2e.py [--models a,b] [--prefill-batches 1,4] [--seq 4096]
                                 [--decode-batches 1,32] [--cache dynamic,static] [--new-tokens 32]
                                 [--out DIR] [--tiny --device cpu]   (a CPU smoke run)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm  # noqa: E402
import samoyeds as sm  # noqa: E402
from common import (add_job_args, add_run_args, default_dtype, environment, error_text, free_memory,  # noqa: E402
                    is_oom, isolating, peak_mib, result_path, run_isolated, setup_run, sync, time_ms, write_json)

MODELS = "qwen3-30b-a3b,olmoe-1b-7b,deepseek-v2-lite,mixtral-8x7b"


def _act_bytes_per_token(cfg) -> float:
    """A generous estimate of one decoder layer's transient activations per token
    (bf16): hidden states and attention, plus each routed expert's gathered input,
    gate/up and activation (what grouped_mm materialises), doubled."""
    H = cfg.hidden_size
    I = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    K = cfg.num_experts_per_tok
    return 2 * 2 * (4 * H + K * (H + 3 * I))


def choose_depth(name: str, args, dtype) -> dict:
    cfg = lm.config(name, tiny=args.tiny)
    full = cfg.num_hidden_layers
    if args.device != "cuda":
        return {"depth": full, "full_depth": full}
    free = torch.cuda.mem_get_info()[0]
    tokens = max(max(args.prefill_batches) * args.seq, max(args.decode_batches) * (args.prompt + args.new_tokens))
    reserve = tokens * _act_bytes_per_token(cfg) + args.reserve_gib * 2**30
    depth = min(full, lm.fit_depth(cfg, dtype, free - reserve))
    return {"depth": depth, "full_depth": full, "free_gib": free / 2**30, "reserve_gib": reserve / 2**30}


def hold_experts_in_decode(model) -> bool:
    """Turns off transformers' grouped_mm -> batched_mm swap during generate's decode
    steps (GPU only there), so a method is measured as itself; True if there was one."""
    if not hasattr(model, "_optimize_model_for_decode"):
        return False
    model._optimize_model_for_decode = contextlib.nullcontext   # an instance attribute: this model only
    return True


def _wall(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def compile_config(args):
    """The CompileConfig generate compiles the decode step with (--compile-backend, --compile-mode;
    transformers' defaults on the GPU); on the CPU it tells generate to compile there too."""
    from transformers import CompileConfig
    mode = args.compile_mode if args.compile_backend == "inductor" else None
    cc = CompileConfig(backend=args.compile_backend, mode=mode or None)
    if args.device != "cuda":
        cc._compile_all_devices = True
    return cc


def reset_compiled(model) -> None:
    """Forgets every compiled graph (dynamo's caches, the CUDA graphs, the model's compiled call):
    the next static-cache generate compiles anew."""
    torch._dynamo.reset()
    try:
        from torch._inductor import cudagraph_trees
        cudagraph_trees.reset_cudagraph_trees()
    except Exception:  # noqa: BLE001 - older/newer torch without it: dynamo's reset is enough
        pass
    model.__dict__.pop("_compiled_call", None)
    model.__dict__.pop("_last_compile_config", None)


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"].get("unique_graphs", 0)}


def measure_prefill(model, args, device: str, gen: torch.Generator) -> list:
    V = model.config.vocab_size
    rows = []
    for B in args.prefill_batches:
        ids = torch.randint(3, V, (B, args.seq), generator=gen, device=device)
        row = {"batch": B, "seq": args.seq}
        try:
            fn = lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)  # noqa: E731
            t = time_ms(fn, device, warmup=1, min_iters=args.reps, max_iters=args.reps, budget_s=0)
            row.update(ms=t["ms"], min_ms=t["min_ms"], tokens_per_s=B * args.seq / (t["ms"] * 1e-3),
                       peak_mib=peak_mib(fn, device))
        except Exception as exc:  # noqa: BLE001 - reported per row
            row["error"] = "out of memory" if is_oom(exc) else error_text(exc)
        del ids
        free_memory(device)
        rows.append(row)
        print(f"    prefill {B}x{args.seq}: " + (f"{row['ms']:.1f} ms, {row['tokens_per_s']:,.0f} tokens/s, "
              f"peak {row['peak_mib']:.0f} MiB" if "ms" in row else row["error"]), flush=True)
    return rows


def _kernel_ms(fn) -> float:
    """Milliseconds the GPU spent in kernels and copies while fn() ran (torch.profiler's CUDA
    activity, CUDA-graph replays included): what the step costs the GPU, without the host's
    time between launches."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return total / 1e3


def measure_decode(model, args, device: str, gen: torch.Generator, cache: str, B: int) -> dict:
    """One decode row: greedy generate at batch B with the ``cache`` KV cache (module docstring)."""
    from transformers import StaticCache
    V = model.config.vocab_size
    ids = torch.randint(3, V, (B, args.prompt), generator=gen, device=device)
    mask = torch.ones_like(ids)
    row = {"cache": cache, "batch": B, "prompt": args.prompt, "new_tokens": args.new_tokens}
    extra, sc = {}, None
    if cache == "static":
        reset_compiled(model)
        cc = compile_config(args)
        # the length generate gives a fresh static cache (the last token is never fed back)
        sc = StaticCache(config=model.config, max_cache_len=args.prompt + args.new_tokens - 1)
        extra = {"cache": sc, "compile_config": cc}
        row["compile"] = {"backend": cc.backend, "mode": cc.mode, "fullgraph": cc.fullgraph, "dynamic": cc.dynamic}

    def generate(n):
        if sc is not None:
            sc.reset()
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, **extra)
    try:
        before = _dynamo_counts()
        # warm-up at full length, never timed: the first generate calls of a freshly patched model pay
        # one-time costs (allocator growth, kernel loading; with the static cache: compiling the decode
        # step and recording its CUDA graphs), which a single timed call would charge to the method
        warm = _wall(lambda: generate(args.new_tokens), device)
        t1 = statistics.median(_wall(lambda: generate(1), device) for _ in range(3))
        outs = []
        tn = statistics.median(_wall(lambda: outs.append(generate(args.new_tokens)), device)
                               for _ in range(args.decode_reps))
        out = outs[-1][:, args.prompt:]
        row.update(first_token_s=t1, generate_s=tn, warmup_s=warm, tokens=out[0].tolist(),
                   prefill_tokens_per_s=B * args.prompt / t1)
        if cache == "static":
            after = _dynamo_counts()
            row.update(compile_s=max(0.0, warm - tn), graph_breaks=after["graph_breaks"] - before["graph_breaks"],
                       graphs=after["graphs"] - before["graphs"])
            if args.fresh_static:
                try:
                    fresh = []
                    row["fresh_cache_generate_s"] = _wall(lambda: fresh.append(model.generate(
                        ids, attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                        do_sample=False, pad_token_id=0, cache_implementation="static",
                        compile_config=extra["compile_config"])), device)
                    row["fresh_cache_tokens_identical"] = bool(torch.equal(fresh[0][:, args.prompt:], out))
                except Exception as exc:  # noqa: BLE001 - a note, the row stands
                    row["fresh_cache_error"] = error_text(exc)
        if args.gpu_time and device == "cuda" and args.new_tokens > 1:
            # the GPU's busy time per decode step (N tokens less 1, over N - 1 steps): next to
            # ms_per_step it says how much of a step is the host's (generate's loop, launches)
            row["gpu_ms_per_step"] = ((_kernel_ms(lambda: generate(args.new_tokens)) - _kernel_ms(lambda: generate(1)))
                                      / (args.new_tokens - 1))
        if tn > t1:
            row.update(tokens_per_s=B * (args.new_tokens - 1) / (tn - t1),
                       ms_per_step=(tn - t1) / (args.new_tokens - 1) * 1e3)
        else:
            row["error"] = "N tokens took no longer than 1 (timer noise; use more --new-tokens)"
    except Exception as exc:  # noqa: BLE001
        row["error"] = "out of memory" if is_oom(exc) else error_text(exc)
    del ids, mask, sc, extra
    if cache == "static":
        reset_compiled(model)
    free_memory(device)
    msg = (f"{row['ms_per_step']:.2f} ms/step, {row['tokens_per_s']:,.1f} tokens/s"
           if "tokens_per_s" in row else row["error"])
    if "gpu_ms_per_step" in row:
        msg += f", GPU busy {row['gpu_ms_per_step']:.2f} ms/step"
    if "compile_s" in row:
        msg += f" (compile {row['compile_s']:.1f} s, {row['graph_breaks']} graph breaks, {row['graphs']} graphs)"
    print(f"    decode {cache} batch {B}: {msg}", flush=True)
    return row


START = [time.perf_counter()]  # when the method now measured began (--time-budget)


def measure(model, args, device: str, gen: torch.Generator) -> dict:
    """Prefill and decode throughput of ``model`` as it is now (one experts implementation)."""
    START[0] = time.perf_counter()
    res = {"prefill": [], "decode": []}
    with torch.inference_mode():
        res["prefill"] = measure_prefill(model, args, device, gen)
        for cache in args.cache:
            for B in args.decode_batches:
                if args.time_budget and time.perf_counter() - START[0] > args.time_budget:
                    res["decode"].append({"cache": cache, "batch": B, "error": f"skipped (--time-budget "
                                                                            f"{args.time_budget:g} s spent)"})
                    print(f"    decode {cache} batch {B}: {res['decode'][-1]['error']}", flush=True)
                    continue
                res["decode"].append(measure_decode(model, args, device, gen, cache, B))
    return res


@contextlib.contextmanager
def _no_moe(model):
    """--methods no_moe: every MoE block returns zeros (one memset) while inside."""
    blocks = lm.moe_blocks(model)
    for m in blocks:
        m.forward = lm.zero_moe_forward
    try:
        yield
    finally:
        for m in blocks:
            del m.forward


def run_model(name: str, args) -> dict:
    device, dtype = args.device, default_dtype(args.device)
    import transformers
    transformers.logging.set_verbosity_error()
    depth = choose_depth(name, args, dtype)
    t0 = time.perf_counter()
    model = lm.build(name, device, dtype, tiny=args.tiny, layers=depth["depth"], seed=args.seed)
    lm.set_experts(model, "grouped_mm")
    held = hold_experts_in_decode(model) if not args.hf_decode_switch else False
    sync(device)
    res = {"model": name, **depth, "scaled": depth["depth"] < depth["full_depth"],
           "decode_experts": "held (transformers' grouped_mm -> batched_mm decode swap off)" if held
           else "transformers' default",
           "params": sum(p.numel() for p in model.parameters()),
           "expert_bytes_dense": sm.hf.experts_weight_nbytes(model), "build_s": time.perf_counter() - t0,
           "format": args.format, "methods": {}}
    print(f"{name}: {depth['depth']}/{depth['full_depth']} layers, {res['params'] / 1e9:.2f} B parameters "
          f"({res['build_s']:.1f} s to build)", flush=True)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    probe = torch.randint(3, model.config.vocab_size, (2, 64), generator=gen, device=device)
    logits = {}
    order = ["samoyeds"] + [m for m in args.methods if m != "samoyeds"] if "samoyeds" in args.methods \
        else list(args.methods)
    for method in order:
        try:
            if method == "samoyeds":
                t = time.perf_counter()
                sm.patch_model(model, args.format, progress=False)
                sync(device)
                res["pack_s"] = time.perf_counter() - t
                res["expert_bytes_samoyeds"] = sm.hf.experts_weight_nbytes(model)
            else:
                if sm.hf.is_patched(model):
                    sm.unpatch_model(model)
                lm.set_experts(model, "grouped_mm" if method == "no_moe" else method)
            free_memory(device)
            print(f"  {method}:", flush=True)
            weights = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else float("nan")
            with _no_moe(model) if method == "no_moe" else contextlib.nullcontext():
                with torch.inference_mode():
                    logits[method] = model(input_ids=probe, logits_to_keep=1).logits.float().cpu()
                m = measure(model, args, device, torch.Generator(device=device).manual_seed(args.seed + 1))
            m["allocated_gib"] = weights
            res["methods"][method] = m
        except Exception as exc:  # noqa: BLE001 - a method that fails is reported, the others still run
            res["methods"][method] = {"error": error_text(exc)}
            print(f"  {method}: {error_text(exc)}", flush=True)
        free_memory(device)
    if "samoyeds" in logits and "grouped_mm" in logits:
        a, b = logits["samoyeds"], logits["grouped_mm"]
        res["rel_diff_logits_vs_grouped_mm"] = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    _ratios(res)
    return res


def _key(phase: str, r: dict) -> tuple:
    """A row's key within a method: prefill by batch, decode by (cache, batch); rows written
    before the static cache existed are dynamic-cache rows."""
    return (r.get("batch"),) if phase == "prefill" else (r.get("cache", "dynamic"), r.get("batch"))


def _ratios(res: dict) -> None:
    s, g = res["methods"].get("samoyeds", {}), res["methods"].get("grouped_mm", {})
    z = res["methods"].get("no_moe", {})
    for phase in ("prefill", "decode"):
        peer = {_key(phase, r): r for r in g.get(phase, [])}
        floor = {_key(phase, r): r for r in z.get(phase, [])}
        for rs in s.get(phase, []):
            rg = peer.get(_key(phase, rs), {})
            rz = floor.get(_key(phase, rs), {})
            if "tokens_per_s" in rs and "tokens_per_s" in rg:
                rs["speedup_vs_grouped_mm"] = rs["tokens_per_s"] / rg["tokens_per_s"]
                if "tokens_per_s" in rz:
                    rs["max_speedup_vs_grouped_mm"] = rz["tokens_per_s"] / rg["tokens_per_s"]
                    ts, tg, tz = (1 / r["tokens_per_s"] for r in (rs, rg, rz))
                    if tg > tz:
                        rs["share_of_bound"] = (tg - ts) / (tg - tz)
            if phase == "decode" and "prefill_tokens_per_s" in rs and "prefill_tokens_per_s" in rg:
                rs["prefill_speedup_vs_grouped_mm"] = rs["prefill_tokens_per_s"] / rg["prefill_tokens_per_s"]
            if phase == "decode" and "tokens" in rs and "tokens" in rg:
                same = sum(x == y for x, y in zip(rs["tokens"], rg["tokens"]))
                rs["greedy_tokens_identical"] = f"{same}/{len(rg['tokens'])}"


def _phase_name(phase: str, r: dict) -> str:
    return phase if phase == "prefill" else f"decode-{r.get('cache', 'dynamic')[:3]}"


def _print_table(rows) -> None:
    print(f"\n{'model':<18}{'layers':>8}  {'phase':<11}{'batch':>6}{'grouped_mm tok/s':>18}{'samoyeds tok/s':>16}"
          f"{'speed-up':>10}{'bound':>8}{'compile s (g/s)':>17}{'breaks (g/s)':>14}")

    def cell(d):
        return f"{d['tokens_per_s']:,.0f}" if "tokens_per_s" in d else d.get("error", "-")[:14]

    for r in rows:
        if "methods" not in r:
            print(f"{r.get('model', '?'):<18} {r.get('error')}")
            continue
        s, g = r["methods"].get("samoyeds", {}), r["methods"].get("grouped_mm", {})
        for phase in ("prefill", "decode"):
            keys = []
            for x in g.get(phase, []) + s.get(phase, []):
                if _key(phase, x) not in keys:
                    keys.append(_key(phase, x))
            bs = {_key(phase, x): x for x in s.get(phase, [])}
            bg = {_key(phase, x): x for x in g.get(phase, [])}
            for k in keys:
                rs, rg = bs.get(k, {}), bg.get(k, {})
                sp, bound = rs.get("speedup_vs_grouped_mm"), rs.get("max_speedup_vs_grouped_mm")
                comp = brk = ""
                if "compile_s" in rs or "compile_s" in rg:
                    comp = "/".join(f"{x['compile_s']:.0f}" if "compile_s" in x else "-" for x in (rg, rs))
                    brk = f"{rg.get('graph_breaks', '-')}/{rs.get('graph_breaks', '-')}"
                print(f"{r['model']:<18}{r['depth']:>4}/{r['full_depth']:<3}  {_phase_name(phase, rs or rg):<11}"
                      f"{rs.get('batch', rg.get('batch', 0)):>6}{cell(rg):>18}{cell(rs):>16}"
                      f"{(f'{sp:.2f}x' if sp else '-'):>10}{(f'{bound:.2f}x' if bound else '-'):>8}"
                      f"{comp:>17}{brk:>14}")


def merge_results(path: str, new: dict) -> dict:
    """--update: the results file at ``path`` with the cases of the models run now replaced (or
    added), the others kept; "runs" lists every run's environment and settings, newest first
    (one model per command keeps each command short)."""
    if not os.path.exists(path):
        return new
    with open(path) as fh:
        old = json.load(fh)
    ran = {c.get("model") for c in new["cases"]}
    kept = [c for c in old.get("cases", []) if c.get("model") not in ran]
    order = [c.get("model") for c in old.get("cases", [])]
    cases = sorted(kept + new["cases"], key=lambda c: order.index(c.get("model")) if c.get("model") in order
                   else len(order))
    runs = old.get("runs") or [dict(old.get("env", {}), settings=old.get("settings"),
                                    models=[c.get("model") for c in old.get("cases", [])])]
    runs = [dict(new["env"], settings=new["settings"], models=sorted(ran))] + runs
    return dict(new, cases=cases, runs=runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--methods", default="grouped_mm,samoyeds")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--prefill-batches", default="1,4")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--decode-batches", default="1,32")
    ap.add_argument("--cache", default="dynamic,static",
                    help="KV caches of the decode rows: dynamic (eager steps), static (generate compiles the step)")
    ap.add_argument("--compile-backend", default=None,
                    help="static cache: torch.compile backend (default: inductor on the GPU, as transformers' "
                         "CompileConfig; eager on the CPU)")
    ap.add_argument("--compile-mode", default="reduce-overhead",
                    help="static cache, inductor: torch.compile mode (transformers' default: reduce-overhead, "
                         "CUDA graphs)")
    ap.add_argument("--no-fresh-static", dest="fresh_static", action="store_false",
                    help="static cache: skip the one reference call with a fresh cache per call")
    ap.add_argument("--gpu-time", action="store_true",
                    help="decode rows: also the GPU's busy time per step (torch.profiler; one more generate "
                         "call of N tokens and of 1): gpu_ms_per_step, next to the wall ms_per_step")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="timed prefill forwards (median)")
    ap.add_argument("--decode-reps", type=int, default=3, help="timed generate calls of N tokens (median)")
    ap.add_argument("--reserve-gib", type=float, default=4.0,
                    help="memory kept free besides the activation estimate when choosing the depth")
    ap.add_argument("--hf-decode-switch", action="store_true",
                    help="keep transformers' swap of grouped_mm for batched_mm in generate's decode steps "
                         "(on a GPU); default: each method runs its own implementation in decode too")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds per method of a model: its decode rows not started by then are recorded as skipped "
                         "(0: no limit); keeps one model's run inside a command's time limit with its JSON written")
    ap.add_argument("--update", action="store_true",
                    help="merge into an existing e2e.json: replace the cases of the models run now, keep the others")
    add_job_args(ap, "model")
    add_run_args(ap)
    args = ap.parse_args()
    setup_run(args)
    if args.tiny:
        args.seq, args.prompt, args.new_tokens = min(args.seq, 64), min(args.prompt, 16), min(args.new_tokens, 8)
    args.prefill_batches = [int(b) for b in str(args.prefill_batches).split(",")]
    args.decode_batches = [int(b) for b in str(args.decode_batches).split(",")]
    args.methods = args.methods.split(",")
    args.cache = [c for c in str(args.cache).split(",") if c]
    if not set(args.cache) <= {"dynamic", "static"}:
        ap.error(f"--cache: dynamic and/or static, got {args.cache}")
    if args.compile_backend is None:
        args.compile_backend = "inductor" if args.device == "cuda" else "eager"
    if args.new_tokens < 2:
        ap.error("--new-tokens: at least 2 (decode rate = (N - 1) tokens between the first and the last)")
    if args.job:
        res = run_model(json.loads(args.job)["model"], args)
        with open(args.job_out, "w") as fh:
            json.dump(res, fh)
        return
    isolate = isolating(args)
    passthrough = [a for a in sys.argv[1:]]
    rows = []
    for name in args.models.split(","):
        if isolate:
            res = run_isolated(os.path.abspath(__file__), {"model": name}, passthrough)
            res.setdefault("model", name)
        else:
            try:
                res = run_model(name, args)
            except Exception as exc:  # noqa: BLE001 - reported, the next model still runs
                res = {"model": name, "error": error_text(exc)}
                print(f"{name}: {error_text(exc)}", flush=True)
        rows.append(res)
    path = result_path(args, "e2e.json")
    if path:
        payload = {"env": environment(), "settings": {
            k: getattr(args, k) for k in ("format", "seq", "prefill_batches", "decode_batches", "prompt", "new_tokens",
                                          "reps", "decode_reps", "methods", "hf_decode_switch", "cache",
                                          "compile_backend", "compile_mode")}, "cases": rows}
        if args.update:
            payload = merge_results(path, payload)
        write_json(path, payload)
    _print_table(rows)


if __name__ == "__main__":
    main()
