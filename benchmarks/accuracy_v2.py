"""Accuracy study v2 (issue 42): does 75 % Samoyeds sparsity of the experts keep model quality?

Protocol (docs/ACCURACY.md has the whole of it):

* Corpus (benchmarks/accuracy_v2_data.py): the ``.py`` files of the Python distributions
  installed in the running environment, held out by package, near-duplicate lines removed
  from train, plus English text of pinned Debian packages' docs; a byte-level BPE tokenizer
  trained offline.  Names, versions, bytes and sha256 are recorded.
* Two MoE causal LMs built from transformers' own configs: ``mixtral`` (8 experts, top-2) and
  ``finegrained`` (Qwen3-MoE, 32 experts, top-8, experts 1/4 as wide: the same total and
  active parameters), each pretrained once per seed for under one epoch (the held-out loss
  curve recorded), cached and reused by every variant.
* Variants, 75 % of the expert weights unless stated: dense; dense + the same fine-tune;
  experts removed (floor); a MoE with experts 1/4 as wide pretrained from scratch at equal
  total compute (pretraining + the 1 % fine-tune); 2:4 (50 %); unstructured 75 %; VENOM
  128:2:8 (columns chosen by group-OBS cost under sparsegpt, as Samoyeds' rows are; the lazy
  per-weight choice reported too); Samoyeds 1:2:128, 1:2:32 and 1:2:16 (v = 16 is below the
  kernels' 32-column step: mask only, not packable); each with magnitude, Wanda
  (activation), SparseGPT mask only and SparseGPT with reconstruction.
* Metrics on held-out code (and English): token perplexity, bits per byte, next-token
  accuracy; one-shot and after experts-only and all-parameter fine-tunes at 1 % and 5 % of
  the pretraining tokens, through the masked dense weights and, for packable formats,
  through samoyeds' own backward (patched model, packed values as Parameters).
* Seeds: mean and std over the seeds; targets count as met only beyond 2 sigma of the
  per-seed paired differences, and only if the held-out seed (not run while the study was
  developed, flagged in the JSON) agrees.

Stages (checkpoints are cached under --cache, so a study can run across sessions):

  python benchmarks/accuracy_v2.py --plan                               (GPU time per stage)
  python benchmarks/accuracy_v2.py --stage data                         (corpus + tokenizer)
  python benchmarks/accuracy_v2.py --stage pretrain --model mixtral --seed 0
  python benchmarks/accuracy_v2.py --stage quarter  --model mixtral --seed 0
  python benchmarks/accuracy_v2.py --stage variants --model mixtral --seed 0 --max-minutes 9
  python benchmarks/accuracy_v2.py --stage merge [--plot]               (-> <out>/accuracy_v2.json)
  python benchmarks/accuracy_v2.py --tiny --device cpu --out DIR        (everything, tiny, ~1 min)
"""
from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import samoyeds  # noqa: F401
except ImportError:                       # run from a source tree built in place
    sys.path.insert(1, os.path.dirname(HERE))
import accuracy_v2_data as data  # noqa: E402

STUDY = "accuracy_v2"


# --- sizes ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelCfg:
    family: str
    hidden: int
    layers: int
    experts: int
    top_k: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Size:
    corpus: data.CorpusSpec
    models: Tuple[Tuple[str, ModelCfg], ...]
    seq: int
    batch: int
    pretrain_tokens: int              # capped at max_epoch_frac of the train tokens
    lr: float
    ft_lr: float
    calib_seqs: int
    eval_code_tokens: int
    eval_english_tokens: int
    curve_points: int
    curve_tokens: int
    seeds: Tuple[int, ...]
    heldout_seeds: Tuple[int, ...]
    max_epoch_frac: float = 0.9
    warmup_frac: float = 0.06
    weight_decay: float = 0.1
    aux_loss: float = 0.01
    ft_fracs: Tuple[float, ...] = (0.01, 0.05)
    ft_scopes: Tuple[str, ...] = ("experts", "all")
    error_seqs: int = 8
    assumed_tflops: float = 60.0      # effective bf16 training rate for --plan before a measured one exists
    samoyeds_train_slowdown: float = 1.6


SIZES: Dict[str, Size] = {
    # ~89 M parameters each (76 M in experts), ~26 M active; ~200 MB of code, 8 k BPE
    "gpu": Size(
        corpus=data.CorpusSpec(max_bytes=200_000_000, max_package_bytes=40_000_000, english_max_bytes=8_000_000,
                               vocab=8192),
        models=(("mixtral", ModelCfg("mixtral", 512, 6, 8, 2, 1024, 8, 4, 64)),
                ("finegrained", ModelCfg("qwen3_moe", 512, 6, 32, 8, 256, 8, 4, 64))),
        seq=512, batch=64, pretrain_tokens=40_000_000, lr=1.5e-3, ft_lr=3e-4, calib_seqs=128,
        eval_code_tokens=1_048_576, eval_english_tokens=262_144, curve_points=20, curve_tokens=131_072,
        seeds=(0, 1, 2), heldout_seeds=(3,)),
    # seconds on a CPU: every stage, every variant, 2 seeds (the second flagged held out)
    "tiny": Size(
        corpus=data.CorpusSpec(max_bytes=1_200_000, max_package_bytes=100_000, english_max_bytes=120_000, vocab=320),
        models=(("mixtral", ModelCfg("mixtral", 64, 1, 8, 2, 64, 2, 1, 32)),
                ("finegrained", ModelCfg("qwen3_moe", 64, 1, 16, 4, 32, 2, 1, 32))),
        seq=64, batch=8, pretrain_tokens=100 * 512, lr=1e-2, ft_lr=2e-3, calib_seqs=8,
        eval_code_tokens=4096, eval_english_tokens=1024, curve_points=4, curve_tokens=1024,
        seeds=(0,), heldout_seeds=(1,), error_seqs=2),
}

METHODS = {  # name -> (samoyeds.sparsify method, reconstruct)
    "magnitude": ("magnitude", True),
    "wanda": ("activation", True),
    "sparsegpt-mask": ("sparsegpt", False),
    "sparsegpt": ("sparsegpt", True),
}
CALIBRATED_PRIMARY = "wanda"          # sparsify_model's default; the targets' pre-registered choice
FORMAT = "samoyeds-1:2:128"


class SubSlicePattern:
    """Samoyeds-style row selection with a slice below the kernels' 32 columns (v = 16):
    ``n`` of every ``m`` rows per ``v``-column slice, 2:4 inside; masked dense weights only
    (no SparseFormat exists for it, nothing packs it).  The mask is ``samoyeds.mask`` of
    1:2:32 applied to every 16-column slice on its own (a GLU weight's gate and up slices
    side by side, as FormatPattern does), so selection is the same machinery."""

    def __new__(cls, n: int, m: int, v: int):
        from samoyeds.sparsity_patterns import FormatPattern

        class _P(FormatPattern):
            def __init__(self) -> None:
                self.fmt = SimpleNamespace(n=n, m=m, v=v, selects_rows=True, name=f"samoyeds-{n}:{m}:{v}")
                self.name = f"samoyeds-{n}:{m}:{v}"
                self.density = n / m / 2
                self.block = 128 // v * v
                self.lazy = 4

            def mask(self, scores: torch.Tensor, glu: bool = False) -> torch.Tensor:
                from samoyeds import SparseFormat, mask as fmask

                s = scores.float()
                E, R, C = s.shape
                S = C // v
                if glu:
                    I = R // 2
                    x = torch.cat([s[:, :I].reshape(E, I, S, v), s[:, I:].reshape(E, I, S, v)], -1)   # [E, I, S, 2v]
                    rows, w = I, 2 * v
                else:
                    x, rows, w = s.reshape(E, R, S, v), R, v
                x = x.permute(0, 2, 1, 3).reshape(E * S, rows, w).contiguous()
                k = fmask(x, SparseFormat(n, m, 32 * ((w + 31) // 32)), scores=x)
                k = k.reshape(E, S, rows, w).permute(0, 2, 1, 3)
                if glu:
                    return torch.cat([k[..., :v].reshape(E, I, C), k[..., v:].reshape(E, I, C)], dim=1)
                return k.reshape(E, R, C)

            def check(self, R: int, C: int, what: str) -> None:
                if C % v or R % m:
                    raise ValueError(f"{what}: [{R}, {C}] does not fit {self.name}")

        return _P()


def patterns(lazy_venom: bool = True) -> List[dict]:
    """The pruned variants' patterns: label, the pattern, the packable format (or None)."""
    from samoyeds.sparsity_patterns import Venom

    out = [dict(label="2:4", pattern="2:4", fmt="2:4", sparsity=0.5),
           dict(label="unstructured-75", pattern="unstructured-75", fmt=None, sparsity=0.75),
           dict(label="venom-128:2:8", pattern=Venom(128, 2, 8, columns="obs"), fmt=None, sparsity=0.75)]
    if lazy_venom:
        out.append(dict(label="venom-128:2:8 lazy-columns", pattern=Venom(128, 2, 8), fmt=None, sparsity=0.75,
                        methods=("sparsegpt-mask", "sparsegpt")))
    out += [dict(label="samoyeds-1:2:128", pattern="samoyeds-1:2:128", fmt="samoyeds-1:2:128", sparsity=0.75),
            dict(label="samoyeds-1:2:32", pattern="samoyeds-1:2:32", fmt="samoyeds-1:2:32", sparsity=0.75),
            dict(label="samoyeds-1:2:16", pattern=SubSlicePattern(1, 2, 16), fmt=None, sparsity=0.75,
                 note="v = 16 is below the kernels' 32-column step: masked dense only, not packable")]
    return out


def ft_configs(size: Size) -> List[Tuple[str, str, float]]:
    return [(f"{scope}-{frac * 100:g}%", scope, frac) for frac in size.ft_fracs for scope in size.ft_scopes]


def ft_wanted(matrix: str, variant: str, method: Optional[str], cfg: str) -> bool:
    """Which fine-tunes a variant gets: "full": all; "core": the 1 % experts-only one for every
    variant, all of them for dense and the calibrated Samoyeds 1:2:128 / VENOM / unstructured."""
    if matrix == "full" or cfg == "experts-1%":
        return True
    if variant == "dense":
        return True
    return method in ("wanda", "sparsegpt") and any(variant.startswith(p) for p in
                                                    ("samoyeds-1:2:128 ", "venom-128:2:8 w", "venom-128:2:8 s",
                                                     "unstructured-75 "))


# --- models ---------------------------------------------------------------------------------------

def build(cfg: ModelCfg, vocab: int, seq: int, seed: int, size: Size, device: str) -> torch.nn.Module:
    from samoyeds.hf.families import Shape, build_model

    shape = Shape(vocab=vocab, hidden=cfg.hidden, layers=cfg.layers, experts=cfg.experts, top_k=cfg.top_k,
                  intermediate=cfg.intermediate, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                  max_positions=seq, init_std=0.02)
    model = build_model(cfg.family, shape, seed=seed, output_router_logits=True,
                        router_aux_loss_coef=size.aux_loss, tie_word_embeddings=False, pad_token_id=None,
                        bos_token_id=0, eos_token_id=0)
    return model.to(device)


def flops_per_token(cfg: ModelCfg, vocab: int, seq: int, train: bool = True) -> float:
    """Matmul FLOPs per token (x3 for a training step's forward + backward)."""
    H, L = cfg.hidden, cfg.layers
    attn = H * cfg.heads * cfg.head_dim * 2 + H * cfg.kv_heads * cfg.head_dim * 2
    experts = cfg.top_k * 3 * H * cfg.intermediate
    per_layer = 2 * (attn + experts + H * cfg.experts) + 4 * seq * cfg.heads * cfg.head_dim
    f = L * per_layer + 2 * H * vocab
    return 3 * f if train else f


def counts(model: torch.nn.Module) -> dict:
    n = sum(p.numel() for p in model.parameters())
    e = sum(p.numel() for p in expert_params(model).values())
    return {"parameters": n, "expert_parameters": e}


def expert_params(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    out = {}
    for name, mod in model.named_modules():
        for proj in ("gate_up_proj", "down_proj"):
            p = mod._parameters.get(proj)
            if p is not None and p.dim() == 3:
                out[f"{name}.{proj}"] = p
    return out


def set_impl(model: torch.nn.Module, device: str, ids: torch.Tensor) -> str:
    """grouped_mm when a forward/backward works on this device, else eager."""
    for impl in ("grouped_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            with autocast(device):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return impl
        except Exception:
            model.zero_grad(set_to_none=True)
    raise RuntimeError("no experts implementation trains here")


def autocast(device: str, enabled: bool = True):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled)
    return torch.autocast("cpu", enabled=False)


# --- data windows ---------------------------------------------------------------------------------

class Stream:
    """Non-overlapping windows of the train tokens (code + English), in a seeded order: the
    pretraining takes the first ones, fine-tunes the next (never seen), so nothing repeats
    below one epoch."""

    def __init__(self, tokens: np.ndarray, seq: int, seed: int) -> None:
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq = seq
        self.n = (tokens.size - 1) // seq
        self.order = torch.from_numpy(np.random.default_rng(1000 + seed).permutation(self.n))

    def batch(self, start: int, count: int) -> torch.Tensor:
        idx = self.order[start:start + count]
        if idx.numel() < count:
            raise ValueError(f"the train split has {self.n} windows; asked for up to {start + count}")
        return torch.stack([self.tokens[i * self.seq:(i + 1) * self.seq] for i in idx.tolist()])


def eval_windows(tokens: np.ndarray, n_tokens: int, seq: int) -> torch.Tensor:
    """Windows evenly spaced over a held-out stream (fixed for every seed and variant)."""
    n = max(1, min(n_tokens // seq, (tokens.size - 1) // seq))
    starts = np.linspace(0, tokens.size - seq, n).astype(np.int64)
    return torch.stack([torch.from_numpy(tokens[s:s + seq].astype(np.int64)) for s in starts])


# --- training and evaluation ----------------------------------------------------------------------

def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: torch.nn.Module, stream: Stream, start: int, steps: int, size: Size, device: str, *,
          lr: float, params: List[torch.nn.Parameter], weight_decay: float,
          masks: Optional[Dict[str, torch.Tensor]] = None, curve: Optional[Callable[[int], None]] = None,
          curve_every: int = 0, log: Optional[Callable[[str], None]] = None) -> dict:
    """AdamW (warmup, cosine to 10 %) on ``params`` only (the rest frozen), batches from
    ``stream`` at ``start``.  ``masks`` (by expert Parameter name): gradients masked and
    weights re-masked after every step (the masked dense path).  Parameters in a 16-bit
    dtype (a patched bf16 model on the GPU) are updated through fp32 master copies."""
    wanted = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in wanted)
    master = [p.detach().float().clone() if p.dtype != torch.float32 else None for p in params]
    opt_params = [m if m is not None else p for p, m in zip(params, master)]
    decay = [q for q in opt_params if q.dim() >= 2]
    other = [q for q in opt_params if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    pm = []
    if masks:
        named = expert_params(model)
        pm = [(named[k], m.to(device)) for k, m in masks.items()]
    warm = max(1, int(size.warmup_frac * steps))
    losses: List[float] = []
    model.train()
    t0 = time.time()
    sync(device)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, lr, warm)
        ids = stream.batch(start + step * size.batch, size.batch).to(device, non_blocking=True)
        with autocast(device):
            out = model(input_ids=ids, labels=ids, use_cache=False, output_router_logits=True)
        loss = out.loss
        v = float(loss.detach())
        if not math.isfinite(v):
            raise FloatingPointError(f"loss {v} at step {step}")
        loss.backward()
        for p, m in pm:
            if p.grad is not None:
                p.grad.mul_(m)
        for p, m in zip(params, master):
            if m is not None:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(opt_params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                if m is not None:
                    p.copy_(m)
            for p, m in pm:
                p.mul_(m)
        losses.append(v)
        if curve is not None and curve_every and ((step + 1) % curve_every == 0 or step + 1 == steps):
            curve(step + 1)
            model.train()
        if log and steps >= 10 and (step + 1) % max(1, steps // 5) == 0:
            log(f"    step {step + 1}/{steps}: train loss {sum(losses[-20:]) / len(losses[-20:]):.4f} "
                f"({time.time() - t0:.0f} s)")
    sync(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    secs = time.time() - t0
    return {"steps": steps, "tokens": steps * size.batch * size.seq, "seconds": round(secs, 2),
            "tokens_per_s": round(steps * size.batch * size.seq / max(secs, 1e-9)),
            "first_loss": losses[0] if losses else None,
            "last_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "loss_every_tenth": [round(sum(c) / len(c), 4) for c in np.array_split(np.array(losses), min(10, len(losses)))]}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def evaluate(model: torch.nn.Module, ev: Dict[str, torch.Tensor], tb: torch.Tensor, device: str,
             batch: int = 16) -> Dict[str, dict]:
    """Per domain: mean next-token cross-entropy (nats), perplexity, bits per byte (total
    nats / ln 2 / the bytes the predicted tokens stand for), next-token accuracy."""
    model.eval()
    out = {}
    for dom, windows in ev.items():
        nats = 0.0
        hits = tokens = nbytes = 0
        for i in range(0, windows.shape[0], batch):
            ids = windows[i:i + batch].to(device)
            with autocast(device):
                logits = model(input_ids=ids, use_cache=False, output_router_logits=False).logits
            lg = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            tgt = ids[:, 1:].reshape(-1)
            nats += float(torch.nn.functional.cross_entropy(lg, tgt, reduction="sum"))
            hits += int((lg.argmax(-1) == tgt).sum())
            tokens += tgt.numel()
            nbytes += int(tb[tgt.cpu()].sum())
        loss = nats / tokens
        out[dom] = {"loss": loss, "ppl": math.exp(loss), "bpb": nats / math.log(2) / nbytes, "acc": hits / tokens,
                    "tokens": tokens}
    return out


@torch.no_grad()
def experts_output_error(pruned: torch.nn.Module, dense: torch.nn.Module, windows: torch.Tensor, device: str) -> float:
    """Relative L2 error of the experts modules' outputs on the dense model's inputs, averaged."""
    from samoyeds.hf.experts import find_experts

    dm = {t.name: t.experts for t in find_experts(dense)}
    pmods = {t.name: t.experts for t in find_experts(pruned)}
    errs = []
    for name, mod in dm.items():
        cap = []
        h = mod.register_forward_hook(lambda m, a, o: cap.append((a, o)))
        try:
            dense(input_ids=windows.to(device), use_cache=False)
        finally:
            h.remove()
        num = den = 0.0
        for args, o in cap:
            got = pmods[name](*args)
            num += float((got.float() - o.float()).pow(2).sum())
            den += float(o.float().pow(2).sum())
        errs.append(math.sqrt(num / max(den, 1e-30)))
    return sum(errs) / len(errs)


# --- context shared by the stages -----------------------------------------------------------------

@dataclass
class Ctx:
    size_name: str
    size: Size
    device: str
    cache: str
    out: str
    corpus: Optional[data.Corpus] = None
    log: Callable[[str], None] = print
    compile: bool = False
    ft_matrix: str = "full"
    deadline: Optional[float] = None
    env: dict = field(default_factory=dict)

    def load_corpus(self) -> data.Corpus:
        if self.corpus is None:
            self.corpus = data.build(os.path.join(self.cache, self.size_name), self.size.corpus, self.log)
            self.corpus.token_bytes_t = torch.from_numpy(self.corpus.token_bytes.astype(np.int64))
        return self.corpus

    def model_cfg(self, name: str) -> ModelCfg:
        return dict(self.size.models)[name]

    def ckpt_dir(self, model: str, seed: int) -> str:
        c = self.load_corpus()
        d = os.path.join(self.cache, self.size_name, f"data-{c.info['key']}", model, f"seed{seed}")
        os.makedirs(d, exist_ok=True)
        return d

    def part_path(self, model: str, seed: int) -> str:
        d = os.path.join(self.out, f"{STUDY}_parts")
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, f"{self.size_name}_{model}_seed{seed}.json")

    def eval_sets(self) -> Dict[str, torch.Tensor]:
        c = self.load_corpus()
        return {"code": eval_windows(c.tokens["code_heldout"], self.size.eval_code_tokens, self.size.seq),
                "english": eval_windows(c.tokens["english_heldout"], self.size.eval_english_tokens, self.size.seq)}

    def train_tokens(self) -> np.ndarray:
        c = self.load_corpus()
        eos = np.zeros(1, dtype=np.uint16)
        return np.concatenate([c.tokens["code_train"], eos, c.tokens["english_train"]])

    def pretrain_steps(self, stream: Stream) -> int:
        s = self.size
        cap = int(s.max_epoch_frac * stream.n * s.seq)
        return max(1, min(s.pretrain_tokens, cap) // (s.batch * s.seq))


def _json_dump(path: str, payload: dict) -> None:
    from common import _finite

    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(_finite(payload), fh, indent=1, allow_nan=False)
    os.replace(tmp, path)


def _load(path: str) -> Optional[dict]:
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    return None


# --- stage: pretrain (dense, and the quarter-width baseline) --------------------------------------

def pretrain(ctx: Ctx, model_name: str, seed: int, quarter: bool = False) -> Tuple[torch.nn.Module, dict]:
    """Pretrains (or loads from the cache) the model of ``model_name`` for ``seed``; ``quarter``:
    the MoE with experts 1/4 as wide, for as many FLOPs as the dense model's pretraining plus
    its 1 % fine-tune (more tokens, capped below one epoch)."""
    s, dev = ctx.size, ctx.device
    c = ctx.load_corpus()
    cfg = ctx.model_cfg(model_name)
    tag = "quarter" if quarter else "dense"
    d = ctx.ckpt_dir(model_name, seed)
    meta_path, pt = os.path.join(d, f"{tag}.json"), os.path.join(d, f"{tag}.pt")
    if quarter:
        cfg = replace(cfg, intermediate=cfg.intermediate // 4)
    model = build(cfg, c.vocab, s.seq, seed if not quarter else seed + 500, s, dev)
    meta = _load(meta_path)
    if meta is not None and os.path.exists(pt) and meta.get("config") == asdict(cfg):
        model.load_state_dict(torch.load(pt, map_location=dev))
        model.eval()
        impl = set_impl(model, dev, torch.zeros(1, 8, dtype=torch.long, device=dev))
        ctx.log(f"{model_name} seed {seed}: {tag} checkpoint from {pt}")
        return model, meta
    stream = Stream(ctx.train_tokens(), s.seq, seed)
    dense_steps = ctx.pretrain_steps(stream)
    full = ctx.model_cfg(model_name)
    if quarter:
        ft_tokens = int(round(s.ft_fracs[0] * dense_steps * s.batch * s.seq))
        budget = (dense_steps * s.batch * s.seq + ft_tokens) * flops_per_token(full, c.vocab, s.seq)
        want = budget / flops_per_token(cfg, c.vocab, s.seq)
        steps = max(1, min(int(want) // (s.batch * s.seq), int(s.max_epoch_frac * stream.n) // s.batch))
    else:
        steps = dense_steps
    impl = set_impl(model, dev, stream.batch(0, 2).to(dev))
    if ctx.compile and dev.startswith("cuda"):
        model.forward = torch.compile(model.forward)
    ev = ctx.eval_sets()
    small = {"code": ev["code"][:max(1, s.curve_tokens // s.seq)]}
    curve: List[dict] = []

    def point(step: int) -> None:
        m = evaluate(model, small, c.token_bytes_t, dev)["code"]
        curve.append({"step": step, "tokens": step * s.batch * s.seq, "heldout_loss": round(m["loss"], 5)})

    ctx.log(f"{model_name} seed {seed}: pretraining {tag} ({counts(model)['parameters'] / 1e6:.2f} M parameters, "
            f"{steps} steps x {s.batch * s.seq} tokens = {steps * s.batch * s.seq / 1e6:.2f} M tokens, "
            f"{steps * s.batch / stream.n:.2f} epoch, experts {impl})")
    point(0)
    tr = train(model, stream, 0, steps, s, dev, lr=s.lr, params=list(model.parameters()),
               weight_decay=s.weight_decay, curve=point, curve_every=max(1, steps // s.curve_points), log=ctx.log)
    if ctx.compile and "forward" in model.__dict__:
        del model.forward
    metrics = evaluate(model, ev, c.token_bytes_t, dev)
    meta = {"config": asdict(cfg), **counts(model), "seed": seed, "experts_implementation": impl, "training": tr,
            "epochs": steps * s.batch / stream.n, "flops": steps * s.batch * s.seq * flops_per_token(cfg, c.vocab, s.seq),
            "heldout_curve": curve, "metrics": metrics, "windows_used": steps * s.batch,
            "device": ctx.env.get("device", dev)}
    if quarter:
        meta["equal_compute"] = {"target_flops": budget, "flops": meta["flops"], "ratio": meta["flops"] / budget,
                                 "capped_below_one_epoch": steps * s.batch * s.seq < want - s.batch * s.seq}
    torch.save(model.state_dict(), pt)
    _json_dump(meta_path, meta)
    ctx.log(f"{model_name} seed {seed}: {tag} held-out code ppl {metrics['code']['ppl']:.3f}, "
            f"bpb {metrics['code']['bpb']:.4f} ({tr['seconds']:.0f} s, {tr['tokens_per_s'] / 1e3:.0f} k tok/s)")
    return model, meta


# --- stage: variants -------------------------------------------------------------------------------

def variants(ctx: Ctx, model_name: str, seed: int, heldout: bool) -> dict:
    """Every variant of one pretrained model; resumable (what the part file holds is skipped)."""
    import samoyeds as sm
    import samoyeds.hf as shf
    import samoyeds.sparsify as sp

    s, dev = ctx.size, ctx.device
    c = ctx.load_corpus()
    path = ctx.part_path(model_name, seed)
    part = _load(path) or {}
    dense, meta = pretrain(ctx, model_name, seed)
    qmeta = _load(os.path.join(ctx.ckpt_dir(model_name, seed), "quarter.json"))
    part.update({"study": STUDY, "size": ctx.size_name, "model": model_name, "seed": seed, "heldout_seed": heldout,
                 "corpus_key": c.info["key"], "corpus": c.info, "environment": ctx.env, "pretrain": meta, "quarter": qmeta,
                 "ft_matrix": ctx.ft_matrix})
    rows: Dict[str, dict] = part.setdefault("variants", {})
    ev = ctx.eval_sets()
    stream = Stream(ctx.train_tokens(), s.seq, seed)
    used = meta["windows_used"]
    calib_all = stream.batch(used - s.calib_seqs, s.calib_seqs) if used >= s.calib_seqs else stream.batch(0, s.calib_seqs)
    calib = list(calib_all.split(max(1, min(16, s.calib_seqs))))
    err_w = ev["code"][:s.error_seqs]
    ft_start = used                                     # fine-tunes read windows the pretraining never saw

    def save() -> None:
        _json_dump(path, part)

    def out_of_time() -> bool:
        return ctx.deadline is not None and time.time() > ctx.deadline

    def ft_steps(frac: float) -> int:
        return max(1, int(round(frac * meta["training"]["steps"])))

    def finetune(base: torch.nn.Module, scope: str, frac: float, masks=None, fmt=None, mask_by_mod=None) -> dict:
        m = copy.deepcopy(base)
        if fmt is not None:
            if dev.startswith("cuda"):
                m = m.to(torch.bfloat16)
            sm.patch_model(m, fmt, progress=False, masks=mask_by_mod, router=False, shared_stream=False)
            params = shf.experts_parameters(m) if scope == "experts" else list(m.parameters())
        else:
            params = list(expert_params(m).values()) if scope == "experts" else list(m.parameters())
        tr = train(m, stream, ft_start, ft_steps(frac), s, dev, lr=s.ft_lr, params=params, weight_decay=0.0,
                   masks=masks if fmt is None else None)
        r = {"metrics": evaluate(m, ev, c.token_bytes_t, dev), "steps": tr["steps"], "seconds": tr["seconds"],
             "last_train_loss": tr["last_loss"]}
        if masks and fmt is None:
            r["masks_held"] = all(bool((p[~masks[k].to(p.device)] == 0).all()) for k, p in expert_params(m).items())
        if fmt is not None:
            r["dtype"] = str(next(iter(params)).dtype).replace("torch.", "")
        del m
        return r

    cfgs = ft_configs(s)

    def run_fts(row: dict, base: torch.nn.Module, name: str, method: Optional[str], masks=None, fmt=None,
                mask_by_mod=None) -> None:
        fts = row.setdefault("ft", {})
        for cname, scope, frac in cfgs:
            if not ft_wanted(ctx.ft_matrix, name, method, cname):
                continue
            slot = fts.setdefault(cname, {})
            for path_name, f in (("masked", None), ("samoyeds", fmt)):
                if path_name == "samoyeds" and fmt is None or path_name in slot:
                    continue
                if out_of_time():
                    return
                try:
                    slot[path_name] = finetune(base, scope, frac, masks, f, mask_by_mod)
                except Exception as e:
                    slot[path_name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-1500:]}
                    ctx.log(f"  {name} {cname} {path_name}: FAILED {slot[path_name]['error']}")
            if "masked" in slot and "samoyeds" in slot and "metrics" in slot["samoyeds"] and "metrics" in slot["masked"]:
                slot["paths_code_loss_diff"] = slot["samoyeds"]["metrics"]["code"]["loss"] - \
                    slot["masked"]["metrics"]["code"]["loss"]
            save()

    def done(row: dict, name: str, method: Optional[str], fmt) -> bool:
        if "oneshot" not in row:
            return False
        for cname, _, _ in cfgs:
            if ft_wanted(ctx.ft_matrix, name, method, cname):
                slot = (row.get("ft") or {}).get(cname) or {}
                if "masked" not in slot or (fmt is not None and "samoyeds" not in slot):
                    return False
        return True

    t_all = time.time()
    # dense, dense + the same fine-tunes
    row = rows.setdefault("dense", {"kind": "dense", "pattern": None, "method": None, "sparsity": 0.0})
    if "oneshot" not in row:
        row["oneshot"] = evaluate(dense, ev, c.token_bytes_t, dev)
    run_fts(row, dense, "dense", None)
    # floor: experts removed (the MoE layers add nothing)
    row = rows.setdefault("floor (experts removed)", {"kind": "floor", "pattern": None, "method": None,
                                                       "sparsity": 1.0})
    if "oneshot" not in row:
        fl = copy.deepcopy(dense)
        with torch.no_grad():
            for p in expert_params(fl).values():
                p.zero_()
        row["oneshot"] = evaluate(fl, ev, c.token_bytes_t, dev)
        del fl
    if qmeta is not None:
        rows["quarter-width MoE (equal compute)"] = {
            "kind": "quarter", "pattern": None, "method": None, "sparsity": None, "oneshot": qmeta["metrics"],
            "parameters": qmeta["parameters"], "expert_parameters": qmeta["expert_parameters"],
            "equal_compute": qmeta.get("equal_compute"), "epochs": qmeta.get("epochs")}
    save()
    ctx.log(f"{model_name} seed {seed}: dense ppl {rows['dense']['oneshot']['code']['ppl']:.3f}, floor "
            f"{rows['floor (experts removed)']['oneshot']['code']['ppl']:.3f}"
            + (f", quarter-width {qmeta['metrics']['code']['ppl']:.3f}" if qmeta else ", quarter-width not run yet"))
    n_expert = counts(dense)["expert_parameters"]
    for pat in patterns():
        for mname, (base_method, reconstruct) in METHODS.items():
            if mname not in pat.get("methods", METHODS):
                continue
            name = f"{pat['label']} {mname}"
            row = rows.setdefault(name, {"kind": "pruned", "pattern": pat["label"], "method": mname,
                                         "packable": pat["fmt"] is not None, "note": pat.get("note")})
            if done(row, name, mname, pat["fmt"]):
                continue
            if out_of_time():
                ctx.log(f"time limit reached: stopping before {name}; run the same command again to resume")
                part["complete"] = False
                save()
                return part
            t0 = time.time()
            try:
                pm = copy.deepcopy(dense)
                masks = sp.prune_model(pm, pat["pattern"], base_method, calib, progress=False, reconstruct=reconstruct)
                flat = {f"{mod}.{proj}": mk for mod, mm in masks.items() for proj, mk in mm.items()}
                row["sparsity"] = 1.0 - sum(int(mk.sum()) for mk in flat.values()) / n_expert
                row["prune_seconds"] = round(time.time() - t0, 2)
                if "oneshot" not in row:
                    row["oneshot"] = evaluate(pm, ev, c.token_bytes_t, dev)
                    row["experts_output_error"] = experts_output_error(pm, dense, err_w, dev)
                run_fts(row, pm, name, mname, flat, pat["fmt"], masks)
                row.pop("error", None)
                ft1 = ((row.get("ft") or {}).get("experts-1%") or {})
                ctx.log(f"  {name:40s} ppl {row['oneshot']['code']['ppl']:8.3f}"
                        + "".join(f"  ft {k} {v['metrics']['code']['ppl']:.3f}" for k, v in ft1.items()
                                  if isinstance(v, dict) and "metrics" in v)
                        + f"  ({time.time() - t0:.1f} s)")
                del pm
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc()[-2000:]
                ctx.log(f"  {name}: FAILED {row['error']}")
            save()
    part["complete"] = all(("oneshot" in r and "error" not in r) for r in rows.values())
    part["variants_seconds"] = round(time.time() - t_all, 1)
    save()
    return part


# --- stage: merge ----------------------------------------------------------------------------------

def stat(values: List[Optional[float]]) -> dict:
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"mean": None, "std": None, "n": 0}
    m = float(np.mean(v))
    sd = float(np.std(v, ddof=1)) if len(v) > 1 else None
    return {"mean": m, "std": sd, "n": len(v), "values": v}


def _metric(row: Optional[dict], where: Tuple[str, ...], domain: str = "code", key: str = "ppl") -> Optional[float]:
    """A metric of a variant row: ("oneshot",) or ("ft", config, path)."""
    if not row:
        return None
    if where[0] == "oneshot":
        m = row.get("oneshot")
    else:
        m = (((row.get("ft") or {}).get(where[1]) or {}).get(where[2]) or {}).get("metrics")
    return ((m or {}).get(domain) or {}).get(key)


def _paired(parts: List[dict], fn: Callable[[Dict[str, dict]], Optional[float]]) -> Tuple[dict, Dict[int, float]]:
    per = {}
    for p in parts:
        v = fn(p["variants"])
        if v is not None and math.isfinite(v):
            per[p["seed"]] = v
    return stat(list(per.values())), per


def _target(parts: List[dict], fn, rule: str, desc: str, threshold: float = 0.0, extra: Optional[dict] = None) -> dict:
    """A target on a per-seed quantity ``q``: met when mean(q) - 2 std(q) > threshold (rule
    "greater") or mean(q) + 2 std(q) < threshold ("less"), and the held-out seed agrees."""
    st, per = _paired(parts, fn)
    held = [p["seed"] for p in parts if p.get("heldout_seed")]
    out: Dict[str, Any] = {"description": desc, "quantity": st, "per_seed": {str(k): v for k, v in per.items()},
                           "rule": f"mean {'-' if rule == 'greater' else '+'} 2 std {'>' if rule == 'greater' else '<'} "
                                   f"{threshold:g} over all seeds, and the held-out seed on the same side",
                           "heldout_seeds": held}
    if extra:
        out.update(extra)
    if st["n"] < 2 or st["std"] is None:
        out.update(met=None, why="fewer than 2 seeds")
        return out
    bound = st["mean"] - 2 * st["std"] if rule == "greater" else st["mean"] + 2 * st["std"]
    beyond = bound > threshold if rule == "greater" else bound < threshold
    hv = [per[h] for h in held if h in per]
    held_ok = (all((v > threshold) if rule == "greater" else (v < threshold) for v in hv)) if hv else None
    out.update(bound_2sigma=bound, beyond_2sigma=bool(beyond), heldout_seed_agrees=held_ok,
               met=bool(beyond and held_ok) if held_ok is not None else None)
    if held_ok is None:
        out["why"] = "the held-out seed has not been run"
    return out


def targets(parts: List[dict]) -> dict:
    FT = ("ft", "experts-1%", "samoyeds")
    FTM = ("ft", "experts-1%", "masked")
    sam, ven = "samoyeds-1:2:128", "venom-128:2:8"
    out: Dict[str, Any] = {}

    def ppl(v, name, where):
        return _metric(v.get(name), where)

    for path, where in (("samoyeds backward", FT), ("masked dense", FTM)):
        key = "samoyeds_backward" if path == "samoyeds backward" else "masked_dense"
        for meth in ("wanda", "sparsegpt-mask", "sparsegpt"):
            tag = f"{key}_{meth}"
            out[f"within_5pct_of_dense_ft__{tag}"] = _target(
                parts, lambda v, m=meth, w=where: (ppl(v, f"{sam} {m}", w) / ppl(v, "dense", FTM) - 1)
                if ppl(v, f"{sam} {m}", w) and ppl(v, "dense", FTM) else None,
                "less", f"{sam} {meth} + 1 % experts-only fine-tune ({path}): code perplexity / that of dense + the "
                        "same fine-tune - 1 below 5 %", 0.05,
                {"primary": meth == CALIBRATED_PRIMARY and key == "samoyeds_backward"})
            out[f"better_than_quarter_width__{tag}"] = _target(
                parts, lambda v, m=meth, w=where: (ppl(v, "quarter-width MoE (equal compute)", ("oneshot",)) -
                                                   ppl(v, f"{sam} {m}", w))
                if ppl(v, f"{sam} {m}", w) and ppl(v, "quarter-width MoE (equal compute)", ("oneshot",)) else None,
                "greater", f"{sam} {meth} + 1 % experts-only fine-tune ({path}) has lower code perplexity than the "
                           "quarter-width MoE trained from scratch at equal compute",
                0.0, {"primary": meth == CALIBRATED_PRIMARY and key == "samoyeds_backward"})
    for patl in (sam, "samoyeds-1:2:32", "samoyeds-1:2:16", ven, "unstructured-75", "2:4"):
        for cal in ("wanda", "sparsegpt-mask", "sparsegpt"):
            def half(v, p=patl, cm=cal):
                d, mg, cl = ppl(v, "dense", ("oneshot",)), ppl(v, f"{p} magnitude", ("oneshot",)), \
                    ppl(v, f"{p} {cm}", ("oneshot",))
                return None if None in (d, mg, cl) else 0.5 * (mg - d) - (cl - d)
            out[f"calibrated_loses_at_most_half__{patl}__{cal}"] = _target(
                parts, half, "greater", f"{patl}, one-shot: {cal}'s perplexity increase over dense is at most half "
                                        "of magnitude's (q = magnitude increase / 2 - calibrated increase > 0)", 0.0,
                {"primary": patl == sam and cal == CALIBRATED_PRIMARY,
                 "reconstruction": cal == "sparsegpt"})
    for meth in METHODS:
        for where, wl in ((("oneshot",), "one-shot"), (FTM, "1 % experts-only fine-tune, masked dense")):
            def diff(v, m=meth, w=where):
                a = [ppl(v, f"{ven} {m}", w)]
                if m.startswith("sparsegpt"):
                    a.append(ppl(v, f"{ven} lazy-columns {m}", w))
                a = [x for x in a if x is not None]
                b = ppl(v, f"{sam} {m}", w)
                return None if not a or b is None else min(a) - b
            t = _target(parts, diff, "greater",
                        f"{sam} vs VENOM 128:2:8 ({meth}, {wl}): VENOM's perplexity (the better of its column "
                        "selections) minus Samoyeds'; > 0 beyond 2 sigma: Samoyeds better", 0.0)
            q = t["quantity"]
            if q["n"] >= 2 and q["std"] is not None:
                t["verdict"] = ("samoyeds better beyond 2 sigma" if q["mean"] - 2 * q["std"] > 0 else
                                "venom better beyond 2 sigma" if q["mean"] + 2 * q["std"] < 0 else
                                "no difference beyond 2 sigma")
            out[f"samoyeds_vs_venom__{meth}__{'oneshot' if where[0] == 'oneshot' else 'ft1_experts_masked'}"] = t
    return out


def summarize(parts: List[dict]) -> dict:
    """mean, std over seeds of every variant's metrics."""
    names: List[str] = []
    for p in parts:
        for n in p["variants"]:
            if n not in names:
                names.append(n)
    out = {}
    for n in names:
        rows = [p["variants"].get(n) for p in parts]
        first = next(r for r in rows if r)
        rec: Dict[str, Any] = {k: first.get(k) for k in ("kind", "pattern", "method", "packable", "note")}
        rec["sparsity"] = stat([r.get("sparsity") for r in rows if r])["mean"]
        rec["seeds"] = [p["seed"] for p, r in zip(parts, rows) if r and "oneshot" in r]
        rec["errors"] = [r["error"] for r in rows if r and "error" in r]
        rec["oneshot"] = {f"{dom}_{k}": stat([_metric(r, ("oneshot",), dom, k) for r in rows])
                          for dom in ("code", "english") for k in ("ppl", "bpb", "acc")}
        if any(r and "experts_output_error" in r for r in rows):
            rec["experts_output_error"] = stat([r.get("experts_output_error") for r in rows if r])
        ft: Dict[str, Any] = {}
        for r in rows:
            for cname, slot in ((r or {}).get("ft") or {}).items():
                for path in slot:
                    if path in ("masked", "samoyeds"):
                        ft.setdefault(cname, {})[path] = None
        for cname, paths in ft.items():
            for path in paths:
                paths[path] = {f"{dom}_{k}": stat([_metric(r, ("ft", cname, path), dom, k) for r in rows])
                               for dom in ("code", "english") for k in ("ppl", "bpb", "acc")}
            diffs = [(((r or {}).get("ft") or {}).get(cname) or {}).get("paths_code_loss_diff") for r in rows]
            if any(d is not None for d in diffs):
                paths["paths_code_loss_diff"] = stat(diffs)
        if ft:
            rec["ft"] = ft
        out[n] = rec
    return out


def merge(ctx: Ctx, plot: bool = False) -> dict:
    files = sorted(glob.glob(os.path.join(ctx.out, f"{STUDY}_parts", f"{ctx.size_name}_*_seed*.json")))
    parts = [p for p in (_load(f) for f in files) if p]
    if not parts:
        raise SystemExit(f"merge: no parts in {os.path.join(ctx.out, STUDY + '_parts')}")
    corpus = parts[0].get("corpus")           # merge needs no corpus on this machine: the parts carry it
    keys = sorted({p.get("corpus_key") for p in parts})
    result: Dict[str, Any] = {
        "study": STUDY, "size": ctx.size_name, "config": _size_json(ctx.size), "environment": ctx.env,
        "corpus": corpus, "tokenizer": (corpus or {}).get("tokenizer"),
        "corpus_keys": keys, "corpus_consistent": len(keys) == 1,
        "seeds": sorted({p["seed"] for p in parts}), "heldout_seeds": sorted({p["seed"] for p in parts if p.get("heldout_seed")}),
        "heldout_seed_note": "held-out seeds were not run while the study was developed; a target is met only when "
                             "its 2-sigma bound holds over all seeds and the held-out seed is on the same side",
        "std": "sample standard deviation over seeds (ddof 1) of per-seed values; targets use paired per-seed "
               "differences", "parts": [], "models": {}}
    for f, p in zip(files, parts):
        env = p.get("environment") or {}
        result["parts"].append({"file": os.path.basename(f), "model": p["model"], "seed": p["seed"],
                                "heldout_seed": p.get("heldout_seed"), "complete": p.get("complete"),
                                "commit": env.get("commit"), "device": env.get("device"),
                                "corpus_key": p.get("corpus_key")})
    for model in sorted({p["model"] for p in parts}):
        mp = sorted([p for p in parts if p["model"] == model], key=lambda p: p["seed"])
        result["models"][model] = {
            "config": mp[0]["pretrain"]["config"], "parameters": mp[0]["pretrain"]["parameters"],
            "expert_parameters": mp[0]["pretrain"]["expert_parameters"],
            "seeds": [p["seed"] for p in mp], "heldout_seeds": [p["seed"] for p in mp if p.get("heldout_seed")],
            "pretrain": {str(p["seed"]): {k: p["pretrain"].get(k) for k in
                                          ("training", "epochs", "flops", "heldout_curve", "experts_implementation",
                                           "device")} for p in mp},
            "quarter": {str(p["seed"]): {k: (p.get("quarter") or {}).get(k) for k in
                                         ("config", "parameters", "training", "epochs", "flops", "equal_compute")}
                        for p in mp},
            "variants": summarize(mp), "targets": targets(mp)}
    path = os.path.join(ctx.out, f"{STUDY}.json")
    _json_dump(path, result)
    ctx.log(f"wrote {path}")
    ctx.log(table(result))
    if plot:
        import plots
        fig = plots.accuracy_v2(result)
        fp = os.path.join(os.path.dirname(HERE), "docs", "figures", "accuracy_v2.png")
        plots.save(fig, fp)
        ctx.log(f"wrote {fp}")
    return result


def table(result: dict) -> str:
    lines = []
    for model, m in result["models"].items():
        lines.append(f"\n{model}: {m['parameters'] / 1e6:.2f} M parameters, seeds {m['seeds']} "
                     f"(held out {m['heldout_seeds']}); held-out code perplexity, mean +- std")
        lines.append(f"{'variant':38s} {'one-shot':>16s} {'ft experts-1% masked':>22s} {'ft experts-1% samoyeds':>24s}")
        for n, v in m["variants"].items():
            def f(st):
                if not st or st.get("mean") is None:
                    return "-"
                return f"{st['mean']:.3f}" + (f" +- {st['std']:.3f}" if st.get("std") is not None else "")
            ft = (v.get("ft") or {}).get("experts-1%") or {}
            lines.append(f"{n:38s} {f(v['oneshot']['code_ppl']):>16s} {f((ft.get('masked') or {}).get('code_ppl')):>22s} "
                         f"{f((ft.get('samoyeds') or {}).get('code_ppl')):>24s}")
        for k, t in m["targets"].items():
            if t.get("primary") or k.startswith("samoyeds_vs_venom__wanda") or k.startswith("samoyeds_vs_venom__sparsegpt__"):
                lines.append(f"target {k}: met={t.get('met')} {t.get('verdict', '')} "
                             f"(q {t['quantity'].get('mean')}, std {t['quantity'].get('std')})")
    return "\n".join(lines)


def _size_json(size: Size) -> dict:
    d = asdict(size)
    d["models"] = {k: asdict(v) for k, v in size.models}
    return d


# --- plan -----------------------------------------------------------------------------------------

def plan(ctx: Ctx, log: Callable[[str], None] = print) -> dict:
    """GPU time of every stage from the token budgets (and measured rates where the cache has them)."""
    s = ctx.size
    vocab = s.corpus.vocab
    rate = s.assumed_tflops * 1e12
    n_pat = sum(len(p.get("methods", METHODS)) for p in patterns())
    packable = sum(len(p.get("methods", METHODS)) for p in patterns() if p["fmt"])
    rows = []
    total = 0.0
    log(f"plan for size {ctx.size_name!r} on one GPU at an effective {s.assumed_tflops:g} TFLOP/s (bf16 training; "
        "measured rates replace it once a pretraining is cached)")
    for name, cfg in s.models:
        tok = s.pretrain_tokens
        f_tok = flops_per_token(cfg, vocab, s.seq)
        measured = None
        for mp in glob.glob(os.path.join(ctx.cache, ctx.size_name, "data-*", name, "seed*", "dense.json")):
            measured = (_load(mp) or {}).get("training", {}).get("tokens_per_s")
        tps = measured or rate / f_tok
        pre = tok / tps
        q_cfg = replace(cfg, intermediate=cfg.intermediate // 4)
        q_tok = (tok * (1 + s.ft_fracs[0])) * f_tok / flops_per_token(q_cfg, vocab, s.seq)
        q_tps = rate / flops_per_token(q_cfg, vocab, s.seq) if not measured else measured * f_tok / flops_per_token(q_cfg, vocab, s.seq)
        quarter = q_tok / q_tps
        evals_tok = s.eval_code_tokens + s.eval_english_tokens
        eval_s = evals_tok / (tps * 3)                  # a forward is a third of a training step
        n_ft_masked = n_ft_sam = 0
        ft_s = 0.0
        for p in patterns():
            for mname in p.get("methods", METHODS):
                vname = f"{p['label']} {mname}"
                for cname, scope, frac in ft_configs(s):
                    if ft_wanted(ctx.ft_matrix, vname, mname, cname):
                        n_ft_masked += 1
                        ft_s += frac * pre + eval_s
                        if p["fmt"]:
                            n_ft_sam += 1
                            ft_s += frac * pre * s.samoyeds_train_slowdown + eval_s
        for cname, scope, frac in ft_configs(s):
            ft_s += frac * pre + eval_s
        prune_s = n_pat * (8.0 if ctx.size_name == "gpu" else 0.3) + (n_pat + 2) * eval_s
        var = ft_s + prune_s
        per_seed = pre + quarter + var
        rows.append({"model": name, "pretrain_s": pre, "quarter_s": quarter, "variants_s": var,
                     "per_seed_s": per_seed, "tokens_per_s": tps, "measured": bool(measured),
                     "fine_tunes_masked": n_ft_masked, "fine_tunes_samoyeds": n_ft_sam})
        q_cap = ""
        if ctx.corpus is not None:
            cap = s.max_epoch_frac * (ctx.train_tokens().size)
            if q_tok > cap:
                quarter *= cap / q_tok
                q_tok, q_cap = cap, " (capped below one epoch: less than equal compute, recorded)"
        log(f"  {name:12s} pretrain {tok / 1e6:6.1f} M tokens ~{pre / 60:5.1f} min ({tps / 1e3:.0f} k tok/s"
            f"{' measured' if measured else ' assumed'}); quarter-width {q_tok / 1e6:5.1f} M tokens ~{quarter / 60:4.1f} min{q_cap}; "
            f"variants ({n_pat} prunings, {n_ft_masked} + {n_ft_sam} fine-tunes masked + samoyeds, "
            f"ft matrix {ctx.ft_matrix}) ~{var / 60:5.1f} min; per seed ~{per_seed / 60:5.1f} min")
        total += per_seed * (len(s.seeds) + len(s.heldout_seeds))
    log(f"  data stage (corpus + tokenizer, CPU): ~2-4 min once per machine (cached)")
    log(f"  all: {len(s.seeds)} + {len(s.heldout_seeds)} held-out seeds x {len(s.models)} models ~{total / 60:.0f} "
        f"device-minutes; commands <= 9 min: pretrain and quarter are one command each, variants resume across "
        f"commands with --max-minutes 9 (cached checkpoints stay on the warm machine under --cache)")
    return {"stages": rows, "total_s": total}


# --- main -----------------------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny models and corpus: the whole pipeline in about a minute")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stage", choices=("all", "data", "pretrain", "quarter", "variants", "merge"), default="all")
    ap.add_argument("--model", default="all", help="mixtral, finegrained or all")
    ap.add_argument("--seed", default=None, help="comma-separated seeds (default: the size's seeds and held-out seeds)")
    ap.add_argument("--heldout-seeds", default=None, help="comma-separated seeds flagged held out (default: the size's)")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<gpu>/; --tiny: a temporary one)")
    ap.add_argument("--cache", default=None, help="checkpoints and corpus (default: benchmarks/.cache/accuracy_v2; "
                                                   "--tiny: <out>/cache)")
    ap.add_argument("--ft-matrix", choices=("full", "core"), default="full")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop starting new variants after this long")
    ap.add_argument("--compile", action="store_true", help="torch.compile the pretraining forward (GPU)")
    ap.add_argument("--plot", action="store_true", help="merge: write docs/figures/accuracy_v2.png")
    ap.add_argument("--plan", action="store_true", help="print the GPU time of every stage and exit")
    args = ap.parse_args(argv)

    size_name = "tiny" if args.tiny else "gpu"
    size = SIZES[size_name]
    t_start = time.time()
    if args.out:
        out = args.out
    elif args.tiny:
        out = tempfile.mkdtemp(prefix="samoyeds-acc2-")
    else:
        from common import gpu_dir
        out = gpu_dir(None)
    os.makedirs(out, exist_ok=True)
    cache = args.cache or (os.path.join(out, "cache") if args.tiny else os.path.join(HERE, ".cache", STUDY))
    ctx = Ctx(size_name, size, args.device, cache, out, ft_matrix=args.ft_matrix,
              compile=args.compile, log=lambda m: print(m, flush=True))
    if args.plan:
        plan(ctx)
        return 0
    if args.max_minutes:
        ctx.deadline = t_start + 60 * args.max_minutes
    if args.device == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, min(4, cores)))
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        from common import environment
        ctx.env = environment()
    except Exception as e:  # metadata must not stop a study
        ctx.env = {"error": repr(e)}
    ctx.env.setdefault("device", args.device if args.device == "cpu" else torch.cuda.get_device_name(0))
    ctx.env["versions"] = {d: data._version(d) for d in ("torch", "transformers", "tokenizers", "numpy")}
    ctx.log(f"accuracy study v2, size {size_name}, device {ctx.env.get('device')}, out {out}, cache {cache}")
    if args.stage != "merge":
        ctx.load_corpus()
    models = [m for m, _ in size.models] if args.model == "all" else args.model.split(",")
    held = [int(x) for x in args.heldout_seeds.split(",")] if args.heldout_seeds else list(size.heldout_seeds)
    seeds = [int(x) for x in args.seed.split(",")] if args.seed else list(size.seeds) + held
    if args.stage == "data":
        return 0
    if args.stage != "merge":
        for model in models:
            for seed in seeds:
                if ctx.deadline and time.time() > ctx.deadline:
                    ctx.log("time limit reached")
                    break
                if args.stage in ("all", "pretrain"):
                    pretrain(ctx, model, seed)
                if args.stage in ("all", "quarter"):
                    pretrain(ctx, model, seed, quarter=True)
                if args.stage in ("all", "variants"):
                    variants(ctx, model, seed, heldout=seed in held)
    if args.stage in ("all", "merge"):
        merge(ctx, plot=args.plot)
    ctx.log(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
