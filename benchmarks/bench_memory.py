"""Memory benchmark (paper Fig. 16): the largest batch of --seq-token sequences
that one decoder layer and a whole model run in the GPU's memory, per experts
implementation; and a full Mixtral-8x7B-shaped model (32 layers, 46.7 B
parameters, 93 GB of bf16 weights: more than an 80 GB H100 holds) built directly
in packed form and run with samoyeds.

  layer   a 1-layer model of the real architecture (its attention, router and MoE
          block; tiny vocabulary) fed batch x seq hidden states, no KV cache;
  model   the whole causal LM at its real depth: a prefill of batch x seq tokens
          with a KV cache (last-position logits only, as generate's prefill);
  packed  Mixtral-8x7B at full depth, built layer by layer (each layer's dense
          experts exist only until samoyeds.patch_model packs them): memory,
          a prefill, a few decode steps, and its own largest batch.

The largest batch: batches 1 and 2 are run and their peak memory predicts where
the limit is (on the CPU: plain doubling); from there the batch grows by 1/8 per
step until one fails, then bisects (--tolerance: stop when the bracket is within
that fraction).  --search-budget bounds one search's time (default 60 s, checked
before each probe after the first two): a search that runs out reports the
largest batch that fit and the smallest that failed so far, as a lower bound
("+", budget_exhausted).  A failure is an out-of-memory error, caught, followed by
gc.collect() and torch.cuda.empty_cache(); any other error stops the search and
is reported.  Caps: T*K < 2^31 (int32 routing offsets in both peers), and for
samoyeds T*max(H, K*I) < 2^32 when a check at start-up finds the kernels
misread activations beyond 2^32 elements (32-bit row offsets).

On the GPU each (scope, model) runs in its own process.  --tiny --device cpu
emulates the memory limit with --emulate-capacity tokens (a smoke run of the
code paths, not a measurement).

  python benchmarks/bench_memory.py [--scopes layer,model,packed] [--layer-models a,b] [--model-models a]
                                    [--seq 4096] [--out DIR] [--tiny --device cpu]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm  # noqa: E402
import samoyeds as sm  # noqa: E402
from common import (add_job_args, add_run_args, default_dtype, environment, error_text, free_memory,  # noqa: E402
                    is_oom, isolating, result_path, run_isolated, setup_run, sync, time_ms, write_json)

GiB = 2**30


class EmulatedOOM(RuntimeError):
    """--emulate-capacity: raised where a GPU would run out of memory."""


# --- the largest batch -----------------------------------------------------------------------------

def search_max(fits, cap: int, predict=None, tolerance: float = 0.0, budget_s: Optional[float] = None) -> dict:
    """The largest n in [1, cap] with fits(n) True, assuming fits is monotone.

    fits(n) -> (ok, info).  Probes 1 and 2, then jumps to 0.9 * predict(probes)
    when given (else doubles), grows by 1/8 per step until a failure, and bisects
    until hi - lo <= max(1, lo * tolerance).  Returns the max (0 when even 1
    fails), whether the cap stopped it, and every probe.  With ``budget_s``, no new
    probe starts after that many seconds (past the first two): the max is then a
    lower bound (budget_exhausted)."""
    probes = []
    t_start = time.perf_counter()
    out_of_time = lambda: (budget_s is not None and len(probes) >= 2  # noqa: E731
                           and time.perf_counter() - t_start > budget_s)
    exhausted = False

    def probe(n):
        t0 = time.perf_counter()
        ok, info = fits(n)
        probes.append(dict(n=n, ok=ok, seconds=round(time.perf_counter() - t0, 3), **info))
        print(f"      batch {n}: {'fits' if ok else 'fails'} ({info.get('why', '')}{probes[-1]['seconds']:.1f} s)",
              flush=True)
        return ok

    cap = max(1, cap)
    lo, hi, n, grow = 0, None, 1, 2.0
    while True:
        if not probe(n):
            hi = n
            break
        lo = n
        if n >= cap:
            break
        if out_of_time():
            exhausted = True
            break
        nxt = max(n + 1, math.ceil(n * grow))
        if n == 2 and predict is not None:
            p = predict(probes)
            if p is not None:
                grow = 1.125
                nxt = max(n + 1, int(p * 0.9))
        n = min(cap, nxt)
    error = probes[-1]["why"].rstrip(", ") if probes[-1].get("fatal") else None
    while error is None and hi is not None and hi - lo > max(1, int(lo * tolerance)):
        if out_of_time():
            exhausted = True
            break
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
            if probes[-1].get("fatal"):
                error = probes[-1]["why"].rstrip(", ")
    return {"max": lo, "capped": hi is None and lo >= cap, "cap": cap, "first_failure": hi, "error": error,
            "budget_exhausted": exhausted, "seconds": round(time.perf_counter() - t_start, 1), "probes": probes}


def _budget_note(r: dict, args) -> None:
    """A search stopped by --search-budget reports a lower bound, like a cap."""
    if r.get("budget_exhausted"):
        r["capped"] = True
        r["cap_reason"] = (f"--search-budget {args.search_budget:g} s (smallest failing batch: "
                           f"{r['first_failure'] if r['first_failure'] is not None else 'none tried'})")


def make_fits(run, device: str, seq: int, emulate: int):
    """fits(n) for search_max: run(n) must do the work of batch n; OOM is a failure."""

    def fits(n):
        if emulate and n * seq > emulate:
            return False, {"why": "emulated out of memory, "}
        info = {}
        free_memory(device)
        if device == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        ok, why, fatal = False, "", False
        try:
            run(n)
            sync(device)
            ok = True
        except Exception as exc:  # noqa: BLE001 - classified below
            if is_oom(exc):
                why = "out of memory, "
            else:
                why, fatal = error_text(exc) + ", ", True
        if device == "cuda" and ok:
            info["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GiB
        free_memory(device)
        if why:
            info["why"] = why
        if fatal:
            info["fatal"] = True
        return ok, info

    return fits


def predictor(device: str):
    """A linear fit of peak memory over the probes of batches 1 and 2 -> the batch
    that fills what the allocator can still hand out (GPU only)."""
    if device != "cuda":
        return None

    def predict(probes):
        p1 = next((p for p in probes if p["n"] == 1 and p["ok"]), None)
        p2 = next((p for p in probes if p["n"] == 2 and p["ok"]), None)
        if not p1 or not p2:
            return None
        slope = p2["peak_gib"] - p1["peak_gib"]
        if slope <= 0:
            return None
        free_memory(device)
        usable = (torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / GiB
        return (usable - (p1["peak_gib"] - slope)) / slope

    return predict


# --- caps --------------------------------------------------------------------------------------------

def ssmm_reads_beyond_2_32(device: str):
    """Does ssmm read the right rows of an activation tensor holding more than 2^32
    elements?  (One 8.6 GB bf16 tensor; run before anything else is allocated.)
    None on the CPU (the C reference indexes with 64 bits)."""
    if device != "cuda":
        return None
    C, tail = 4096, 256
    rows = 2**32 // C + tail
    try:
        x = torch.empty(rows, C, dtype=torch.bfloat16, device=device)
        x[:tail].normal_()
        x[-tail:].normal_()
        w = sm.pack(torch.randn(1, 128, C, device=device, dtype=torch.bfloat16) * C ** -0.5, "samoyeds-1:2:128")
        tok = torch.arange(rows - tail, rows, dtype=torch.int32, device=device)
        offs = torch.tensor([0, tail], dtype=torch.int32, device=device)
        y = sm.ssmm(x, w, offs, tok).float()
        ref = x[-tail:].float() @ sm.unpack(w)[0].float().T
        ok = bool(torch.isfinite(y).all()) and ((y - ref).norm() / ref.norm()).item() < 2e-2
        del x, w, tok, offs, y, ref
    except Exception as exc:  # noqa: BLE001 - cannot tell: assume the 32-bit limit (the cap applies)
        print(f"  large-activation check: {error_text(exc)}; assuming 32-bit row offsets", flush=True)
        ok = False
    free_memory(device)
    return ok


def token_cap(cfg, method: str, large_ok) -> tuple:
    """(most tokens, why) for one forward of this model with this method."""
    H = cfg.hidden_size
    I = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    K = cfg.num_experts_per_tok
    cap, why = (2**31 - 1) // K, "T*K < 2^31 (int32 routing offsets)"
    if method == "samoyeds" and large_ok is False:
        c = (2**32 - 1) // max(H, K * I)
        if c < cap:
            cap, why = c, "T*max(H, K*I) < 2^32 (ssmm's 32-bit activation row offsets)"
    return cap, why


# --- jobs ------------------------------------------------------------------------------------------

def _build(name: str, args, method: str, **kw):
    """A model of ``name`` for ``method``: samoyeds packs each layer as soon as it exists."""
    device, dtype = args.device, default_dtype(args.device)
    hook = None
    if method == "samoyeds":
        def hook(i, layer):
            if sm.hf.experts.find_experts(layer):
                sm.patch_model(layer, args.format, progress=False)
    model = lm.build(name, device, dtype, tiny=args.tiny, seed=args.seed, on_layer=hook, **kw)
    if method != "samoyeds":
        lm.set_experts(model, method)
    sync(device)
    return model


def _max_batch_one(scope: str, name: str, method: str, args, large_ok) -> dict:
    device, dtype = args.device, default_dtype(args.device)
    kw = {}
    if scope == "layer":
        kw = dict(layers=1, vocab_size=128)
        if name == "deepseek-v2-lite":
            kw["first_k_dense_replace"] = 0
    t0 = time.perf_counter()
    model = _build(name, args, method, **kw)
    build_s = time.perf_counter() - t0
    cfg = model.config
    weights = torch.cuda.memory_allocated() / GiB if device == "cuda" else None
    gen = torch.Generator(device=device).manual_seed(args.seed)

    def run(b):
        with torch.inference_mode():
            if scope == "layer":
                x = torch.randn(b, args.seq, cfg.hidden_size, device=device, dtype=dtype, generator=gen)
                model.model(inputs_embeds=x, use_cache=False)
            else:
                ids = torch.randint(3, cfg.vocab_size, (b, args.seq), device=device, generator=gen)
                model(input_ids=ids, use_cache=True, logits_to_keep=1)

    tcap, why = token_cap(cfg, method, large_ok)
    cap = min(args.max_batch, tcap // args.seq)
    r = search_max(make_fits(run, device, args.seq, args.emulate_capacity), cap, predictor(device),
                   args.tolerance if scope != "layer" else 0.0, budget_s=args.search_budget or None)
    r.update(weights_gib=weights, build_s=build_s, cap_reason=why if cap < args.max_batch else "--max-batch",
             tokens=r["max"] * args.seq, layers=cfg.num_hidden_layers)
    _budget_note(r, args)
    return r


def job_max_batch(scope: str, name: str, args) -> dict:
    large_ok = ssmm_reads_beyond_2_32(args.device) if "samoyeds" in args.methods else None
    out = {"scope": scope, "model": name, "seq": args.seq, "ssmm_reads_beyond_2_32": large_ok, "methods": {}}
    for method in args.methods:
        print(f"  {scope} {name} {method}:", flush=True)
        try:
            r = _max_batch_one(scope, name, method, args, large_ok)
            print(f"    {method}: max batch {r['max']} x {args.seq}" + (" (capped)" if r["capped"] else ""), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the next method still runs
            r = {"error": error_text(exc)}
            print(f"    {method}: {error_text(exc)}", flush=True)
        out["methods"][method] = r
        free_memory(args.device)
    s, g = out["methods"].get("samoyeds", {}), out["methods"].get("grouped_mm", {})
    if s.get("max") and g.get("max"):
        out["samoyeds_over_grouped_mm"] = s["max"] / g["max"]
    return out


def job_packed(name: str, args) -> dict:
    """The full-depth model built in packed form layer by layer, then run."""
    device, dtype = args.device, default_dtype(args.device)
    cfg = lm.config(name, tiny=args.tiny)
    meta = lm.meta_model(cfg, dtype)
    res = {"scope": "packed", "model": name, "layers": cfg.num_hidden_layers, "format": args.format,
           "params": sum(p.numel() for p in meta.parameters()), "dense_bytes": lm.param_bytes(meta)}
    if device == "cuda":
        res["device_bytes"] = torch.cuda.get_device_properties(0).total_memory
        res["dense_fits"] = res["dense_bytes"] < res["device_bytes"]
    large_ok = ssmm_reads_beyond_2_32(device)
    res["ssmm_reads_beyond_2_32"] = large_ok
    print(f"  packed {name}: {res['params'] / 1e9:.1f} B parameters, {res['dense_bytes'] / GiB:.1f} GiB dense"
          + (f" (device {res['device_bytes'] / GiB:.1f} GiB)" if device == "cuda" else ""), flush=True)
    per_layer = []

    def hook(i, layer):
        sm.patch_model(layer, args.format, progress=False)
        if device == "cuda":
            per_layer.append(torch.cuda.memory_allocated() / GiB)

    t0 = time.perf_counter()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = lm.materialize(meta, device, seed=args.seed, on_layer=hook)
    sync(device)
    res["build_s"] = time.perf_counter() - t0
    res["expert_bytes_packed"] = sm.hf.experts_weight_nbytes(model)
    res["param_and_buffer_bytes"] = sum(t.numel() * t.element_size() for t in
                                        list(model.parameters()) + list(model.buffers()))
    if device == "cuda":
        res["allocated_after_build_gib"] = torch.cuda.memory_allocated() / GiB
        res["peak_during_build_gib"] = torch.cuda.max_memory_allocated() / GiB
        res["allocated_per_layer_gib"] = per_layer
    print(f"    built in {res['build_s']:.1f} s: {res['param_and_buffer_bytes'] / GiB:.1f} GiB on the device",
          flush=True)
    V = cfg.vocab_size
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ids = torch.randint(3, V, (1, args.seq), device=device, generator=gen)
    with torch.inference_mode():
        try:
            fn = lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1)  # noqa: E731
            t = time_ms(fn, device, warmup=1, min_iters=3, max_iters=3, budget_s=0)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            logits = fn().logits.float()
            res["prefill"] = {"batch": 1, "seq": args.seq, "ms": t["ms"],
                              "tokens_per_s": args.seq / (t["ms"] * 1e-3), "logits_finite": bool(torch.isfinite(logits).all())}
            if device == "cuda":
                res["prefill"]["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            mask = torch.ones_like(ids)

            def generate(n):
                return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)
            generate(2)
            sync(device)
            t1 = time.perf_counter()
            generate(1)
            sync(device)
            t1 = time.perf_counter() - t1
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            tn = time.perf_counter()
            out = generate(args.new_tokens)
            sync(device)
            tn = time.perf_counter() - tn
            res["decode"] = {"batch": 1, "prompt": args.seq, "new_tokens": args.new_tokens,
                             "ms_per_step": (tn - t1) / (args.new_tokens - 1) * 1e3 if tn > t1 else None,
                             "tokens": out[0, args.seq:].tolist()}
            if device == "cuda":
                res["decode"]["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            print(f"    prefill 1x{args.seq}: {t['ms']:.0f} ms; decode {res['decode']['ms_per_step']} ms/step; "
                  f"tokens {res['decode']['tokens']}", flush=True)
        except Exception as exc:  # noqa: BLE001
            res["run_error"] = error_text(exc)
            print(f"    run: {error_text(exc)}", flush=True)
        del ids
    free_memory(device)
    if args.packed_max_batch:
        def run(b):
            x = torch.randint(3, V, (b, args.seq), device=device, generator=gen)
            with torch.inference_mode():
                model(input_ids=x, use_cache=True, logits_to_keep=1)
        tcap, why = token_cap(cfg, "samoyeds", large_ok)
        cap = min(args.max_batch, tcap // args.seq)
        r = search_max(make_fits(run, device, args.seq, args.emulate_capacity), cap, predictor(device),
                       args.tolerance, budget_s=args.search_budget or None)
        r["cap_reason"] = why if cap < args.max_batch else "--max-batch"
        _budget_note(r, args)
        res["max_batch"] = r
        print(f"    max batch {r['max']} x {args.seq}" + (" (capped)" if r["capped"] else ""), flush=True)
    return res


def run_job(job: dict, args) -> dict:
    if job["scope"] == "packed":
        return job_packed(job["model"], args)
    return job_max_batch(job["scope"], job["model"], args)


def _print_summary(rows) -> None:
    print("\nscope   model               " + "".join(f"{m:>16}" for m in ("grouped_mm", "samoyeds")) + "   ratio")
    for r in rows:
        if r.get("scope") == "packed" and "params" not in r:
            print(f"packed  {r.get('model', '?'):<20}{r.get('error')}")
            continue
        if r.get("scope") == "packed":
            d = r.get("decode", {})
            print(f"packed  {r['model']:<18}  {r['params'] / 1e9:.1f} B params, dense {r['dense_bytes'] / GiB:.1f} GiB; "
                  f"packed model {r.get('allocated_after_build_gib', float('nan')):.1f} GiB; prefill "
                  f"{r.get('prefill', {}).get('tokens_per_s', float('nan')):,.0f} tok/s; decode "
                  f"{d.get('ms_per_step')} ms/step; max batch {r.get('max_batch', {}).get('max')}"
                  + (f"; error {r['error']}" if "error" in r else ""))
            continue
        if "methods" not in r:
            print(f"{r.get('scope', '?'):<8}{r.get('model', '?'):<20}{r.get('error')}")
            continue
        cells = ""
        for m in ("grouped_mm", "samoyeds"):
            d = r["methods"].get(m, {})
            cells += f"{(str(d['max']) + ('+' if d.get('capped') else '')) if 'max' in d else 'err':>16}"
        ratio = r.get("samoyeds_over_grouped_mm")
        print(f"{r['scope']:<8}{r['model']:<20}{cells}   {f'{ratio:.2f}x' if ratio else '-'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scopes", default="layer,model,packed")
    ap.add_argument("--layer-models", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--model-models", default="qwen3-30b-a3b")
    ap.add_argument("--packed-model", default="mixtral-8x7b")
    ap.add_argument("--methods", default="grouped_mm,samoyeds")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=8, help="decode steps of the packed model")
    ap.add_argument("--max-batch", type=int, default=4096)
    ap.add_argument("--tolerance", type=float, default=1 / 32,
                    help="whole-model searches stop when the bracket is within this fraction (layers: exact)")
    ap.add_argument("--search-budget", type=float, default=60.0,
                    help="seconds one largest-batch search may take before it stops with the bracket it has "
                         "(0: no limit)")
    ap.add_argument("--no-packed-max-batch", dest="packed_max_batch", action="store_false")
    ap.add_argument("--emulate-capacity", type=int, default=None,
                    help="tokens per forward beyond which a probe counts as out of memory (CPU smoke runs; "
                         "default with --tiny: 5 * seq)")
    add_job_args(ap, "(scope, model)")
    add_run_args(ap)
    args = ap.parse_args()
    setup_run(args)
    if args.tiny:
        args.seq, args.new_tokens = min(args.seq, 32), min(args.new_tokens, 3)
        if args.emulate_capacity is None:
            args.emulate_capacity = 5 * args.seq
    args.methods = args.methods.split(",")
    if args.job:
        import transformers
        transformers.logging.set_verbosity_error()
        res = run_job(json.loads(args.job), args)
        with open(args.job_out, "w") as fh:
            json.dump(res, fh)
        return
    scopes = args.scopes.split(",")
    jobs = [{"scope": "layer", "model": m} for m in args.layer_models.split(",") if "layer" in scopes]
    jobs += [{"scope": "model", "model": m} for m in args.model_models.split(",") if "model" in scopes]
    if "packed" in scopes:
        jobs.append({"scope": "packed", "model": args.packed_model})
    isolate = isolating(args)
    if not isolate:
        import transformers
        transformers.logging.set_verbosity_error()
    rows = []
    for job in jobs:
        print(f"{job['scope']} {job['model']}", flush=True)
        t0 = time.perf_counter()
        if isolate:
            res = run_isolated(os.path.abspath(__file__), job, sys.argv[1:])
        else:
            try:
                res = run_job(job, args)
            except Exception as exc:  # noqa: BLE001 - reported, the next job still runs
                res = {"error": error_text(exc)}
                print(f"  {error_text(exc)}", flush=True)
        res.setdefault("scope", job["scope"])
        res.setdefault("model", job["model"])
        res["seconds"] = time.perf_counter() - t0
        rows.append(res)
    path = result_path(args, "memory.json")
    if path:
        write_json(path, {"env": environment(), "settings": {
            "seq": args.seq, "format": args.format, "methods": args.methods, "tolerance": args.tolerance,
            "search_budget_s": args.search_budget,
            "emulated_capacity_tokens": args.emulate_capacity}, "cases": rows})
    _print_summary(rows)


if __name__ == "__main__":
    main()
