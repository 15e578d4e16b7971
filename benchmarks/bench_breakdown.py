"""Breakdown (paper Fig. 17): what each part of the samoyeds MoE layer adds,
measured by composing the layer from samoyeds' ops with parts turned off.

All variants compute the same function (the MoE experts of one layer, top-k
routing, SwiGLU, routing-weighted sum) on the same inputs, routing and masked
weights (samoyeds-1:2:128); each output is checked against (e).  The GPU kernel
pairs a gated activation with a glu-packed gate_up and no activation with a plain
one, so (a)-(c), whose gate_up matmul has no fused activation, read a second
gate_up packed without glu from the same mask (checked equal when unpacked);
(d) and (e) read the glu-packed one.  Every ssmm call here is checked against the
GPU kernel's rules (docs/FORMAT.md) on every device, so a --tiny CPU run fails
where the GPU would.  Each variant's packed weight bytes are recorded
(weights_mib); peak memory is measured above what is allocated before a call, so
the weights, the extra plain copy included, are not in anyone's peak.

  (a) sparse weights     a loop over experts: tokens gathered in torch (x[ids]), ssmm
                         per expert on the gathered rows, SwiGLU and routing weight in
                         torch, index_add_ combine; each matmul's output goes through a
                         transpose copy, the layout a W.X^T sparse kernel hands back
                         (the sparse operand of mma.sp is the left one), and the
                         activation is transposed back to token rows for the down matmul
  (b) + fused gather     ssmm reads the expert's tokens by index from x (no x[ids] copy)
  (c) + layout           ssmm writes token rows the next op reads as is (no transposes)
  (d) + fused epilogues  SwiGLU in the gate_up ssmm, routing weight in the down ssmm
  (e) + one grouped launch  all experts in one ssmm per projection, GPU routing without
                         a host sync, deterministic combine: samoyeds.moe.moe_forward
  dense references       transformers' experts module on the masked dense weights,
                         "grouped_mm" (torch._grouped_mm) and "eager" (a loop over experts)

(a)-(d) loop over experts on the host: they read the per-expert counts once per
call (one device-to-host copy), as any per-expert loop must.  Times are medians of
CUDA-event timings of whole calls (no graph capture: the loops sync), peak memory
per call alongside.

  python benchmarks/bench_breakdown.py [--models qwen3-30b-a3b,mixtral-8x7b] [--tokens 4096] [--out DIR]
                                       [--tiny --device cpu]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from common import (SHAPES, add_run_args, default_dtype, environment, error_text, free_memory,  # noqa: E402
                    peak_mib, result_path, setup_run, time_ms, write_json)
from samoyeds.moe import moe_forward  # noqa: E402


def gpu_refusal(w: sm.PackedWeight, act: str) -> Optional[str]:
    """Why the GPU kernel would refuse ``ssmm(x, w, act=act)``, or None: its rules
    (docs/FORMAT.md; cuda/ssmm.cu sam_ssmm_cuda), checked here on every device
    because the CPU C reference accepts more (e.g. a glu weight with no activation)."""
    n, m, v = w.fmt.c_args()
    if n != 1 or m not in (1, 2, 4):
        return f"the GPU kernel needs n = 1 and m in {{1, 2, 4}} (2:4, 1:2:V, 1:4:V); got {w.fmt.name}"
    if m > 1 and v % 64:
        return f"the GPU kernel needs a slice length v that is a multiple of 64; got {v}"
    if w.glu != (act != "none"):
        return (f"the GPU kernel pairs a gated activation with a glu-packed weight and no activation with a "
                f"plain one (glu={int(w.glu)}, act={act!r})")
    if w.cols % 8:
        return f"the GPU kernel needs the column count to be a multiple of 8; got {w.cols}"
    return None


def ssmm(x, w: sm.PackedWeight, offsets, token_ids=None, *, act: str = "none", scale=None):
    """sm.ssmm under the GPU kernel's rules on every device; no routing check (the
    per-expert offsets are valid by construction: no extra host sync per call, as in
    moe_forward)."""
    why = gpu_refusal(w, act)
    if why:
        raise NotImplementedError(f"ssmm: {why}")
    return sm.ssmm(x, w, offsets, token_ids, act=act, scale=scale, check=False)


VARIANTS = ["a_sparse_weights", "b_fused_gather", "c_layout", "d_fused_epilogues", "e_grouped_launch"]
LABELS = {
    "a_sparse_weights": "(a) sparse weights",
    "b_fused_gather": "(b) + fused gather",
    "c_layout": "(c) + layout",
    "d_fused_epilogues": "(d) + fused epilogues",
    "e_grouped_launch": "(e) + one grouped launch",
    "dense_grouped_mm": "dense grouped_mm",
    "dense_eager": "dense eager",
}


class Layer:
    """One MoE layer's packed experts, split per expert for the looped variants.

    gate_up is glu-packed (for the fused SwiGLU epilogue of (d) and (e));
    gate_up_plain holds the same masked weights packed without glu, for the
    variants whose gate_up matmul has no fused activation ((a)-(c))."""

    def __init__(self, gate_up: sm.PackedWeight, gate_up_plain: sm.PackedWeight, down: sm.PackedWeight):
        if not gate_up.glu or gate_up_plain.glu:
            raise ValueError("gate_up: expected glu=True; gate_up_plain: expected glu=False")
        self.gate_up, self.gate_up_plain, self.down = gate_up, gate_up_plain, down
        self.E = gate_up.num_experts
        self.I = down.cols
        self.H = down.rows
        self.gu = [gate_up.expert(e) for e in range(self.E)]
        self.gu_plain = [gate_up_plain.expert(e) for e in range(self.E)]
        self.dn = [down.expert(e) for e in range(self.E)]

    def weights_mib(self, name: str) -> float:
        """Packed weight bytes the variant reads (the plain gate_up for (a)-(c))."""
        gu = self.gate_up if name in ("d_fused_epilogues", "e_grouped_launch") else self.gate_up_plain
        return (gu.nbytes + self.down.nbytes) / 2**20

    def routing(self, idx, w):
        """Routing metadata, per-expert [0, n_e] offsets (on the device) and host offsets."""
        r = sm.route(idx, self.E)
        scale = sm.gather_weights(w, r)
        local = torch.zeros(self.E, 2, dtype=torch.int32, device=idx.device)
        local[:, 1] = r.offsets[1:] - r.offsets[:-1]
        return r, scale, local, r.offsets.tolist()     # the loop needs the counts on the host


def _transposed(y):
    """The [R, n] storage a W.X^T kernel writes, from our [n, R] rows (one copy)."""
    return y.t().contiguous()


def variant(name: str, L: Layer):
    I = L.I

    def looped(x, idx, w, gather: bool, transposes: bool, epilogues: bool):
        r, scale, local, offs = L.routing(idx, w)
        tok = r.token_ids
        tok_long = tok.long()
        out = torch.zeros_like(x)
        for e in range(L.E):
            s0, s1 = offs[e], offs[e + 1]
            if s1 == s0:
                continue
            ids = tok[s0:s1]
            if gather:
                xe, xid = x, ids                        # ssmm reads x[ids[s]] itself
            else:
                xe, xid = x[tok_long[s0:s1]], None      # a gathered copy
            sc = scale[s0:s1]
            if epilogues:                                                       # glu gate_up, fused SwiGLU
                a = ssmm(xe, L.gu[e], local[e], xid, act="swiglu")
                y = ssmm(a, L.dn[e], local[e], None, scale=sc)
            elif transposes:                                                    # plain gate_up, no activation
                hT = _transposed(ssmm(xe, L.gu_plain[e], local[e], xid))       # [2I, n]
                a = (F.silu(hT[:I]) * hT[I:]).t().contiguous()                  # back to token rows
                yT = _transposed(ssmm(a, L.dn[e], local[e], None))             # [H, n]
                y = yT.t() * sc.to(x.dtype)[:, None]
            else:
                h = ssmm(xe, L.gu_plain[e], local[e], xid)                      # [n, 2I]
                a = F.silu(h[:, :I]) * h[:, I:]
                y = ssmm(a, L.dn[e], local[e], None) * sc.to(x.dtype)[:, None]
            out.index_add_(0, tok_long[s0:s1], y)
        return out

    if name == "a_sparse_weights":
        return lambda x, idx, w: looped(x, idx, w, gather=False, transposes=True, epilogues=False)
    if name == "b_fused_gather":
        return lambda x, idx, w: looped(x, idx, w, gather=True, transposes=True, epilogues=False)
    if name == "c_layout":
        return lambda x, idx, w: looped(x, idx, w, gather=True, transposes=False, epilogues=False)
    if name == "d_fused_epilogues":
        return lambda x, idx, w: looped(x, idx, w, gather=True, transposes=False, epilogues=True)
    if name == "e_grouped_launch":
        return lambda x, idx, w: moe_forward(x, idx, w, L.gate_up, L.down)
    raise ValueError(name)


def hf_experts(H: int, I: int, E: int, dtype, impl: str, device: str, gate_up, down):
    """transformers' experts module (gate_up [E, 2I, H], down [E, H, I]) holding the given weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=1)
    cfg._experts_implementation = impl
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    mod = mod.to(dtype).to_empty(device=device).requires_grad_(False)
    with torch.no_grad():
        mod.gate_up_proj.copy_(gate_up)
        mod.down_proj.copy_(down)
    return mod


def bench_model(name: str, tokens, args) -> list:
    device, dtype = args.device, default_dtype(args.device)
    s = SHAPES[name]
    H, I, E, K = s.hidden, s.inter, s.experts, s.top_k
    if args.tiny:
        H, I, E, K = H // 16, max(32, I // 16), min(E, 8), min(K, 2)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    w_gu = torch.randn(E, 2 * I, H, device=device, generator=gen).to(dtype) * H ** -0.5
    mask = sm.mask(w_gu, args.format)          # one mask for both gate_up packings: the same function
    gate_up = sm.pack(w_gu, args.format, mask, glu=True)             # (d), (e): fused SwiGLU epilogue
    gate_up_plain = sm.pack(w_gu, args.format, mask, glu=False)      # (a)-(c): no fused activation
    del w_gu, mask
    down = sm.pack(torch.randn(E, H, I, device=device, generator=gen).to(dtype) * I ** -0.5, args.format)
    if not torch.equal(sm.unpack(gate_up), sm.unpack(gate_up_plain)):
        raise RuntimeError("gate_up packed with and without glu hold different weights")
    L = Layer(gate_up, gate_up_plain, down)
    free_memory(device)
    methods = {v: variant(v, L) for v in VARIANTS}
    for impl in ("grouped_mm", "eager"):
        if f"dense_{impl}" in args.references:
            mod = hf_experts(H, I, E, dtype, impl, device, sm.unpack(gate_up), sm.unpack(down))
            methods[f"dense_{impl}"] = mod
    weights_mib = {v: L.weights_mib(v) for v in VARIANTS}
    dense_mib = (E * 2 * I * H + E * H * I) * torch.finfo(dtype).bits / 8 / 2**20
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device=device, generator=gen).to(dtype)
        probs = torch.softmax(torch.randn(T, E, device=device, generator=gen), -1)
        w, idx = probs.topk(K, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(dtype)
        row = {"model": name, "T": T, "H": H, "I": I, "E": E, "K": K, "format": args.format, "methods": {}}
        with torch.inference_mode():
            ref = methods["e_grouped_launch"](x, idx, w).float()
            for m, fn in methods.items():
                try:
                    y = fn(x, idx, w).float()
                    err = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    del y
                    t = time_ms(lambda: fn(x, idx, w), device, budget_s=args.budget, min_iters=3, max_iters=50)
                    t["peak_mib"] = peak_mib(lambda: fn(x, idx, w), device)
                    t["rel_err_vs_e"] = err
                    t["weights_mib"] = weights_mib.get(m, dense_mib)
                    row["methods"][m] = t
                except Exception as exc:  # noqa: BLE001 - reported per variant
                    row["methods"][m] = {"error": error_text(exc)}
                free_memory(device)
        _derive(row)
        rows.append(row)
        _print(row)
    return rows


def _derive(row: dict) -> None:
    m = row["methods"]
    prev = None
    for v in VARIANTS:
        if "ms" not in m.get(v, {}):
            prev = None
            continue
        if prev is not None:
            m[v]["gain_over_previous"] = m[prev]["ms"] / m[v]["ms"]
        for ref in ("dense_grouped_mm", "dense_eager"):
            if "ms" in m.get(ref, {}):
                m[v][f"speedup_vs_{ref}"] = m[ref]["ms"] / m[v]["ms"]
        prev = v


def _print(row: dict) -> None:
    print(f"\n{row['model']} T={row['T']} (H={row['H']} I={row['I']} E={row['E']} K={row['K']})")
    for m, d in row["methods"].items():
        if "ms" not in d:
            print(f"  {LABELS[m]:<26} {d.get('error')}")
            continue
        gain = f"{d['gain_over_previous']:.2f}x" if "gain_over_previous" in d else ""
        vs = f"{d['speedup_vs_dense_grouped_mm']:.2f}x" if "speedup_vs_dense_grouped_mm" in d else ""
        print(f"  {LABELS[m]:<26}{d['ms']:>10.3f} ms {gain:>8} {vs:>8}   peak {d['peak_mib']:.0f} MiB"
              f"   rel err vs (e) {d['rel_err_vs_e']:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--references", default="dense_grouped_mm,dense_eager")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per variant")
    add_run_args(ap)
    args = ap.parse_args()
    setup_run(args)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.tiny:
        tokens, args.budget = [min(t, 64) for t in tokens], 0.05
    args.references = args.references.split(",")
    import transformers
    transformers.logging.set_verbosity_error()
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, tokens, args)
    path = result_path(args, "breakdown.json")
    if path:
        write_json(path, {"env": environment(), "labels": LABELS, "variants": VARIANTS, "cases": rows})
    failed = [f"{r['model']} T={r['T']} {m}: {d['error']}" for r in rows for m, d in r["methods"].items()
              if "error" in d]
    if failed and args.tiny:   # a smoke run passes only if every variant ran
        raise SystemExit("failed:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
