"""Expert parallelism: full-depth MoE LMs at EP = 1 and 2, samoyeds against grouped_mm
under the same plan.

For each model (Qwen3-30B-A3B, Mixtral-8x7B: published configs, random weights, nothing
downloaded), each EP size and each experts implementation, one process per rank
(``torch.distributed.run``) builds the model on the meta device, applies transformers'
own distributed plan to it (``DistributedConfig(tp_size=EP, ep_size=EP)``: experts
``grouped_gemm``-sharded on the expert dim and run through ``AllReduceEP``, attention
tensor-parallel by the model's tp_plan; ``maybe_distribute_model`` is what
``from_pretrained(distributed_config=...)`` calls), then materialises it one decoder layer
at a time on the rank's device (benchmarks/lm.py), packing each layer with
``samoyeds.patch_model`` right after it exists (samoyeds) or leaving it dense
(grouped_mm).  EP = 1 is the same model without a distributed config.

Measured on every rank, the slowest rank's time reported:

* prefill tokens/s: ``B x L`` prompts (1 x 4096 and 8 x 4096), no cache, last logits only;
* decode tokens/s: batch 1 and 32, ``--decode-steps`` steps with the KV cache after a
  ``--decode-prompt``-token prompt;
* memory per GPU: the rank's weights (parameters and buffers) and the peak allocated.

A model whose dense weights do not fit one GPU (Mixtral-8x7B in bf16 at EP = 1 on an
80 GB H100) is recorded as out of memory for grouped_mm; samoyeds builds it packed.

Writes benchmarks/results/<gpu>x<EP>/ep.json (h100x2 on two H100s; ``--out`` another folder) with the command,
commit and devices.  ``--tiny --device cpu`` runs the same code on toy configs with gloo
(2 processes; nothing written unless ``--out``): tests/test_ep.py's CPU companion.

    python benchmarks/bench_ep.py                       # two GPUs
    python benchmarks/bench_ep.py --models mixtral-8x7b --merge   # one model per call
    python benchmarks/bench_ep.py --tiny --device cpu --out /tmp/ep
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:  # the installed samoyeds, or else the source tree built in place
    import samoyeds  # noqa: F401
except ImportError:
    sys.path.insert(1, os.path.dirname(HERE))

import common  # noqa: E402
import lm  # noqa: E402

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")
IMPLS = ("samoyeds", "grouped_mm", "no_moe")
CACHES = ("dynamic", "static")
PREFILL = ((1, 4096), (8, 4096))
DECODE = (1, 32)
TINY_PREFILL = ((1, 64), (2, 64))
TINY_DECODE = (1, 4)


# --- one rank ---------------------------------------------------------------------------------------

def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed_model(name: str, tiny: bool, dtype: torch.dtype, layers: Optional[int] = None) -> Any:
    """``name``'s meta model (``layers`` decoder layers; default: the real depth) under
    transformers' EP plan for this world (none at 1 rank)."""
    from transformers import DistributedConfig

    cfg = lm.config(name, tiny=tiny, layers=layers)
    model = lm.meta_model(cfg, dtype)
    if world() == 1:
        return model
    dcfg = DistributedConfig(tp_size=world(), ep_size=world())
    # from_pretrained(distributed_config=dcfg) runs these two on the model it builds
    dcfg, _, mesh_manager = type(model).prepare_distribute_model(dcfg)
    return type(model).maybe_distribute_model(model, dcfg, mesh_manager)


def local_init(module: torch.nn.Module, std: float, gen: torch.Generator) -> None:
    """lm.py's initialisation on each rank's local shards (DTensors have no generator ops)."""
    from samoyeds.hf.parallel import is_dtensor

    with torch.no_grad():
        for mod in module.modules():
            is_norm = "norm" in type(mod).__name__.lower()
            for pname, p in mod.named_parameters(recurse=False):
                t = p.to_local() if is_dtensor(p) else p
                if is_norm and pname == "weight":
                    t.fill_(1.0)
                elif t.dim() >= 2:
                    t.normal_(0.0, std, generator=gen)
                else:
                    t.zero_()


def materialize(model: torch.nn.Module, device: str, std: float, gen: torch.Generator, on_layer) -> Any:
    """lm.materialize with :func:`local_init`: allocates the meta ``model`` on ``device``
    (each rank its own shards), the decoder layers one at a time, ``on_layer`` after each."""
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList()
    try:
        model.to_empty(device=device)
        local_init(model, std, gen)
        lm._rebuild_rotary(model, model.config, device)
    finally:
        model.model.layers = layers
    for i, layer in enumerate(layers):
        layer.to_empty(device=device)
        on_layer(i, layer)
    return model


def build(name: str, impl: str, device: str, dtype: torch.dtype, tiny: bool, seed: int,
          layers: Optional[int] = None) -> Any:
    import samoyeds

    model = distributed_model(name, tiny, dtype, layers)
    std = float(model.config.initializer_range)
    gen = torch.Generator(device=device).manual_seed(seed + 7919 * int(os.environ.get("RANK", "0")))

    def on_layer(i: int, layer: torch.nn.Module) -> None:
        local_init(layer, std, gen)
        if impl in ("samoyeds", "no_moe"):   # no_moe: packed, the least memory; never run
            samoyeds.patch_model(layer, progress=False)

    model = materialize(model, device, std, gen, on_layer)
    if impl == "no_moe":
        for block in lm.moe_blocks(model):
            block.forward = lm.zero_moe_forward
    elif impl != "samoyeds":
        lm.set_experts(model, impl)
    return model


def slowest(seconds: float, device: str) -> float:
    """The largest of every rank's ``seconds``."""
    if world() == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up, every rank starting together."""
    fn()
    times = []
    for _ in range(reps):
        if world() > 1:
            torch.distributed.barrier()
        common.sync(device)
        t0 = time.perf_counter()
        fn()
        common.sync(device)
        times.append(slowest(time.perf_counter() - t0, device))
    return sorted(times)[len(times) // 2]


def measure(model: Any, device: str, args: argparse.Namespace, row: Dict[str, Any], saved=lambda: None) -> None:
    """Fills ``row["prefill"]`` and ``row["decode"]``, calling ``saved()`` after each cell
    (a run stopped midway keeps what it measured)."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)   # the same prompts on every rank
    row.update(prefill=[], decode=[])
    with torch.no_grad():
        for B, L in (TINY_PREFILL if args.tiny else PREFILL):
            ids = torch.randint(3, vocab, (B, L), generator=gen).to(device)
            s = timed(lambda: model(ids, use_cache=False, logits_to_keep=1), device, args.reps)
            row["prefill"].append({"batch": B, "seq": L, "ms": s * 1e3, "tokens_per_s": B * L / s})
            saved()
        P, N = args.decode_prompt, args.decode_steps
        # transformers 5.2x renames past_key_values to cache
        kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        for B in args.decode_batches:
            ids = torch.randint(3, vocab, (B, P), generator=gen).to(device)
            nxt = torch.randint(3, vocab, (B, N), generator=gen).to(device)
            if "dynamic" in args.cache:
                row["decode"].append(dynamic_decode(model, device, args, ids, nxt, kw))
                saved()
            if "static" in args.cache:
                row["decode"].append(static_decode(model, device, args, ids, N))
                saved()
    if "static" in args.cache:
        import bench_e2e
        bench_e2e.reset_compiled(model)


def dynamic_decode(model: Any, device: str, args: argparse.Namespace, ids: torch.Tensor, nxt: torch.Tensor,
                   kw: str) -> Dict[str, Any]:
    """Eager decode steps with a DynamicCache: the model called once per token."""
    from transformers import DynamicCache

    (B, P), N = ids.shape, nxt.shape[1]

    def decode():
        cache = {kw: DynamicCache(config=model.config)}
        model(ids, **cache, use_cache=True, logits_to_keep=1)
        common.sync(device)
        t0 = time.perf_counter()
        for j in range(N):
            model(nxt[:, j:j + 1], **cache, use_cache=True)
        common.sync(device)
        return time.perf_counter() - t0

    decode()
    steps = []
    for _ in range(args.reps):
        if world() > 1:
            torch.distributed.barrier()
        steps.append(slowest(decode(), device))
    s = sorted(steps)[len(steps) // 2]
    return {"cache": "dynamic", "batch": B, "prompt": P, "steps": N, "ms_per_step": s / N * 1e3,
            "tokens_per_s": B * N / s}


def static_decode(model: Any, device: str, args: argparse.Namespace, ids: torch.Tensor, N: int) -> Dict[str, Any]:
    """Greedy ``generate`` with a StaticCache, which compiles the decode step (on the GPU by
    default inductor's "reduce-overhead", transformers' choice: the step replays as a CUDA
    graph, collectives included; ``--compile-backend cudagraphs`` records the same graph
    without inductor's code generation, minutes less to compile at full depth):
    bench_e2e.py's static rows.  ms/step = (time of N + 1 tokens - time of 1) / N, the
    median of --reps calls after a warm-up that compiles; the slowest rank's."""
    import bench_e2e
    from transformers import StaticCache

    B, P = ids.shape
    bench_e2e.hold_experts_in_decode(model)
    if not args.dynamic_shapes:   # else one compiled step serves every batch size (measure() resets after)
        bench_e2e.reset_compiled(model)
    backend = args.compile_backend or ("inductor" if device == "cuda" else "eager")
    ns = argparse.Namespace(compile_backend=backend, compile_mode="reduce-overhead", device=device)
    cc = bench_e2e.compile_config(ns)
    cc.dynamic = args.dynamic_shapes or None
    cache = StaticCache(config=model.config, max_cache_len=P + N)
    mask = torch.ones_like(ids)
    row: Dict[str, Any] = {"cache": "static", "batch": B, "prompt": P, "steps": N,
                           "compile": {"backend": cc.backend, "mode": cc.mode, "dynamic": cc.dynamic}}

    def generate(n: int) -> float:
        cache.reset()
        if world() > 1:
            torch.distributed.barrier()
        common.sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, cache=cache, compile_config=cc)
        common.sync(device)
        row["tokens"] = out[0, P:].tolist()
        return slowest(time.perf_counter() - t0, device)

    try:
        t0 = time.perf_counter()
        generate(N + 1)
        row["compile_s"] = time.perf_counter() - t0
        t1 = sorted(generate(1) for _ in range(3))[1]
        tn = sorted(generate(N + 1) for _ in range(args.reps))[args.reps // 2]
        if tn <= t1:
            raise RuntimeError("N + 1 tokens took no longer than 1 (timer noise; use more --decode-steps)")
        row.update(ms_per_step=(tn - t1) / N * 1e3, tokens_per_s=B * N / (tn - t1))
    except Exception as e:   # noqa: BLE001  one cell's failure is a result
        row["error"] = "out of memory" if common.is_oom(e) else common.error_text(e)
    return row


def tensor_bytes(model: Any) -> int:
    """Bytes this rank holds in parameters and buffers (local shards of DTensors)."""
    from samoyeds.hf.parallel import is_dtensor

    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        t = t.to_local() if is_dtensor(t) else t
        total += t.numel() * t.element_size()
    return total


def run_rank(args: argparse.Namespace) -> None:
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dtype = common.default_dtype(device)
    rows: List[Dict[str, Any]] = []
    path = f"{args.rank_out}.rank{os.environ.get('RANK', '0')}"

    def save(extra: List[Dict[str, Any]] = ()) -> None:
        """This rank's rows so far (the cell being measured included) to its file."""
        with open(path + ".tmp", "w") as fh:
            json.dump(rows + list(extra), fh)
        os.replace(path + ".tmp", path)

    for name in args.models:
        for impl in args.impls:
            row: Dict[str, Any] = {"model": name, "ep": world(), "impl": impl, "rank": int(os.environ.get("RANK", 0))}
            model = None
            try:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                model = build(name, impl, device, dtype, args.tiny, args.seed, layers=args.layers)
                row["weights_gib"] = tensor_bytes(model) / 2**30
                row["experts_gib"] = _experts_bytes(model) / 2**30
                measure(model, device, args, row, lambda: save([{**row, "error": "stopped before this cell ended"}]))
                if device == "cuda":
                    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            except Exception as e:   # noqa: BLE001  one cell's failure is a result, not the end of the run
                row["error"] = "out of memory" if common.is_oom(e) else common.error_text(e)
                if not common.is_oom(e) and args.strict:
                    raise
            del model
            common.free_memory(device)
            if world() > 1:
                torch.distributed.barrier()
            rows.append(row)
            save()
            print(json.dumps({k: v for k, v in row.items() if k not in ("prefill", "decode")}), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _experts_bytes(model: Any) -> int:
    import samoyeds.hf as hf
    from samoyeds.hf.parallel import is_dtensor

    total = 0
    for t in hf.find_experts(model):
        for n in ("gate_up_proj", "down_proj", *[f"samoyeds_{p}_{a}" for p in hf.PROJS for a in hf.ARRAYS]):
            x = getattr(t.experts, n, None)
            if x is not None:
                x = x.to_local() if is_dtensor(x) else x
                total += x.numel() * x.element_size()
    return total


# --- the driver -------------------------------------------------------------------------------------

def launch(ep: int, args: argparse.Namespace, forward: List[str], tmp: str) -> List[Dict[str, Any]]:
    """Runs ``ep`` ranks of this script; returns every rank's rows."""
    rank_out = os.path.join(tmp, f"ep{ep}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ep),
           os.path.abspath(__file__), "--rank-out", rank_out, *forward]
    env = dict(os.environ)
    if args.device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(args.threads))
    else:
        env.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (the device docs)
    # its own process group: a run past --timeout is stopped with every rank it started
    p = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        status = p.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        p.terminate()   # torch.distributed.run passes SIGTERM on to its workers and waits for them
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        status = f"stopped after --timeout {args.timeout:g} s"
    rows = []
    for r in range(ep):
        path = f"{rank_out}.rank{r}"
        if os.path.exists(path):
            with open(path) as fh:
                rows += json.load(fh)
    if status != 0 and not rows:
        rows.append({"ep": ep, "error": status if isinstance(status, str) else f"ranks exited with status {status}"})
    elif isinstance(status, str):
        for row in rows:   # the cell being measured when the run was stopped
            if row.get("error") == "stopped before this cell ended":
                row["error"] = status
    return rows


def merge(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (model, ep, impl): rank 0's times (already the slowest rank's), each rank's memory."""
    out: Dict[tuple, Dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r.get("rank", 0)):
        key = (r.get("model"), r.get("ep"), r.get("impl"))
        m = out.setdefault(key, {k: v for k, v in r.items() if k not in ("rank", "weights_gib", "peak_gib",
                                                                          "experts_gib")})
        for k in ("weights_gib", "experts_gib", "peak_gib"):
            if k in r:
                m.setdefault(f"{k}_per_rank", []).append(r[k])
        if "error" in r:
            m["error"] = r["error"]
    return list(out.values())


def ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per model and phase (prefill 1 x 4096 ...; decode per cache and batch), from tokens/s:

    * ``samoyeds_over_grouped_mm`` at each EP size, and its ceiling
      ``no_moe_over_grouped_mm`` (every MoE block free: router, experts, their all-reduce);
    * ``epN_over_ep1`` per implementation, and for samoyeds its ceiling
      ``epN_over_ep1_bound``: EP = 1's time over (the no-MoE time at EP = N + samoyeds'
      own MoE time at EP = 1 divided by N), i.e. the experts sped up N times with nothing
      paid for it, the rest of the model as transformers' plan runs it.
    """
    by = {(r.get("model"), r.get("ep"), r.get("impl")): r for r in rows if r.get("prefill") or r.get("decode")}
    out = []

    def tps(r, phase):
        return {(c.get("cache", "dynamic") if phase == "decode" else None, c.get("batch"), c.get("seq", c.get("prompt"))):
                c["tokens_per_s"] for c in r.get(phase, []) if "tokens_per_s" in c}

    def add(model, ep, impl, label, phase, k, value):
        row = {"model": model, "ep": ep, "impl": impl, "ratio": label, "phase": phase, "batch": k[1], "seq": k[2],
               "value": value}
        if k[0] is not None:
            row["cache"] = k[0]
        out.append(row)

    for (model, ep, impl), r in by.items():
        pairs = []
        if impl in ("samoyeds", "no_moe") and (model, ep, "grouped_mm") in by:
            pairs.append((f"{impl}_over_grouped_mm", by[(model, ep, "grouped_mm")]))
        if ep != 1 and impl != "no_moe" and (model, 1, impl) in by:
            pairs.append((f"ep{ep}_over_ep1", by[(model, 1, impl)]))
        for label, base in pairs:
            for phase in ("prefill", "decode"):
                a, b = tps(r, phase), tps(base, phase)
                for k in a:
                    if k in b:
                        add(model, ep, impl, label, phase, k, a[k] / b[k])
        zn, z1, s1 = (by.get((model, e, i)) for e, i in ((ep, "no_moe"), (1, "no_moe"), (1, "samoyeds")))
        if impl == "samoyeds" and ep != 1 and zn and z1 and s1:
            for phase in ("prefill", "decode"):
                a, tzn, tz1 = tps(s1, phase), tps(zn, phase), tps(z1, phase)
                for k in a:
                    if k in tzn and k in tz1:
                        moe = max(0.0, 1 / a[k] - 1 / tz1[k])
                        add(model, ep, impl, f"ep{ep}_over_ep1_bound", phase, k, (1 / a[k]) / (1 / tzn[k] + moe / ep))
    return out


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_run_args(ap, "toy configs: a quick CPU check of the script (gloo, 2 processes)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(lm.REAL))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--ep", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own depth)")
    ap.add_argument("--cache", nargs="*", default=list(CACHES), choices=list(CACHES),
                    help="decode rows: dynamic (eager steps, a DynamicCache), static (generate compiles the step); "
                         "none: prefill only")
    ap.add_argument("--compile-backend", default=None, choices=["inductor", "cudagraphs", "eager"],
                    help="static cache: torch.compile backend of the decode step (default: inductor on the GPU, as "
                         "transformers; eager on the CPU)")
    ap.add_argument("--dynamic-shapes", action="store_true",
                    help="static cache: compile the step once for every batch size (torch.compile dynamic=True) "
                         "instead of once per batch size")
    ap.add_argument("--decode-batches", type=int, nargs="*", default=None,
                    help=f"decode batch sizes (default {' '.join(map(str, DECODE))}; --tiny "
                         f"{' '.join(map(str, TINY_DECODE))})")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; --tiny 2)")
    ap.add_argument("--decode-prompt", type=int, default=None, help="prompt tokens before decode (default 512)")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank (--device cpu)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for one EP size's ranks")
    ap.add_argument("--strict", action="store_true", help="a rank's error (other than OOM) ends the run")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of an existing ep.json that this run does not measure (one model or EP "
                         "size per call)")
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.tiny else 5
    if args.decode_batches is None:
        args.decode_batches = list(TINY_DECODE if args.tiny else DECODE)
    if args.decode_prompt is None:
        args.decode_prompt = 8 if args.tiny else 512
    if args.decode_steps is None:
        args.decode_steps = 4 if args.tiny else 32
    if args.rank_out:
        common.setup_run(args)
        run_rank(args)
        return
    if args.device == "cuda" and torch.cuda.device_count() < max(args.ep):
        raise SystemExit(f"--ep {max(args.ep)}: needs that many GPUs, torch sees {torch.cuda.device_count()}")
    forward = [a for a in (argv if argv is not None else sys.argv[1:])]
    forward += ["--reps", str(args.reps), "--decode-prompt", str(args.decode_prompt),
                "--decode-steps", str(args.decode_steps)]
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for ep in args.ep:
            rows += launch(ep, args, forward, tmp)
    rows = merge(rows)
    out_dir = args.out
    if out_dir is None and not args.tiny:   # results/<gpu>x<count>: the card the run got (h100x2, h200x2)
        gpu = os.path.basename(common.gpu_dir(None))
        out_dir = os.path.join(HERE, "results", f"{gpu}x{max(args.ep)}")
    path = os.path.join(out_dir, "ep.json") if out_dir else None
    if args.merge and path and os.path.exists(path):
        with open(path) as fh:
            old_rows = json.load(fh)["rows"]
        measured = {(r.get("model"), r.get("ep"), r.get("impl")) for r in rows}
        rows = [r for r in old_rows if (r.get("model"), r.get("ep"), r.get("impl")) not in measured] + rows
    env = common.environment()
    if args.device == "cuda":
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    payload = {**env, "script": "bench_ep.py", "tiny": args.tiny, "device_kind": args.device,
               "plan": "transformers DistributedConfig(tp_size=EP, ep_size=EP): experts grouped_gemm-sharded, "
                       "AllReduceEP at inference, attention per the model's tp_plan; EP=1 undistributed",
               "rows": rows, "ratios": ratios(rows)}
    for r in payload["ratios"]:
        phase = r["phase"] + (f"-{r['cache'][:3]}" if "cache" in r else "")
        print(f"{r['model']:14s} ep={r['ep']} {r['impl']:10s} {r['ratio']:26s} {phase:11s} "
              f"B={r['batch']:<3} {r['value']:.2f}x")
    for r in rows:
        if "error" in r:
            print(f"{r.get('model')} ep={r.get('ep')} {r.get('impl')}: {r['error']}")
    if path:
        os.makedirs(out_dir, exist_ok=True)
        common.write_json(path, payload)


if __name__ == "__main__":
    main()
