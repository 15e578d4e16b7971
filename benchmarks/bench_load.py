"""Load-time packing: a dense checkpoint too big for the GPU loaded straight into samoyeds'
packed form by transformers' ``from_pretrained`` (samoyeds/hf/quantizer.py).

  1. write   a random-weight checkpoint of the real config (default Mixtral-8x7B: 32 layers,
             8 experts of 4096 x 14336, vocabulary 32000; 46.7 B parameters, 87 GiB in bf16) as
             sharded safetensors in the Hub's layout (Mixtral: ``block_sparse_moe.experts.<e>.
             w1/w2/w3``, as mistralai/Mixtral-8x7B-v0.1 ships it; one shard per decoder layer plus
             one for the embeddings and the head), with model.safetensors.index.json and
             config.json.  Tensors are generated shard by shard on the device (N(0, 0.02),
             norms 1) and written at once; the model is never held.  Where the shards go: the
             folders of --dirs in order (default: the system's temporary folder, then
             /dev/shm), each filled up to its free space less --margin-gib (/dev/shm also no
             further than the memory available less --ram-reserve-gib); shards on other folders
             are linked into the first.  Too little space in all: the script stops before
             writing, saying how much it needs and found.  Files written to a disk are flushed
             and dropped from the page cache (posix_fadvise), so the load reads them back
             (--warm-cache keeps them).
  2. load    ``AutoModelForCausalLM.from_pretrained(dir, quantization_config=samoyeds.SamoyedsConfig(
             format), device_map=device, dtype=dtype)``: wall time, torch.cuda.max_memory_allocated
             (the peak while loading), memory allocated after it, the model's resident bytes.
  3. check   a forward of a short prompt (logits finite) and a few greedy tokens.
  4. dense   the same checkpoint loaded dense, for comparison, only where the dense weights
             fit the device (config arithmetic: dense bytes + --dense-margin-gib <= device
             memory); otherwise recorded as "does not fit" and not tried.  Where it runs, the
             dense model is packed in memory by samoyeds.patch_model and its logits compared with
             the loaded packed model's (the same magnitude masks: equal).

The checkpoint is deleted at exit unless --keep.  --layers N writes and loads N decoder
layers (a quick run); --tiny --device cpu runs a toy config through the same code.

  python benchmarks/bench_load.py [--model mixtral-8x7b] [--layers N] [--dirs D1,D2] [--keep]
                                  [--out DIR] [--tiny --device cpu]
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm  # noqa: E402
import samoyeds as sm  # noqa: E402
from common import (add_run_args, default_dtype, environment, error_text, free_memory, result_path,  # noqa: E402
                    setup_run, sync, write_json)

GiB = 2**30


# --- the checkpoint's tensors ----------------------------------------------------------------------

def hub_tensors(name: str, shape: Tuple[int, ...], family: str) -> List[Tuple[str, Tuple[int, ...], str]]:
    """The Hub-layout tensors (name, shape, what) of one tensor of the model's own state dict:
    merged experts split per expert as the published checkpoints store them; ``what`` is
    "matrix" or "norm" (how it is initialised)."""
    if name.endswith(".mlp.experts.gate_up_proj") and family in HUB_EXPERTS:
        pre = name[: -len("mlp.experts.gate_up_proj")]
        E, I2, H = shape
        gate, up, _ = HUB_EXPERTS[family]
        block = HUB_BLOCK.get(family, "mlp")
        return [(f"{pre}{block}.experts.{e}.{w}.weight", (I2 // 2, H), "matrix") for e in range(E) for w in (gate, up)]
    if name.endswith(".mlp.experts.down_proj") and family in HUB_EXPERTS:
        pre = name[: -len("mlp.experts.down_proj")]
        E, H, I = shape
        block = HUB_BLOCK.get(family, "mlp")
        return [(f"{pre}{block}.experts.{e}.{HUB_EXPERTS[family][2]}.weight", (H, I), "matrix") for e in range(E)]
    if ".mlp.gate." in name and family in HUB_BLOCK:
        return [(name.replace(".mlp.gate.", f".{HUB_BLOCK[family]}.gate."), shape, "matrix")]
    what = "norm" if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] and len(shape) == 1 else \
        ("matrix" if len(shape) >= 2 else "zero")
    return [(name, shape, what)]


# family (config.model_type) -> the per-expert weight names of its published checkpoints (gate, up, down)
HUB_EXPERTS = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
               "olmoe": ("gate_proj", "up_proj", "down_proj")}
# family -> the MoE block's attribute in its published checkpoints, where it is not "mlp"
HUB_BLOCK = {"mixtral": "block_sparse_moe"}


def shards(cfg, dtype: torch.dtype) -> List[Dict]:
    """The checkpoint's shards: [{"file", "tensors": [(name, shape, what)], "bytes"}]: the
    tensors outside the decoder layers first, then one shard per layer."""
    model = lm.meta_model(cfg, dtype)
    family = cfg.model_type
    groups: Dict[str, List] = {}
    for name, t in model.state_dict().items():
        parts = name.split(".")
        key = f"layer{int(parts[2]):05d}" if parts[:2] == ["model", "layers"] else "base"
        groups.setdefault(key, []).extend(hub_tensors(name, tuple(t.shape), family))
    keys = ["base"] + sorted(k for k in groups if k != "base")
    esize = torch.empty(0, dtype=dtype).element_size()
    out = []
    for i, k in enumerate(keys):
        tensors = groups[k]
        nbytes = sum(esize * _numel(s) for _, s, _ in tensors)
        out.append({"file": f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors", "tensors": tensors,
                    "bytes": nbytes})
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- where the shards go -------------------------------------------------------------------------

def mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def is_ram_fs(path: str) -> bool:
    """tmpfs / ramfs (the files take host memory)."""
    try:
        best, fstype = "", ""
        path = os.path.realpath(path)
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
        return fstype in ("tmpfs", "ramfs")
    except OSError:
        return path.startswith("/dev/shm")


def fs_id(path: str) -> int:
    """The filesystem a folder is on (folders of one filesystem share its free space)."""
    return os.stat(path).st_dev


def plan_storage(sizes: List[int], roots: List[str], margin: int, ram_reserve: int) -> Tuple[List[Dict], List[int]]:
    """(the usable roots [{"root", "capacity", "ram"}], each shard's index into them); raises
    SystemExit, before anything is written, when the shards do not fit."""
    usable, seen = [], set()
    for root in roots:
        if not os.path.isdir(root):
            continue
        dev = fs_id(root)
        if dev in seen:           # two folders of one filesystem share its free space
            continue
        seen.add(dev)
        free = shutil.disk_usage(root).free - margin
        ram = is_ram_fs(root)
        if ram:
            avail = mem_available()
            if avail is not None:
                free = min(free, avail - ram_reserve)
        if free > 0:
            usable.append({"root": root, "capacity": free, "ram": ram})
    placement, left, k = [], [u["capacity"] for u in usable], 0
    for b in sizes:
        while k < len(usable) and left[k] < b:
            k += 1
        if k == len(usable):
            found = ", ".join(f"{u['root']}: {u['capacity'] / GiB:.1f} GiB usable" for u in usable) or "none"
            raise SystemExit(
                f"bench_load: the checkpoint needs {sum(sizes) / GiB:.1f} GiB ({len(sizes)} shards, the largest "
                f"{max(sizes) / GiB:.2f} GiB); the folders {roots} have {found} (after --margin-gib "
                f"{margin / GiB:g}, and for memory-backed folders --ram-reserve-gib {ram_reserve / GiB:g}). Name "
                "folders with room (--dirs A,B: shards spread over them) or write fewer layers (--layers N).")
        placement.append(k)
        left[k] -= b
    return usable, placement


# --- writing ----------------------------------------------------------------------------------------

def _drop_page_cache(path: str) -> bool:
    """Flushes a written file and drops it from the page cache (the load then reads the disk)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def write_checkpoint(cfg, dtype: torch.dtype, device: str, roots: List[str], args) -> Dict:
    """Writes the checkpoint (module docstring); returns where and how long it took."""
    from safetensors.torch import save_file

    plan = shards(cfg, dtype)
    sizes = [s["bytes"] for s in plan]
    usable, placement = plan_storage(sizes, roots, int(args.margin_gib * GiB), int(args.ram_reserve_gib * GiB))
    dirs = {}
    for k in sorted(set(placement)):
        dirs[k] = tempfile.mkdtemp(prefix="samoyeds-ckpt-", dir=usable[k]["root"])
        CLEANUP.append(dirs[k])
    main = dirs[placement[0]]
    total = sum(sizes)
    std = float(getattr(cfg, "initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    weight_map, t0, done, dropped = {}, time.perf_counter(), 0, 0
    print(f"writing {total / GiB:.1f} GiB in {len(plan)} shards to " +
          ", ".join(f"{dirs[k]} ({sum(b for b, p in zip(sizes, placement) if p == k) / GiB:.1f} GiB"
                    f"{', memory' if usable[k]['ram'] else ''})" for k in dirs), flush=True)
    for shard, k in zip(plan, placement):
        tensors = {}
        for name, shape, what in shard["tensors"]:
            if what == "matrix":
                t = torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, std, generator=gen).to(dtype)
            elif what == "norm":
                t = torch.ones(shape, device=device, dtype=dtype)
            else:
                t = torch.zeros(shape, device=device, dtype=dtype)
            tensors[name] = t
            weight_map[name] = shard["file"]
        host = {n: t.cpu() for n, t in tensors.items()}
        del tensors
        path = os.path.join(dirs[k], shard["file"])
        save_file(host, path, metadata={"format": "pt"})
        del host
        if not usable[k]["ram"] and not args.warm_cache:
            dropped += _drop_page_cache(path)
        if k != placement[0]:
            os.symlink(path, os.path.join(main, shard["file"]))
        done += shard["bytes"]
        el = time.perf_counter() - t0
        print(f"  {shard['file']}: {done / GiB:6.1f} / {total / GiB:.1f} GiB, {el:5.0f} s, "
              f"{done / max(el, 1e-9) / 1e9:.2f} GB/s", flush=True)
    with open(os.path.join(main, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    cfg.save_pretrained(main)
    write_s = time.perf_counter() - t0
    return {"dir": main, "dirs": list(dirs.values()), "shards": len(plan), "checkpoint_bytes": total,
            "write_s": write_s, "write_gb_s": total / write_s / 1e9, "page_cache_dropped_shards": dropped,
            "storage": [{"root": usable[k]["root"], "memory_backed": usable[k]["ram"],
                         "bytes": sum(b for b, p in zip(sizes, placement) if p == k)} for k in dirs]}


CLEANUP: List[str] = []


def _cleanup() -> None:
    for d in CLEANUP:
        shutil.rmtree(d, ignore_errors=True)
    CLEANUP.clear()


# --- loading ----------------------------------------------------------------------------------------

def _mem(device: str) -> Dict:
    if device != "cuda":
        return {}
    return {"allocated_bytes": torch.cuda.memory_allocated(), "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def _host_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load(path: str, device: str, dtype: torch.dtype, quantization_config=None):
    import transformers
    free_memory(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization_config, device_map=device, dtype=dtype, attn_implementation="sdpa")
    sync(device)
    return model, time.perf_counter() - t0


def sanity(model, device: str, args) -> Tuple[Dict, torch.Tensor]:
    V = model.config.vocab_size
    ids = torch.randint(3, V, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed + 1)).to(device)
    out: Dict = {"prompt": args.prompt}
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=1).logits.float()
        out["logits_finite"] = bool(torch.isfinite(logits).all())
        t0 = time.perf_counter()
        toks = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        sync(device)
        out["generate_s"] = time.perf_counter() - t0
        out["tokens"] = toks[0, args.prompt:].tolist()
    return out, logits.cpu()


def run(args) -> Dict:
    import transformers
    transformers.logging.set_verbosity_error()
    device, dtype = args.device, default_dtype(args.device)
    cfg = lm.config(args.model, tiny=args.tiny, layers=args.layers)
    full = lm.config(args.model, tiny=args.tiny).num_hidden_layers
    meta = lm.meta_model(cfg, dtype)
    dense_bytes = lm.param_bytes(meta)
    res: Dict = {"model": args.model, "layers": cfg.num_hidden_layers, "full_layers": full, "format": args.format,
                 "dtype": str(dtype).replace("torch.", ""), "params": sum(p.numel() for p in meta.parameters()),
                 "dense_bytes": dense_bytes}
    del meta
    if device == "cuda":
        res["device_bytes"] = torch.cuda.get_device_properties(0).total_memory
        fits = dense_bytes + args.dense_margin_gib * GiB <= res["device_bytes"]
    else:
        fits = True
    print(f"{args.model}: {res['layers']}/{full} layers, {res['params'] / 1e9:.2f} B parameters, "
          f"{dense_bytes / GiB:.1f} GiB dense" + (f"; device {res['device_bytes'] / GiB:.1f} GiB" if device == "cuda"
                                                  else ""), flush=True)
    roots = [d for d in (args.dirs.split(",") if args.dirs else [tempfile.gettempdir(), "/dev/shm"]) if d]
    res.update(write_checkpoint(cfg, dtype, device, roots, args))
    free_memory(device)
    path = res.pop("dir")
    res.pop("dirs")
    print(f"wrote {res['checkpoint_bytes'] / GiB:.1f} GiB in {res['write_s']:.0f} s "
          f"({res['write_gb_s']:.2f} GB/s); loading packed ...", flush=True)
    qc = sm.SamoyedsConfig(format=args.format, method="magnitude")
    host0 = _host_peak_bytes()
    model, load_s = load(path, device, dtype, qc)
    res.update(load_s=load_s, **_mem(device), host_peak_rss_bytes=_host_peak_bytes(), host_rss_before_bytes=host0,
               patched=sm.hf.is_patched(model), expert_bytes_packed=sm.hf.experts_weight_nbytes(model),
               resident_bytes=sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())))
    print(f"loaded packed in {load_s:.1f} s: " + (f"peak {res['peak_allocated_bytes'] / GiB:.1f} GiB, allocated "
          f"{res['allocated_bytes'] / GiB:.1f} GiB, " if device == "cuda" else "") +
          f"resident {res['resident_bytes'] / GiB:.2f} GiB, patched {res['patched']}", flush=True)
    try:
        res["sanity"], packed_logits = sanity(model, device, args)
        print(f"sanity: logits finite {res['sanity']['logits_finite']}, tokens {res['sanity']['tokens']}", flush=True)
    except Exception as exc:  # noqa: BLE001 - recorded; the dense comparison still runs
        res["sanity"], packed_logits = {"error": error_text(exc)}, None
        print(f"sanity: {error_text(exc)}", flush=True)
    del model
    free_memory(device)
    if not fits:
        res["dense_load"] = (f"does not fit ({dense_bytes / GiB:.1f} GiB dense + {args.dense_margin_gib:g} GiB > "
                             f"{res['device_bytes'] / GiB:.1f} GiB); not tried")
    elif args.dense:
        try:
            dense, dense_s = load(path, device, dtype)
            d = {"load_s": dense_s, **_mem(device)}
            sm.patch_model(dense, args.format, progress=False)
            with torch.inference_mode():
                ids = torch.randint(3, dense.config.vocab_size, (1, args.prompt),
                                    generator=torch.Generator().manual_seed(args.seed + 1)).to(device)
                ref = dense(ids, logits_to_keep=1).logits.float().cpu()
            if packed_logits is not None:
                d["packed_logits_equal_patch_model"] = bool(torch.equal(ref, packed_logits))
                d["packed_logits_max_abs_diff"] = (ref - packed_logits).abs().max().item()
            res["dense"] = d
            res["dense_load"] = (f"{dense_s:.0f} s" + (f", peak {d['peak_allocated_bytes'] / GiB:.1f} GiB"
                                                       if "peak_allocated_bytes" in d else ""))
            del dense
        except Exception as exc:  # noqa: BLE001
            res["dense_load"] = f"error: {error_text(exc)[:120]}"
        free_memory(device)
        print(f"dense load: {res['dense_load']}" + (f"; packed-on-load logits equal patch_model's: "
              f"{res['dense'].get('packed_logits_equal_patch_model')}" if "dense" in res else ""), flush=True)
    else:
        res["dense_load"] = "not run (--no-dense)"
    return res


def _summary(r: Dict) -> None:
    print(f"\n{'model':<14}{'layers':>8}{'checkpoint':>12}{'write':>8}{'load':>8}{'peak GPU':>10}{'resident':>10}"
          f"  dense load")
    if "load_s" not in r:
        print(f"{r.get('model', '?'):<14} error: {r.get('error')}")
        return
    pk = r.get("peak_allocated_bytes")
    print(f"{r['model']:<14}{r['layers']:>4}/{r['full_layers']:<3}{r['checkpoint_bytes'] / GiB:>9.1f} GiB"
          f"{r['write_s']:>6.0f} s{r['load_s']:>6.0f} s{(f'{pk / GiB:.1f} GiB' if pk else '-'):>10}"
          f"{r['resident_bytes'] / GiB:>6.1f} GiB  {r.get('dense_load')}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mixtral-8x7b", choices=sorted(lm.REAL))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real depth)")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--dirs", default=None,
                    help="folders for the checkpoint, filled in order (default: the temporary folder, then /dev/shm)")
    ap.add_argument("--margin-gib", type=float, default=2.0, help="space left free in each folder")
    ap.add_argument("--ram-reserve-gib", type=float, default=24.0,
                    help="memory-backed folders (/dev/shm): host memory left for the loading process")
    ap.add_argument("--dense-margin-gib", type=float, default=4.0,
                    help="the dense load runs only where dense bytes + this fit the device")
    ap.add_argument("--no-dense", dest="dense", action="store_false", help="skip the dense load even where it fits")
    ap.add_argument("--warm-cache", action="store_true",
                    help="leave the written shards in the page cache (default: dropped, the load reads the disk)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint (its folder is printed)")
    add_run_args(ap)
    args = ap.parse_args(argv)
    setup_run(args)
    if args.tiny:
        args.prompt, args.new_tokens = min(args.prompt, 8), min(args.new_tokens, 4)
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.keep:
        atexit.register(_cleanup)
    t0 = time.perf_counter()
    try:
        res = run(args)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        res = {"model": args.model, "error": error_text(exc)}
        print(f"error: {error_text(exc)}", flush=True)
    res["seconds"] = time.perf_counter() - t0
    if args.keep and CLEANUP:
        print(f"kept the checkpoint: {CLEANUP[0]}")
    else:
        _cleanup()
    path = result_path(args, "load.json")
    if path:
        write_json(path, {"env": environment(), "settings": {
            "model": args.model, "layers": args.layers, "format": args.format, "warm_cache": args.warm_cache,
            "prompt": args.prompt, "new_tokens": args.new_tokens}, "cases": [res]})
    _summary(res)
    if "error" in res:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
