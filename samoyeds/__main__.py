"""Command line: ``python -m samoyeds demo`` (or the ``samoyeds`` console script).

``demo`` builds a small random MoE causal LM of a real architecture (nothing is
downloaded), packs its experts into the Samoyeds format in place, and runs it
against the same model with the identically masked dense experts: agreement of
logits and greedy tokens, expert-weight memory, and timing.  On a GPU it also
times one MoE block at real model sizes (Qwen3-30B-A3B, Mixtral-8x7B) against
transformers' ``grouped_mm`` experts on the same inputs.

``info`` prints how this build was made.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

#: Real MoE block shapes for the GPU timing: (hidden H, expert width I, experts E, top-k K).
BLOCK_SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _parser() -> argparse.ArgumentParser:
    from .hf_families import FAMILIES

    p = argparse.ArgumentParser(
        prog="samoyeds",
        description="Mixture-of-Experts on Sparse Tensor Cores (Samoyeds format: vector-wise N:M rows + 2:4).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser(
        "demo", help="patch a small random MoE model and compare it with its masked-dense twin",
        description=(
            "Builds a small random causal LM of the chosen family (default: a Qwen3-MoE-like model, hidden 256, "
            "4 layers, 16 experts, top-2; seeded, nothing downloaded), packs its experts into the sparse format "
            "with samoyeds.patch_model, and runs it next to the same model holding the identically masked dense "
            "expert weights (transformers' own experts code). Prints the agreement of logits and greedy tokens, "
            "the expert-weight memory before and after packing, and timings. On a CUDA device it also times one "
            "MoE block at real sizes (Qwen3-30B-A3B, Mixtral-8x7B) against transformers' grouped_mm experts."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILIES),
                   help="model architecture (its transformers modeling code is used as is)")
    d.add_argument("--format", default="samoyeds-1:2:128",
                   help="sparse format: 'samoyeds-1:2:128' (75%% sparse), 'samoyeds-1:2:64', '2:4' (50%%) "
                        "or 'n:m:v'")
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run; auto: cuda when a GPU and the CUDA kernels are available, else cpu")
    d.add_argument("--dtype", default="auto", choices=["auto"] + sorted(DTYPES),
                   help="model dtype; auto: fp32 on cpu, bf16 on cuda (the GPU kernels take bf16/fp16)")
    d.add_argument("--tokens", type=int, default=16, help="new tokens to generate greedily")
    d.add_argument("--prompt-len", type=int, default=32, help="length of the random prompt")
    d.add_argument("--batch", type=int, default=1, help="prompts per batch")
    d.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt")
    d.add_argument("--hidden", type=int, default=256, help="hidden size H")
    d.add_argument("--layers", type=int, default=4, help="decoder layers")
    d.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer")
    d.add_argument("--top-k", type=int, default=2, help="experts per token")
    d.add_argument("--intermediate", type=int, default=256, help="expert width I (gate_up is [E, 2I, H])")
    d.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    d.add_argument("--init-std", type=float, default=0.1,
                   help="std of the random weights (transformers' 0.02 makes a random model repeat one token)")
    d.add_argument("--baseline", default="eager", choices=["eager", "grouped_mm", "batched_mm"],
                   help="transformers experts implementation run on the masked dense weights")
    d.add_argument("--no-block-bench", action="store_true",
                   help="skip the real-size MoE block timing on CUDA")
    d.add_argument("--block-tokens", default="16,4096",
                   help="comma-separated token counts T for the MoE block timing")
    d.add_argument("--json", metavar="PATH", help="also write the measurements to PATH as JSON")

    sub.add_parser("info", help="print how this build was made (CUDA kernels, architectures, versions)")
    return p


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


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


# --- demo ------------------------------------------------------------------------------------------

def _demo(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import transformers

    import samoyeds as sm
    from . import hf
    from .format import SparseFormat
    from .hf_families import FAMILIES, Shape, build_model

    transformers.logging.set_verbosity_error()
    fmt = SparseFormat.parse(args.format)
    gpu_ok = torch.cuda.is_available() and sm.cuda_available()
    device = args.device if args.device != "auto" else ("cuda" if gpu_ok else "cpu")
    if device == "cuda" and not gpu_ok:
        raise SystemExit("samoyeds demo: --device cuda needs a CUDA GPU and a samoyeds build with the CUDA kernels "
                         f"(torch sees a GPU: {torch.cuda.is_available()}; kernels: {sm.cuda_available()})")
    dtype_key = args.dtype if args.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    dtype = getattr(torch, DTYPES[dtype_key])
    if device == "cuda" and dtype == torch.float32:
        raise SystemExit("samoyeds demo: the GPU kernels take bf16 or fp16; use --dtype bf16 or fp16")

    shape = Shape(vocab=args.vocab, hidden=args.hidden, layers=args.layers, experts=args.experts,
                  top_k=args.top_k, intermediate=args.intermediate, heads=4, kv_heads=2,
                  head_dim=max(16, args.hidden // 4), max_positions=max(256, args.prompt_len + args.tokens),
                  init_std=args.init_std)
    model = build_model(args.family, shape, seed=args.seed).to(device=device, dtype=dtype)
    print(f"samoyeds demo: {args.family} ({type(model).__name__}), {shape.layers} layers, hidden {shape.hidden}, "
          f"{shape.experts} experts top-{shape.top_k}, expert width {shape.intermediate}, vocab {shape.vocab}; "
          f"random weights (seed {args.seed}, std {args.init_std}), nothing downloaded")
    print(f"device {device}, {str(dtype).replace('torch.', '')}, format {fmt.name} "
          f"({fmt.sparsity:.0%} of the expert weights pruned)")

    dense_bytes = hf.experts_weight_nbytes(model)
    seconds = _wall(lambda: hf.patch_model(model, fmt, progress=False), device)
    packed_bytes = hf.experts_weight_nbytes(model)
    layers = sum(1 for m in model.modules() if getattr(m, "_samoyeds", None) is not None)
    print(f"packed {layers} MoE layers in {seconds:.2f} s")
    print(f"expert weights: {_mb(dense_bytes)} dense -> {_mb(packed_bytes)} packed "
          f"({packed_bytes / dense_bytes:.1%}; {dense_bytes - packed_bytes:,} bytes freed)")

    baseline = hf.to_dense(copy.deepcopy(model))          # the identically masked dense weights
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
            m(ids)                                          # warm-up
            prefill = _wall(lambda: m(ids), device, repeat=3)
            outputs[name] = generate(m)
            gen_s = _wall(lambda: generate(m), device)
        timing[name] = {"prefill_s": prefill, "generate_s": gen_s,
                        "tokens_per_s": args.batch * args.tokens / gen_s}
    a, b = outputs["samoyeds"][:, ids.shape[1]:], outputs[base_name][:, ids.shape[1]:]
    same = int((a == b).sum())
    first = next((i for i in range(a.shape[1]) if not torch.equal(a[:, i], b[:, i])), None)
    print(f"greedy {args.tokens} new tokens: {same}/{a.numel()} identical"
          + ("" if first is None else f" (first difference at new token {first})"))
    print(f"samoyeds tokens: {a[0].tolist()}")
    print(f"{'timing (' + device + ')':<28}{'prefill':>12}{'generate':>12}{'tokens/s':>10}")
    for name, t in timing.items():
        print(f"  {name:<26}{t['prefill_s'] * 1e3:>9.2f} ms{t['generate_s'] * 1e3:>9.1f} ms"
              f"{t['tokens_per_s']:>10.1f}")
    if device == "cpu":
        print("  (on the CPU samoyeds runs its C reference implementation: a correctness oracle, not a fast path)")

    result: Dict[str, Any] = {
        "family": args.family, "model_class": type(model).__name__, "shape": shape.__dict__, "device": device,
        "dtype": str(dtype).replace("torch.", ""), "format": fmt.name, "baseline": base_name,
        "expert_bytes_dense": dense_bytes, "expert_bytes_packed": packed_bytes, "pack_s": seconds,
        "logits_max_abs_diff": diff, "logits_rel_diff": rel, "argmax_agreement": agree,
        "tokens_identical": same, "tokens_total": int(a.numel()), "timing": timing,
        "versions": {"samoyeds": sm.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        if not args.no_block_bench:
            tokens = [int(t) for t in args.block_tokens.split(",") if t.strip()]
            result["block_bench"] = _block_bench(fmt, tokens, dtype, args.seed, device)
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
    from .moe import moe_forward

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


# --- entry point ----------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``samoyeds`` command; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        result = _demo(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"wrote {args.json}")
        return 0
    if args.command == "info":
        import samoyeds as sm

        for k, v in sm.build_info().items():
            print(f"{k}: {v}")
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
