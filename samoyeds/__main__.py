"""Command line: ``samoyeds demo``, ``samoyeds info``, ``samoyeds --version``.

``demo`` builds a small random MoE causal LM of a real architecture (nothing is
downloaded), packs its experts into the Samoyeds format in place, and runs it
against the same model with the identically masked dense experts: agreement of
logits and greedy tokens, and expert-weight memory.  On a GPU it also times the
model and one MoE block at real model sizes (Qwen3-30B-A3B, Mixtral-8x7B)
against transformers' ``grouped_mm`` experts on the same inputs.  On the CPU
samoyeds runs its C reference implementation, a correctness oracle, so nothing
is timed there.

``info`` says in words how this build was made and what runs here.

Every argument is checked before a model is built: a bad one ends the command
with a one-line ``samoyeds demo: error: argument --NAME: ...`` and exit status 2,
as argparse does for its own checks.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, NoReturn, Optional, Sequence

#: Real MoE block shapes for the GPU timing: (hidden H, expert width I, experts E, top-k K).
BLOCK_SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: Attention heads of the demo model; head_dim = max(16, hidden / HEADS).
HEADS, KV_HEADS = 4, 2


def _families() -> Any:
    """The module holding FAMILIES, Shape and build_model."""
    from .hf import families
    return families


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``PROG: error: MESSAGE (see PROG --help)``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {text!r}")
    return value


def _token_counts(text: str) -> List[int]:
    parts = [p.strip() for p in text.split(",")]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (e.g. 16,4096), got {text!r}")
    return counts


def _sparse_format(text: str) -> Any:
    from .format import SparseFormat

    try:
        return SparseFormat.parse(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> _Parser:
    from . import __version__

    try:
        families: Optional[List[str]] = sorted(_families().FAMILIES)
    except ImportError:          # torch or transformers absent: `demo` says so, `info` still runs
        families = None
    p = _Parser(
        prog="samoyeds",
        description="Mixture-of-Experts on Sparse Tensor Cores (Samoyeds format: vector-wise N:M rows + 2:4).")
    p.add_argument("--version", action="version", version=f"samoyeds {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser(
        "demo", help="patch a small random MoE model and compare it with its masked-dense twin",
        description=(
            "Builds a small random causal LM of the chosen family (default: a Qwen3-MoE-like model, hidden 256, "
            "4 layers, 16 experts, top-2; seeded, nothing downloaded), packs its experts into the sparse format "
            "with samoyeds.patch_model, and runs it next to the same model holding the identically masked dense "
            "expert weights (transformers' own experts code). Prints the agreement of logits and greedy tokens "
            "and the expert-weight memory before and after packing. On a CUDA device it also times both models "
            "and one MoE block at real sizes (Qwen3-30B-A3B, Mixtral-8x7B) against transformers' grouped_mm "
            "experts; on the CPU samoyeds runs its C reference (a correctness oracle), which is not timed."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--family", default="qwen3_moe", choices=families,
                   help="model architecture (its transformers modeling code is used as is)")
    d.add_argument("--format", default="samoyeds-1:2:128", type=_sparse_format,
                   help="sparse format: 'samoyeds-1:2:128' (75%% sparse), 'samoyeds-1:2:64', '2:4' (50%%) "
                        "or 'n:m:v'")
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run; auto: cuda when a GPU and the CUDA kernels are available, else cpu")
    d.add_argument("--dtype", default="auto", choices=["auto"] + sorted(DTYPES),
                   help="model dtype; auto: fp32 on cpu, bf16 on cuda (the GPU kernels take bf16/fp16)")
    d.add_argument("--tokens", type=_positive_int, default=16, help="new tokens to generate greedily")
    d.add_argument("--prompt-len", type=_positive_int, default=32, help="length of the random prompt")
    d.add_argument("--batch", type=_positive_int, default=1, help="prompts per batch")
    d.add_argument("--seed", type=_seed, default=0, help="seed of the random weights and prompt")
    d.add_argument("--hidden", type=_positive_int, default=256, help="hidden size H (a multiple of 16)")
    d.add_argument("--layers", type=_positive_int, default=4, help="decoder layers")
    d.add_argument("--experts", type=_positive_int, default=16, help="routed experts per MoE layer")
    d.add_argument("--top-k", type=_positive_int, default=2, help="experts per token (at most --experts)")
    d.add_argument("--intermediate", type=_positive_int, default=256,
                   help="expert width I (gate_up is [E, 2I, H]; a multiple of 4)")
    d.add_argument("--vocab", type=_positive_int, default=2048, help="vocabulary size (at least 16)")
    d.add_argument("--baseline", default="eager", choices=["eager", "grouped_mm", "batched_mm"],
                   help="transformers experts implementation run on the masked dense weights")
    d.add_argument("--no-block-bench", action="store_true",
                   help="skip the real-size MoE block timing on CUDA")
    d.add_argument("--block-tokens", default="16,4096", type=_token_counts, metavar="T[,T...]",
                   help="comma-separated token counts T for the MoE block timing on CUDA")
    d.add_argument("--json", metavar="PATH", help="also write the measurements to PATH as JSON")
    d.set_defaults(parser=d, frameworks=families is not None)

    i = sub.add_parser("info", help="say how this build was made and what runs here (kernels, GPUs, versions)")
    i.set_defaults(parser=i)
    return p


def _check_demo(args: argparse.Namespace, error: Any) -> None:
    """The checks that involve several arguments or the machine; ``error(message)`` exits."""
    fmt = args.format
    if args.top_k > args.experts:
        error(f"argument --top-k: expected at most --experts ({args.experts}), got {args.top_k}")
    rows = f"format {fmt.name} selects rows in groups of m = {fmt.m}"
    multiples = (  # (argument, value, divisor, why)
        ("hidden", args.hidden, 16, f"the demo model's {HEADS} attention heads need an even width"),
        ("hidden", args.hidden, fmt.m, f"{rows}; the down projection has --hidden rows"),
        ("intermediate", args.intermediate, 4, "2:4 sparsity keeps 2 of every 4 columns of the down projection"),
        ("intermediate", args.intermediate, fmt.m, f"{rows}; gate/up has 2 x --intermediate rows"),
    )
    for name, value, divisor, why in multiples:
        if value % divisor:
            error(f"argument --{name}: expected a multiple of {divisor} ({why}), got {value}")
    if args.vocab < 16:
        error(f"argument --vocab: expected at least 16, got {args.vocab}")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            error(f"argument --json: folder {folder} does not exist")

    import torch

    import samoyeds as sm

    gpu_ok = torch.cuda.is_available() and sm.cuda_available()
    if args.device == "cuda" and not gpu_ok:
        why = "this build has no CUDA kernels" if not sm.build_info()["cuda_compiled"] else "no GPU is visible"
        error(f"argument --device: cuda needs a GPU and samoyeds' CUDA kernels; {why}")
    if args.device == "cuda" or (args.device == "auto" and gpu_ok):
        if args.dtype == "fp32":
            error("argument --dtype: the GPU kernels take bf16 or fp16, got fp32")
        if not (fmt.n == 1 and fmt.m in (1, 2, 4)):
            error(f"argument --format: the GPU kernels run 2:4, 1:2:v and 1:4:v, got {fmt.name}")


# --- helpers ----------------------------------------------------------------------------------------

def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _wall(fn, device: str, repeat: int = 1) -> float:
    """Median wall time of fn() in seconds (device work included)."""
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pct(fraction: float) -> str:
    """25 %, 16.7 %, 26.7 %, 6820 %: three significant digits, no exponent."""
    pct = fraction * 100
    return f"{pct:.3g} %" if pct < 100 else f"{pct:.0f} %"


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _init_weights(model: Any, seed: int) -> None:
    """Seeded normal weights at unit activation scale: token embeddings ~ normal(0, 1), every
    other matrix ~ normal(0, 1/sqrt(fan_in)) (fan_in = its last dimension: the input features
    of nn.Linear and of the [E, out, in] expert weights); vectors (norm scales, biases) keep
    the model's own init.  With transformers' init (std 0.02) the layers add little to the
    residual stream and a random model this small repeats one or two tokens; here each layer
    and the current token weigh alike, so greedy decoding moves from token to token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                std = 1.0 if id(p) in embeddings else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)


# --- demo ------------------------------------------------------------------------------------------

def _demo(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import transformers

    import samoyeds as sm

    fam = _families()
    transformers.logging.set_verbosity_error()
    fmt = args.format
    gpu_ok = torch.cuda.is_available() and sm.cuda_available()
    device = args.device if args.device != "auto" else ("cuda" if gpu_ok else "cpu")
    dtype_key = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    dtype = getattr(torch, DTYPES[dtype_key])

    shape = fam.Shape(vocab=args.vocab, hidden=args.hidden, layers=args.layers, experts=args.experts,
                      top_k=args.top_k, intermediate=args.intermediate, heads=HEADS, kv_heads=KV_HEADS,
                      head_dim=max(16, args.hidden // HEADS),
                      max_positions=max(256, args.prompt_len + args.tokens))
    model = fam.build_model(args.family, shape, seed=args.seed)
    _init_weights(model, args.seed)
    model = model.to(device=device, dtype=dtype)
    depth = f"{shape.layers} layer" + ("s" if shape.layers != 1 else "")
    print(f"samoyeds demo: {args.family} ({type(model).__name__}), {depth}, hidden {shape.hidden}, "
          f"{shape.experts} experts top-{shape.top_k}, expert width {shape.intermediate}, vocab {shape.vocab}; "
          f"random weights (seed {args.seed}), nothing downloaded")
    print(f"device {device}, {str(dtype).replace('torch.', '')}, format {fmt.name}: keeps "
          f"{_pct(fmt.density)} of the expert weight values ({_pct(fmt.sparsity)} pruned)")
    if device == "cpu":
        why = ("on a GPU (--device cuda) the demo times the CUDA kernels" if gpu_ok else
               "no GPU is visible" if sm.build_info()["cuda_compiled"] else
               "this build has no CUDA kernels (to build them: SAMOYEDS_CUDA_ARCHS=90a pip install .)")
        print("on the CPU samoyeds runs its C reference implementation (a correctness oracle, not a fast path), "
              f"so nothing is timed; {why}")

    dense_bytes = sm.hf.experts_weight_nbytes(model)
    seconds = _wall(lambda: sm.patch_model(model, fmt, progress=False), device)
    packed_bytes = sm.hf.experts_weight_nbytes(model)
    layers = sum(1 for m in model.modules() if getattr(m, "_samoyeds", None) is not None)
    print(f"packed {layers} MoE layers in {seconds:.2f} s")
    # The README's ratios are for bfloat16 values: with 4-byte values the same metadata and
    # row indices weigh half as much against them, so the demo gives both where they differ.
    es = torch.empty((), dtype=dtype).element_size()
    values = sum(getattr(m, f"samoyeds_{p}_values").numel() for m in model.modules()
                 if getattr(m, "_samoyeds", None) is not None for p in ("gate_up", "down"))
    ratio_16 = (packed_bytes - values * (es - 2)) / (dense_bytes * 2 / es)
    as_16 = "" if es == 2 else f" ({_pct(ratio_16)} with the 2-byte bfloat16 values of the README's results)"
    print(f"expert weights: {_mb(dense_bytes)} dense -> {_mb(packed_bytes)} packed = "
          f"{_pct(packed_bytes / dense_bytes)} of the dense bytes: the kept {_pct(fmt.density)} of the values, "
          f"plus the 2:4 metadata, the row indices and the padding to whole tiles{as_16}")

    baseline = sm.to_dense(copy.deepcopy(model))          # the identically masked dense weights
    if args.family != "llama4":
        baseline.set_experts_implementation(args.baseline)
    base_name = f"masked-dense {args.baseline if args.family != 'llama4' else 'eager'}"

    gen = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, shape.vocab, (args.batch, args.prompt_len), generator=gen).to(device)
    mask = torch.ones_like(ids)

    with torch.no_grad():
        ours, theirs = model(ids).logits.float(), baseline(ids).logits.float()
    diff = (ours - theirs).abs().max().item()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"prompt logits ({args.batch}x{args.prompt_len} tokens) vs {base_name}: max |diff| {diff:.2e}, "
          f"relative {rel:.2e}, next-token argmax agree {agree:.1%}")

    def generate(m):
        return m.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                          do_sample=False, pad_token_id=0)

    timing: Dict[str, Dict[str, float]] = {}
    outputs = {}
    for name, m in (("samoyeds", model), (base_name, baseline)):
        with torch.no_grad():
            outputs[name] = generate(m)
            if device == "cuda":
                m(ids)                                          # warm-up
                prefill = _wall(lambda: m(ids), device, repeat=3)
                gen_s = _wall(lambda: generate(m), device)
                timing[name] = {"prefill_s": prefill, "generate_s": gen_s,
                                "tokens_per_s": args.batch * args.tokens / gen_s}
    a, b = outputs["samoyeds"][:, ids.shape[1]:], outputs[base_name][:, ids.shape[1]:]
    same = int((a == b).sum())
    first = next((i for i in range(a.shape[1]) if not torch.equal(a[:, i], b[:, i])), None)
    print(f"greedy {args.tokens} new tokens: {same}/{a.numel()} identical to {base_name}"
          + ("" if first is None else f" (first difference at new token {first})"))
    print(f"samoyeds tokens: {a[0].tolist()} ({len(set(a[0].tolist()))} distinct)")
    if timing:
        print(f"{'timing (' + device + ')':<28}{'prefill':>12}{'generate':>12}{'tokens/s':>10}")
        for name, t in timing.items():
            print(f"  {name:<26}{t['prefill_s'] * 1e3:>9.2f} ms{t['generate_s'] * 1e3:>9.1f} ms"
                  f"{t['tokens_per_s']:>10.1f}")

    result: Dict[str, Any] = {
        "family": args.family, "model_class": type(model).__name__, "shape": dict(shape.__dict__),
        "init": "normal(0, fan_in**-0.5) for every matrix", "device": device,
        "dtype": str(dtype).replace("torch.", ""), "format": fmt.name, "density": fmt.density,
        "baseline": base_name, "expert_bytes_dense": dense_bytes, "expert_bytes_packed": packed_bytes,
        "expert_bytes_ratio_16bit": ratio_16,
        "pack_s": seconds, "logits_max_abs_diff": diff, "logits_rel_diff": rel, "argmax_agreement": agree,
        "tokens": a.tolist(), "tokens_identical": same, "tokens_total": int(a.numel()), "timing": timing,
        "versions": {"samoyeds": sm.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        if not args.no_block_bench:
            result["block_bench"] = _block_bench(fmt, args.block_tokens, dtype, args.seed, device)
    return result


# --- real-size MoE block timing --------------------------------------------------------------------

def _time_ms(fn, device: str, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU, the wall clock on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _hf_experts(H: int, I: int, E: int, dtype: Any, impl: str, device: str) -> Any:
    """transformers' experts module (default layout: gate_up [E, 2I, H], down [E, H, I]),
    uninitialised, allocated directly on ``device`` in ``dtype``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    import torch

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=1)
    cfg._experts_implementation = impl
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    return mod.to(dtype).to_empty(device=device).requires_grad_(False)


def _block_bench(fmt: Any, tokens: Sequence[int], dtype: Any, seed: int, device: str = "cuda",
                 shapes: Optional[Dict[str, tuple]] = None) -> List[Dict[str, Any]]:
    """samoyeds.moe.moe_forward vs transformers' grouped_mm experts (torch._grouped_mm) on the
    same x, routing and weights, for ``shapes`` (default BLOCK_SHAPES: name -> (H, I, E, K))."""
    import torch

    import samoyeds as sm
    from samoyeds import moe_forward

    shapes = BLOCK_SHAPES if shapes is None else shapes
    es = torch.empty(0, dtype=dtype).element_size()
    sm.pack(torch.randn(1, 64, 128, device=device, dtype=dtype), fmt, glu=True)     # loads the kernels
    rows = []
    print(f"\nMoE block at real sizes (one layer's experts, {str(dtype).replace('torch.', '')}, same inputs; "
          "grouped_mm runs the dense weights, samoyeds the packed ones; TFLOP/s dense-equivalent):")
    print(f"  {'shape':<15}{'T':>6}{'grouped_mm':>13}{'TFLOP/s':>9}{'samoyeds':>12}{'TFLOP/s':>9}"
          f"{'speed-up':>10}{'rel err':>10}")
    for label, (H, I, E, K) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(seed)
        hf_mod = _hf_experts(H, I, E, dtype, "grouped_mm", device)
        hf_mod.gate_up_proj.normal_(0, H ** -0.5, generator=gen)
        hf_mod.down_proj.normal_(0, I ** -0.5, generator=gen)
        _sync(device)
        t0 = time.perf_counter()
        gu = sm.pack(hf_mod.gate_up_proj, fmt, glu=True)
        dn = sm.pack(hf_mod.down_proj, fmt)
        _sync(device)
        pack_s = time.perf_counter() - t0
        # transformers' module on the masked dense weights: what samoyeds must reproduce
        ref_mod = _hf_experts(H, I, E, dtype, "grouped_mm", device)
        ref_mod.gate_up_proj.copy_(sm.unpack(gu))
        ref_mod.down_proj.copy_(sm.unpack(dn))
        for T in tokens:
            x = torch.randn(T, H, device=device, generator=gen).to(dtype)
            logits = torch.randn(T, E, device=device, generator=gen)
            top_w, top_i = torch.softmax(logits, dim=-1).topk(K, dim=-1)
            top_w = (top_w / top_w.sum(-1, keepdim=True)).to(dtype)
            with torch.inference_mode():
                want = ref_mod(x, top_i, top_w).float()
                got = moe_forward(x, top_i, top_w, gu, dn).float()
                err = ((got - want).norm() / want.norm()).item()
                t_hf = _time_ms(lambda: hf_mod(x, top_i, top_w), device)
                t_sam = _time_ms(lambda: moe_forward(x, top_i, top_w, gu, dn), device)
            flops = 6.0 * T * K * H * I            # gate_up (2I x H) + down (H x I) per routed token
            rows.append({"shape": label, "H": H, "I": I, "E": E, "K": K, "T": T, "grouped_mm_ms": t_hf,
                         "samoyeds_ms": t_sam, "speedup": t_hf / t_sam, "pack_s": pack_s,
                         "grouped_mm_tflops": flops / t_hf / 1e9, "samoyeds_dense_equiv_tflops": flops / t_sam / 1e9,
                         "rel_err_vs_masked_dense": err})
            print(f"  {label:<15}{T:>6}{t_hf:>10.3f} ms{flops / t_hf / 1e9:>9.1f}{t_sam:>9.3f} ms"
                  f"{flops / t_sam / 1e9:>9.1f}{t_hf / t_sam:>9.2f}x{err:>10.1e}")
        print(f"  {label}: packed {E} experts ({3 * E * H * I * es / 2**30:.2f} GiB dense) in {pack_s:.2f} s "
              f"to {(gu.nbytes + dn.nbytes) / 2**30:.2f} GiB")
        del hf_mod, ref_mod, gu, dn
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# --- info ------------------------------------------------------------------------------------------

def _runtime(version: Optional[int]) -> str:
    """CUDART_VERSION as people write it: 13000 -> '13.0', 12080 -> '12.8'."""
    return "unknown" if not version else f"{version // 1000}.{version % 1000 // 10}"


def _installed(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _arch_runs_on(archs: Sequence[str], cc: tuple) -> bool:
    """Whether code built for ``archs`` (e.g. ['sm_80', 'sm_90a']) runs on a device of compute
    capability ``cc``: sm_XYa only on X.Y; sm_XY on X.Z for Z >= Y."""
    for arch in archs:
        digits = arch.removeprefix("sm_").rstrip("a")
        major, minor = int(digits[:-1]), int(digits[-1])
        if arch.endswith("a") and (major, minor) == tuple(cc) or \
                not arch.endswith("a") and major == cc[0] and minor <= cc[1]:
            return True
    return False


def _gpu_lines(archs: Sequence[str], count: int) -> List[str]:
    """One line per visible GPU (its name and architecture when torch is there to ask)."""
    try:
        import torch

        gpus = [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(count)]
    except Exception:  # torch absent or unable to ask: the count alone
        return [f"GPUs: {count} visible: the CUDA kernels run on those of the architectures above"]
    lines = []
    for i, (name, cc) in enumerate(gpus):
        arch = f"{cc[0]}{cc[1]}" + ("a" if cc[0] >= 9 else "")
        if _arch_runs_on(archs, cc):
            lines.append(f"GPU {i}: {name} (sm_{arch}): the CUDA kernels run")
        else:
            lines.append(f"GPU {i}: {name} (sm_{arch}): not among the compiled architectures, the kernels cannot "
                         f"run; rebuild with SAMOYEDS_CUDA_ARCHS={arch} pip install .")
    return lines


def _info_lines() -> List[str]:
    import samoyeds as sm

    info = sm.build_info()
    lines = [f"samoyeds {info['version']}"]
    if info["cuda_compiled"]:
        archs = info["cuda_archs"].split()
        lines.append(f"CUDA kernels: compiled for {info['cuda_archs']} "
                     f"(CUDA runtime {_runtime(info['cuda_runtime_version'])})")
        if info["cuda_devices"]:
            lines += _gpu_lines(archs, info["cuda_devices"])
        else:
            lines.append("GPUs: none visible: the C reference runs (a correctness oracle, not a fast path)")
    else:
        lines.append("CUDA kernels: not compiled (a CPU build): the C reference runs (a correctness oracle, not a "
                     "fast path); to build the kernels: SAMOYEDS_CUDA_ARCHS=90a pip install .")
    lines.append(f"packed weight layout: version {info['layout_version']}; DLPack up to {info['dlpack_max_version']}")
    lines.append(f"torch {_installed('torch')}, transformers {_installed('transformers')}, "
                 f"numpy {_installed('numpy')}")
    return lines


# --- entry point ----------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``samoyeds`` command; returns the exit status (2 for a bad argument)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if not args.frameworks:
            args.parser.error("the demo needs torch and transformers: pip install torch \"samoyeds[hf]\" "
                              "(in the repository: pip install \".[hf]\")")
        _check_demo(args, args.parser.error)
        result = _demo(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"wrote {args.json}")
        return 0
    if args.command == "info":
        print("\n".join(_info_lines()))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
