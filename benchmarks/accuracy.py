"""Accuracy study: how much held-out perplexity a small MoE causal LM trained on
real text loses when its experts are pruned to the Samoyeds format, next to plain
2:4, unstructured 75 % and VENOM-style 75 %, for each mask selection method, and
how much a short masked fine-tune wins back.

Data: the Python standard library's own ``.py`` files (every machine has them),
read as bytes (byte-level tokens, vocabulary 256; files joined by a 0 byte), split
into train / held-out *by file* with a hash of the relative path (fixed, no
randomness).  Model: a Qwen3-MoE causal LM built from a ``transformers`` config
(``samoyeds.hf.families``), trained from a seed.  Only the routed experts are
pruned (attention, router, embeddings stay dense); "75 %" is the sparsity of the
expert weights.

Modes: ``gpu`` (about 29 M parameters, 16 experts top-2, seq 512, a few minutes on
an H100 with bf16 autocast), ``cpu`` (about 7 M parameters, about half an hour on two
cores) and ``test`` (seconds; the test suite runs it).

  python benchmarks/accuracy.py --device cuda --out DIR     (the GPU study -> DIR/accuracy.json)
  python benchmarks/accuracy.py --mode cpu --out DIR        (the CPU-sized study)

Results are written after every variant, so an interrupted run keeps what it measured.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import math
import os
import sys
import sysconfig
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SEP = 0   # byte joining files


@dataclass(frozen=True)
class Mode:
    hidden: int
    layers: int
    experts: int
    top_k: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    batch: int
    steps: int
    lr: float
    warmup: int
    ft_steps: int
    ft_lr: float
    calib_seqs: int
    eval_seqs: int
    venom: str = "venom-128:2:8"
    weight_decay: float = 0.1
    aux_loss: float = 0.01
    max_files: int = 0            # 0: the whole corpus


MODES: Dict[str, Mode] = {
    # ~29 M parameters (25 M in experts); gate_up has 4 slices of 128 columns, down 2
    "gpu": Mode(hidden=512, layers=4, experts=16, top_k=2, intermediate=256, heads=8, kv_heads=4, head_dim=64,
                seq=512, batch=48, steps=3000, lr=2e-3, warmup=200, ft_steps=300, ft_lr=5e-4,
                calib_seqs=128, eval_seqs=512),
    # ~7.2 M parameters (6.3 M in experts); 2 slices per row in both projections
    "cpu": Mode(hidden=256, layers=4, experts=8, top_k=2, intermediate=256, heads=4, kv_heads=2, head_dim=64,
                seq=128, batch=16, steps=1000, lr=3e-3, warmup=100, ft_steps=150, ft_lr=1e-3,
                calib_seqs=64, eval_seqs=256),
    "test": Mode(hidden=64, layers=2, experts=8, top_k=2, intermediate=64, heads=2, kv_heads=1, head_dim=32,
                 seq=64, batch=8, steps=120, lr=5e-3, warmup=10, ft_steps=20, ft_lr=1e-3,
                 calib_seqs=16, eval_seqs=32, venom="venom-64:2:8", max_files=400),
}

FORMAT = "samoyeds-1:2:128"
METHODS = ("magnitude", "activation", "sparsegpt")


# --- corpus ---------------------------------------------------------------------------------------

def stdlib_files(root: Optional[str] = None) -> Tuple[str, List[str]]:
    """The standard library's ``.py`` files (relative paths, sorted), without installed packages."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return root, sorted(out)


def is_heldout(rel: str, pct: int = 5) -> bool:
    """Fixed split by file: a hash of the relative path (no randomness)."""
    return int(hashlib.sha1(rel.replace(os.sep, "/").encode()).hexdigest()[:8], 16) % 100 < pct


def load_corpus(max_files: int = 0, heldout_pct: int = 5) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, held-out bytes) as uint8 tensors, and a description of the corpus."""
    root, files = stdlib_files()
    if max_files:
        step = max(1, len(files) // max_files)
        files = files[::step][:max_files]
    parts = {True: [], False: []}
    n_files = {True: 0, False: 0}
    for rel in files:
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read()
        h = is_heldout(rel, heldout_pct)
        parts[h].append(data)
        n_files[h] += 1
    sep = bytes([SEP])
    train = np.frombuffer(sep.join(parts[False]), dtype=np.uint8).copy()
    held = np.frombuffer(sep.join(parts[True]), dtype=np.uint8).copy()
    info = {"source": "python stdlib .py files", "root": root, "python": sys.version.split()[0],
            "files_train": n_files[False], "files_heldout": n_files[True], "bytes_train": int(train.size),
            "bytes_heldout": int(held.size), "heldout_rule": f"sha1(relative path) % 100 < {heldout_pct}",
            "sha256_train": hashlib.sha256(train.tobytes()).hexdigest()[:16]}
    return torch.from_numpy(train), torch.from_numpy(held), info


def random_windows(data: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, length]`` int64 windows at random offsets."""
    starts = torch.randint(0, data.numel() - length, (n,), generator=gen)
    return torch.stack([data[s:s + length] for s in starts.tolist()]).long()


def eval_windows(data: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``[n, length]`` windows evenly spaced over ``data`` (fixed)."""
    n = min(n, data.numel() // length)
    starts = torch.linspace(0, data.numel() - length, n).long()
    return torch.stack([data[s:s + length] for s in starts.tolist()]).long()


# --- model, training, evaluation -----------------------------------------------------------------

def build(mode: Mode, seed: int, device: str) -> torch.nn.Module:
    from samoyeds.hf.families import Shape, build_model

    shape = Shape(vocab=256, hidden=mode.hidden, layers=mode.layers, experts=mode.experts, top_k=mode.top_k,
                  intermediate=mode.intermediate, heads=mode.heads, kv_heads=mode.kv_heads, head_dim=mode.head_dim,
                  max_positions=mode.seq, init_std=0.02)
    model = build_model("qwen3_moe", shape, seed=seed, output_router_logits=True,
                        router_aux_loss_coef=mode.aux_loss, tie_word_embeddings=False)
    return model.to(device)


def _autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _expert_params(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    out = {}
    for name, mod in model.named_modules():
        for proj in ("gate_up_proj", "down_proj"):
            p = mod._parameters.get(proj)
            if p is not None and p.dim() == 3:
                out[f"{name}.{proj}"] = p
    return out


def masks_by_param(masks: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    return {f"{mod}.{proj}": m for mod, mm in masks.items() for proj, m in mm.items()}


def train(model: torch.nn.Module, data: torch.Tensor, mode: Mode, *, steps: int, lr: float, warmup: int,
          seed: int, device: str, masks: Optional[Dict[str, torch.Tensor]] = None, log_every: int = 100,
          label: str = "train") -> List[float]:
    """AdamW with warmup and cosine decay on random windows; with ``masks`` (by
    parameter name) the masked expert weights stay exactly zero (masked gradients,
    re-masked after every step).  Returns the loss of every step."""
    model.train()
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": mode.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    params = _expert_params(model)
    if masks:
        pm = [(params[k], masks[k].to(device)) for k in masks]
    losses = []
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warmup)
        ids = random_windows(data, mode.batch, mode.seq, gen).to(device, non_blocking=True)
        with _autocast(device):
            out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{label}: loss is {loss.item()} at step {step}")
        loss.backward()
        if masks:
            for p, m in pm:
                p.grad.mul_(m)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masks:
            with torch.no_grad():
                for p, m in pm:
                    p.mul_(m)
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            recent = sum(losses[-log_every:]) / log_every
            print(f"  {label} step {step + 1}/{steps}: loss {recent:.4f} ({time.time() - t0:.0f} s)", flush=True)
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, device: str, batch: int = 16,
             autocast: bool = True) -> float:
    """Mean next-byte cross-entropy (nats) over every predicted position of ``windows``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch].to(device)
        ctx = _autocast(device) if autocast else torch.autocast("cpu", enabled=False)
        with ctx:
            logits = model(input_ids=ids, use_cache=False, output_router_logits=False).logits
        lp = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                               ids[:, 1:].reshape(-1), reduction="sum")
        total += float(lp)
        count += ids[:, 1:].numel()
    return total / count


def experts_output_error(pruned: torch.nn.Module, dense: torch.nn.Module, windows: torch.Tensor,
                         device: str) -> float:
    """Relative L2 error of every experts module's output, pruned vs dense, on the same
    module inputs (the dense model's), summed over modules and averaged."""
    import samoyeds.hf as shf

    errs = []
    dmods = {t.name: t.experts for t in shf.experts.find_experts(dense)}
    pmods = {t.name: t.experts for t in shf.experts.find_experts(pruned)}
    for name, dm in dmods.items():
        pm = pmods[name]
        num = den = 0.0
        cap = []
        h = dm.register_forward_hook(lambda m, a, o: cap.append((a, o)))
        try:
            with torch.no_grad():
                dense(input_ids=windows.to(device), use_cache=False)
        finally:
            h.remove()
        with torch.no_grad():
            for args, out in cap:
                got = pm(*args)
                num += float((got.float() - out.float()).pow(2).sum())
                den += float(out.float().pow(2).sum())
        errs.append(math.sqrt(num / max(den, 1e-30)))
    return sum(errs) / len(errs)


def state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# --- the study ------------------------------------------------------------------------------------

@dataclass
class Variant:
    name: str
    pattern: Optional[str]
    method: Optional[str]
    finetune: bool
    options: Optional[dict] = None


def variants(mode: Mode, methods=METHODS) -> List[Variant]:
    out = [Variant("dense", None, None, False)]
    for m in methods:
        out.append(Variant(f"2:4 {m}", "2:4", m, False))
    for pat, label in (("unstructured-75", "unstructured 75%"), (mode.venom, "VENOM-style 75%"),
                       (FORMAT, "Samoyeds 75%")):
        if pat == FORMAT and "magnitude" in methods:
            # samoyeds.patch_model's own magnitude rule: gate and up rows chosen separately
            out.append(Variant(f"{label} magnitude, per-half rows", pat, "magnitude", False, {"glu_joint": False}))
        for m in methods:
            out.append(Variant(f"{label} {m}", pat, m, True))
    return out


def _table(rows: List[dict], dense_ppl: float) -> str:
    lines = [f"{'variant':45s} {'pattern':18s} {'sparsity':>8s} {'ppl':>8s} {'vs dense':>9s} "
             f"{'ppl +ft':>8s} {'ft vs dense':>11s}"]
    for r in rows:
        if "ppl" not in r:
            lines.append(f"{r['name']:45s} {r.get('pattern') or '-':18s} error: {r.get('error', '?')[:60]}")
            continue
        ft = r.get("finetuned") or {}
        ftp = f"{ft['ppl']:8.3f}" if "ppl" in ft else f"{'-':>8s}"
        ftr = f"{ft['ppl'] / dense_ppl - 1:+10.1%}" if "ppl" in ft else f"{'-':>11s}"
        lines.append(f"{r['name']:45s} {r.get('pattern') or '-':18s} {r.get('sparsity', 0):8.0%} "
                     f"{r['ppl']:8.3f} {r['ppl'] / dense_ppl - 1:+9.1%} {ftp} {ftr}")
    return "\n".join(lines)


def run(mode_name: str = "cpu", device: str = "cpu", seed: int = 0, out: Optional[str] = None,
        methods=METHODS, overrides: Optional[dict] = None, checkpoint: bool = True,
        log: Callable[[str], None] = print) -> dict:
    """Runs the study; returns the results (and writes ``out/accuracy.json`` when ``out``)."""
    import samoyeds as sm
    import samoyeds.sparsify as sp

    mode = replace(MODES[mode_name], **(overrides or {}))
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        # bitwise-reproducible training where the ops allow it (warn, never fail, where one cannot)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("highest")
    t_start = time.time()
    train_data, held, corpus = load_corpus(mode.max_files)
    log(f"corpus: {corpus['files_train']} + {corpus['files_heldout']} files, {corpus['bytes_train'] / 1e6:.1f} + "
        f"{corpus['bytes_heldout'] / 1e6:.2f} MB (train + held-out) from {corpus['root']}")
    ev = eval_windows(held, mode.eval_seqs, mode.seq)
    calib = list(random_windows(train_data, mode.calib_seqs, mode.seq, torch.Generator().manual_seed(seed + 7))
                 .split(max(1, min(16, mode.calib_seqs))))

    result: Dict[str, Any] = {"study": "accuracy", "mode": mode_name, "config": asdict(mode), "seed": seed,
                              "device": device, "corpus": corpus, "format": FORMAT,
                              "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    try:
        from common import environment
        result["environment"] = environment()
    except Exception as e:  # the study must not die on a metadata problem
        result["environment"] = {"error": repr(e)}

    def save(final: bool = False) -> None:
        if out:
            import contextlib
            import io

            from common import write_json
            os.makedirs(out, exist_ok=True)
            with contextlib.redirect_stdout(sys.stdout if final else io.StringIO()):
                write_json(os.path.join(out, "accuracy.json"), result)

    model = build(mode, seed, device)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for p in _expert_params(model).values())
    result["model"] = {"family": "qwen3_moe", "parameters": n_params, "expert_parameters": n_expert}
    log(f"model: qwen3_moe, {n_params / 1e6:.2f} M parameters ({n_expert / 1e6:.2f} M in experts), {mode}")

    impl = "eager"
    if device.startswith("cuda"):
        impl = _pick_training_implementation(model, train_data, mode, device, log)
    model.set_experts_implementation(impl)
    result["training_experts_implementation"] = impl

    t0 = time.time()
    losses = train(model, train_data, mode, steps=mode.steps, lr=mode.lr, warmup=mode.warmup, seed=seed + 1,
                   device=device, log_every=max(1, mode.steps // 10))
    model.set_experts_implementation("eager")
    dense_loss = evaluate(model, ev, device)
    result["training"] = {"seconds": round(time.time() - t0, 1), "first_train_loss": losses[0],
                          "final_train_loss": sum(losses[-50:]) / len(losses[-50:]),
                          "loss_every_100": [round(sum(losses[i:i + 100]) / len(losses[i:i + 100]), 4)
                                             for i in range(0, len(losses), 100)],
                          "dense_state_sha256": state_hash(model)}
    log(f"dense: held-out loss {dense_loss:.4f} nats/byte, ppl {math.exp(dense_loss):.3f} "
        f"({time.time() - t0:.0f} s training)")
    dense = model
    rows: List[dict] = []
    result["variants"] = rows
    # a dense model fine-tuned for the same steps: what the extra training alone gives
    ft_seed = seed + 2

    def finetune(m: torch.nn.Module, masks: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """The same short fine-tune for every variant (evaluated with the eager experts after)."""
        m.set_experts_implementation(impl)
        train(m, train_data, mode, steps=mode.ft_steps, lr=mode.ft_lr, warmup=mode.ft_steps // 10, seed=ft_seed,
              device=device, masks=masks, log_every=0)
        m.set_experts_implementation("eager")

    ft_dense = copy.deepcopy(dense)
    finetune(ft_dense)
    rows.append({"name": "dense", "pattern": None, "method": None, "sparsity": 0.0, "loss": dense_loss,
                 "ppl": math.exp(dense_loss),
                 "finetuned": {"loss": (l := evaluate(ft_dense, ev, device)), "ppl": math.exp(l)}})
    del ft_dense
    save()

    best: Dict[str, Any] = {}
    for v in variants(mode, methods)[1:]:
        row: Dict[str, Any] = {"name": v.name, "pattern": v.pattern, "method": v.method, "options": v.options}
        rows.append(row)
        t0 = time.time()
        try:
            pm = copy.deepcopy(dense)
            masks = sp.prune_model(pm, v.pattern, v.method, calib, progress=False, **(v.options or {}))
            flat = masks_by_param(masks)
            kept = sum(int(m.sum()) for m in flat.values())
            row["sparsity"] = 1.0 - kept / n_expert
            row["loss"] = evaluate(pm, ev, device)
            row["ppl"] = math.exp(row["loss"])
            row["experts_output_error"] = experts_output_error(pm, dense, ev[:max(4, mode.eval_seqs // 8)], device)
            row["prune_seconds"] = round(time.time() - t0, 2)
            if v.finetune:
                finetune(pm, flat)
                still = all(bool((p[~flat[k]] == 0).all()) for k, p in _expert_params(pm).items())
                loss = evaluate(pm, ev, device)
                row["finetuned"] = {"loss": loss, "ppl": math.exp(loss), "masks_held": still}
            if v.pattern == FORMAT and "finetuned" in row and (not best or row["finetuned"]["ppl"] < best["ppl"]):
                best = {"ppl": row["finetuned"]["ppl"], "method": v.method, "masks": masks, "model": pm}
            log(f"{v.name:45s} ppl {row['ppl']:.3f}"
                + (f"  after fine-tune {row['finetuned']['ppl']:.3f}" if "finetuned" in row else "")
                + f"  (experts output error {row['experts_output_error']:.3f}, {time.time() - t0:.0f} s)")
            del pm
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-2000:]
            log(f"{v.name}: FAILED {row['error']}")
        save()

    if checkpoint and best:
        try:
            result["packed"] = _packed_check(best, ev if device.startswith("cuda") else ev[:64], device, log)
        except Exception as e:
            result["packed"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            log(f"packed model check FAILED: {result['packed']['error']}")
    result["targets"] = targets(rows)
    result["seconds"] = round(time.time() - t_start, 1)
    save(final=True)
    log("")
    log(f"held-out perplexity (bytes), {mode_name} mode on {device}; dense ppl {math.exp(dense_loss):.3f}")
    log(_table(rows, math.exp(dense_loss)))
    for k, v in result["targets"].items():
        log(f"target {k}: {v}")
    return result


def _pick_training_implementation(model, data, mode, device, log) -> str:
    """grouped_mm when one forward/backward works under autocast on this device, else eager."""
    for impl in ("grouped_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            ids = random_windows(data, 2, mode.seq, torch.Generator().manual_seed(123)).to(device)
            with _autocast(device):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return impl
        except Exception as e:
            model.zero_grad(set_to_none=True)
            log(f"experts implementation {impl} unusable for training here: {type(e).__name__}: {e}")
    raise RuntimeError("no experts implementation trains on this device")


def _packed_check(best: dict, ev: torch.Tensor, device: str, log: Callable[[str], None]) -> dict:
    """The best fine-tuned Samoyeds-75 % model packed (samoyeds.patch_model): perplexity
    through the samoyeds kernels vs the same masked weights in transformers' eager experts
    (bf16 on a GPU, fp32 on the CPU); the packed checkpoint's size (bf16 and fp32, packed
    on the CPU) and its round trip on the device.  Each step records its own error."""
    import tempfile

    import samoyeds as sm
    from samoyeds.checkpoint import checkpoint_sizes

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    masked = best["model"].to(dtype)
    out: Dict[str, Any] = {"method": best["method"], "dtype": str(dtype).replace("torch.", ""),
                           "eval_windows": int(ev.shape[0])}

    def step(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"
            out[f"{name}_traceback"] = traceback.format_exc()[-2000:]
            log(f"packed model check, {name}: FAILED {out[f'{name}_error']}")

    def through_samoyeds() -> None:
        out["masked_dense_ppl"] = math.exp(evaluate(masked, ev, device, autocast=False))
        packed = copy.deepcopy(masked)
        sm.patch_model(packed, FORMAT, progress=False, masks=best["masks"])
        t0 = time.time()
        out["samoyeds_loss"] = evaluate(packed, ev, device, autocast=False)
        out["samoyeds_ppl"] = math.exp(out["samoyeds_loss"])
        out["eval_seconds"] = round(time.time() - t0, 2)
        log(f"packed Samoyeds model ({best['method']}, {out['dtype']}): ppl {out['samoyeds_ppl']:.4f} through "
            f"samoyeds vs {out['masked_dense_ppl']:.4f} masked dense")

    step("samoyeds", through_samoyeds)
    with tempfile.TemporaryDirectory() as d:
        for dt in (torch.bfloat16, torch.float32):
            name = str(dt).replace("torch.", "")
            path = os.path.join(d, name)

            def checkpoint() -> None:
                m = copy.deepcopy(masked).to(device="cpu", dtype=dt)
                sm.patch_model(m, FORMAT, progress=False, masks=best["masks"])
                sm.save_pretrained(m, path)
                sizes = checkpoint_sizes(path)
                out[f"checkpoint_{name}"] = sizes
                log(f"checkpoint ({name}): experts file {sizes['experts_file_bytes'] / 1e6:.2f} MB = "
                    f"{sizes['file_fraction']:.1%} of the dense experts' {sizes['dense_experts_bytes'] / 1e6:.2f} MB "
                    f"(packed arrays {sizes['packed_fraction']:.1%})")

            def reload() -> None:
                back = sm.from_pretrained(path, device=device)
                loss = evaluate(back, ev, device, autocast=False)
                out["reloaded_ppl"] = math.exp(loss)
                out["reloaded_equal"] = loss == out.get("samoyeds_loss")

            step(f"checkpoint_{name}", checkpoint)
            if dt == dtype and f"checkpoint_{name}" in out:
                step("reload", reload)
    return out


def targets(rows: List[dict]) -> dict:
    """The study's targets, checked on its numbers."""
    by = {r["name"]: r for r in rows if "ppl" in r}
    out: Dict[str, Any] = {}
    dense = by.get("dense")
    if not dense:
        return out
    d = dense["ppl"]
    mag = by.get("Samoyeds 75% magnitude")
    half = by.get("Samoyeds 75% magnitude, per-half rows")
    cal = [by[f"Samoyeds 75% {m}"] for m in ("activation", "sparsegpt") if f"Samoyeds 75% {m}" in by]
    if mag and cal:
        c = min(cal, key=lambda r: r["ppl"])
        out["calibrated_loses_at_most_half_of_magnitude"] = {
            "method": c["method"], "calibrated_ppl_increase": c["ppl"] - d,
            "magnitude_ppl_increase": mag["ppl"] - d, "met": (c["ppl"] - d) <= 0.5 * (mag["ppl"] - d)}
        if half:
            out["calibrated_loses_at_most_half_of_magnitude"].update(
                patch_model_magnitude_ppl_increase=half["ppl"] - d,
                met_vs_patch_model_magnitude=(c["ppl"] - d) <= 0.5 * (half["ppl"] - d))
    ft = [r for r in by.values() if r.get("pattern") == FORMAT and "ppl" in (r.get("finetuned") or {})]
    if ft:
        b = min(ft, key=lambda r: r["finetuned"]["ppl"])
        out["finetuned_within_10pct_of_dense"] = {"method": b["method"], "ppl": b["finetuned"]["ppl"],
                                                 "dense_ppl": d, "met": b["finetuned"]["ppl"] <= 1.1 * d}
        venom = [r for r in by.values() if (r.get("pattern") or "").startswith("venom")
                 and "ppl" in (r.get("finetuned") or {})]
        if venom:
            vb = min(venom, key=lambda r: r["finetuned"]["ppl"])
            out["finetuned_at_least_as_good_as_venom"] = {
                "samoyeds": b["finetuned"]["ppl"], "venom": vb["finetuned"]["ppl"], "venom_method": vb["method"],
                "met": b["finetuned"]["ppl"] <= vb["finetuned"]["ppl"]}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=sorted(MODES), default=None,
                    help="study size (default: gpu on cuda, cpu otherwise)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for accuracy.json (default: benchmarks/results/<gpu>/)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=None, help="override the training steps of the mode")
    args = ap.parse_args(argv)
    mode = args.mode or ("gpu" if args.device.startswith("cuda") else "cpu")
    if args.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")    # before cuBLAS starts
    overrides = {"steps": args.steps} if args.steps else None
    from common import gpu_dir

    out = gpu_dir(args.out) if (args.out or args.device.startswith("cuda")) else args.out
    if args.device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    run(mode, args.device, args.seed, out, tuple(args.methods.split(",")), overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
