"""Training benchmark of the MoE experts: forward + backward through samoyeds' own autograd
(samoyeds.moe_forward with the packed values as nn.Parameters: ssmm forward, ssmm_dx on the
forward's packing for dX, ssmm_dw for the packed weight gradients) against transformers'
experts module with the "grouped_mm" implementation (torch grouped matmuls and their autograd,
dense bf16 weights), on the same routing, at the five models' shapes.

Per model and T (tokens): ms of a forward with grad enabled and of forward + backward
(gradients of x, the routing weights and every expert weight; grads reset to None before each
call), the ratio grouped_mm / samoyeds (and for "samoyeds_recompute": the same packed weights
with ``save_preact=False``, the backward recomputing the pre-activation; on the GPU for
"samoyeds_glu_copy": ``samoyeds.config(dw_copy="glu_backward")``, the gate_up weight gradient's
copy of dy written by the GLU backward; for "samoyeds_save_gate": ``save_preact="gate"``, the
gate half of the pre-activation kept and the up half recomputed), the activation memory the forward keeps for the
backward (torch.cuda.memory_allocated after the forward minus before, the output excluded),
the peak memory of forward + backward above what was allocated before, and the fraction of
the roofline: dense-equivalent FLOPs (18 S H I for S = T K routed rows: forward 6 S H I, dX
and dW 6 S H I each) at the format's density against twice the dense bf16 matmul rate measured
in the same run (the sparse ceiling of benchmarks/bench_kernel.py), and grouped_mm's dense
FLOPs against the dense rate.

Kernel level (dw_kernel): samoyeds.ops.ssmm_dw alone against the dense weight gradient of the
same projection (torch._grouped_mm over the experts' rows, as grouped_mm's autograd computes it;
inputs gathered and scaled outside the timing), per projection (gate_up: rows gathered by
token id; down: sorted rows with the routing scale).

  python benchmarks/bench_train.py [--models a,b] [--tokens 4096,16384] [--format samoyeds-1:2:128]
                                   [--breakdown | --only-breakdown] [--no-kernel]
                                   [--out DIR] [--tiny --device cpu]   (a CPU smoke run, seconds)

--breakdown (--only-breakdown: nothing else but the dW kernel timing unless --no-kernel) times
every stage of samoyeds' layer forward and backward separately on the same inputs
(breakdown_stages: routing, each ssmm (gate_up writes h and the pre-activation), combine; in the backward
the routing recompute, each dX by the default path (on the GPU the transposed packing's
refresh and ssmm on it where the format has one, else ssmm_dx), each ssmm_dw, the GLU
backward, the bias and routing-weight gradients, combine), beside them (group dx_other,
outside the sums) dX by the other path,
the composed ops' totals (op_total) and the autograd forward + backward, one table per case and
rows under "breakdown".

Writes train.json (command, commit, device, versions in "env").
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
from common import (add_run_args, back_to_back_ms, call_times, environment, error_text, free_memory, is_oom, peak_mib,  # noqa: E402
                    result_path, setup_run, time_graph, wgmma_runs, write_json)

MODELS = "mixtral-8x7b,qwen3-30b-a3b,olmoe,deepseek-v2-lite,gpt-oss-20b"
BUDGET_S = 0.6  # seconds of timed calls per method and case (--tiny: 0.02)
ROUNDS = 3      # the methods take turns in this many rounds per case


def dims(cfg):
    """(H, I, E, K) of a transformers MoE config."""
    H = cfg.hidden_size
    I = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.n_routed_experts
    return H, I, E, cfg.num_experts_per_tok


def routing(T: int, E: int, K: int, device: str, dtype, gen):
    """top-k of random scores: ids [T, K] (distinct per token), renormalised weights [T, K]."""
    probs = torch.softmax(torch.randn(T, E, device=device, generator=gen), -1)
    w, idx = probs.topk(K, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).to(dtype)


class SamoyedsExperts:
    """Packed experts trained through samoyeds.moe_forward's autograd."""

    def __init__(self, E, H, I, fmt, act, bias, device, dtype, gen, save_preact=True):
        self.save_preact = save_preact
        self.config = {}   # samoyeds.config fields its forward and backward run under (fwd_bwd)
        self.gu = sm.pack((torch.randn(E, 2 * I, H, device=device, generator=gen) * H ** -0.5).to(dtype), fmt,
                          glu=True)
        self.dn = sm.pack((torch.randn(E, H, I, device=device, generator=gen) * I ** -0.5).to(dtype), fmt)
        self.gu.values = nn.Parameter(self.gu.values)
        self.dn.values = nn.Parameter(self.dn.values)
        self.act = act
        self.gub = nn.Parameter(torch.zeros(E, 2 * I, device=device, dtype=dtype)) if bias else None
        self.dnb = nn.Parameter(torch.zeros(E, H, device=device, dtype=dtype)) if bias else None
        self.params = [p for p in (self.gu.values, self.dn.values, self.gub, self.dnb) if p is not None]

    def __call__(self, x, idx, w):
        with sm.config(**self.config):
            return sm.moe_forward(x, idx, w, self.gu, self.dn, act=self.act, gate_up_bias=self.gub,
                                  down_bias=self.dnb, save_preact=self.save_preact)


class GroupedMMExperts:
    """transformers' experts module of the model (dense weights), experts implementation grouped_mm."""

    def __init__(self, name, device, dtype, tiny, seed):
        import bench_moe
        holder, _ = bench_moe.random_block(name, device, dtype, tiny, seed)
        bench_moe._set_impl(holder, "grouped_mm")
        self.experts = holder.block.experts.train()
        self.params = [p for p in self.experts.parameters()]
        for p in self.params:
            p.requires_grad_(True)

    def __call__(self, x, idx, w):
        return self.experts(x, idx, w)


def fwd_bwd(method, x, idx, w, gout):
    """One training step's forward and backward.  The packed weights' cached relayouts
    (PackedWeight.transposed) are made stale first, as an optimizer step leaves them: a step
    pays their refresh."""
    for p in method.params:
        p.grad = None
        _force_refresh(p)
    x.grad = w.grad = None
    with sm.config(**getattr(method, "config", {})):
        out = method(x, idx, w)
        out.backward(gout)


def steady_ms(fn, device: str, ms_one: float, span_ms: float = 150.0) -> float:
    """Milliseconds per call of fn() run back to back (common.back_to_back_ms): at least 5
    calls and about span_ms in all."""
    return back_to_back_ms(fn, device, max(5, min(200, int(span_ms / max(ms_one, 1e-3)))))


def activation_mib(method, x, idx, w, device) -> float:
    """Memory the forward keeps for the backward (allocated after minus before, output excluded)."""
    if device != "cuda":
        return float("nan")
    free_memory(device)
    before = torch.cuda.memory_allocated()
    out = method(x, idx, w)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del out
    return kept / 2 ** 20


def dense_rate_tflops(device: str) -> float:
    """Dense bf16 matmul rate (8192^3, random data; CUDA-graph replays), or NaN on the CPU."""
    if device != "cuda":
        return float("nan")
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_graph(lambda: torch.mm(a, b, out=c), budget_s=0.5)["ms"]
    del a, b, c
    return 2 * n ** 3 / (t * 1e-3) / 1e12


VARIANTS = ("recompute", "save_gate", "glu_copy")   # samoyeds_<variant>: --variants


def bench_block(name, tokens, fmt, device, dtype, tiny, seed, dense_tflops, variants=VARIANTS) -> list:
    import bench_moe
    _, cfg = bench_moe._block(name, tiny)
    H, I, E, K = dims(cfg)
    gptoss = name.startswith("gpt-oss")
    density = sm.SparseFormat.parse(fmt).density
    gen = torch.Generator(device=device).manual_seed(seed)
    t0 = time.perf_counter()
    sam = SamoyedsExperts(E, H, I, fmt, "gptoss" if gptoss else "swiglu", gptoss, device, dtype, gen)
    # samoyeds_recompute: the same packed weights, the pre-activation recomputed in the backward
    # (save_preact=False: the least activation memory)
    methods = {"grouped_mm": GroupedMMExperts(name, device, dtype, tiny, seed), "samoyeds": sam}
    if "recompute" in variants:
        methods["samoyeds_recompute"] = copy.copy(sam)
        methods["samoyeds_recompute"].save_preact = False
    if "save_gate" in variants:   # only the gate half kept, the up half recomputed
        methods["samoyeds_save_gate"] = copy.copy(sam)
        methods["samoyeds_save_gate"].save_preact = "gate"
    if "glu_copy" in variants and device == "cuda":   # the gate_up dW's copy of dy made by glu_backward
        methods["samoyeds_glu_copy"] = copy.copy(sam)
        methods["samoyeds_glu_copy"].config = {"dw_copy": "glu_backward"}
    print(f"{name}: experts built and packed in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for T in tokens:
        S = T * K
        dense_flop = 18.0 * S * H * I
        res = {"model": name, "T": T, "format": fmt, "H": H, "I": I, "E": E, "K": K, "routed_rows": S,
               "flop_dense": dense_flop, "flop_samoyeds": dense_flop * density, "methods": {}}
        rows.append(res)
        x = torch.randn(T, H, device=device, generator=gen).to(dtype).requires_grad_(True)
        idx, w = routing(T, E, K, device, dtype, gen)
        w.requires_grad_(True)
        gout = torch.randn(T, H, device=device, generator=gen).to(dtype)
        live, lat_f, lat_fb = [], {}, {}
        for key, m in methods.items():
            try:
                fwd_bwd(m, x, idx, w, gout)
                live.append(key)
                lat_f[key], lat_fb[key] = [], []
            except Exception as exc:  # a method that cannot run this size is reported
                res["methods"][key] = {"error": error_text(exc), "oom": is_oom(exc)}
                free_memory(device)
        for rnd in range(ROUNDS):
            for key in live:
                m = methods[key]
                warm = 2 if rnd == 0 else 0
                lat_f[key] += call_times(lambda: m(x, idx, w), device, budget_s=BUDGET_S / ROUNDS / 2, min_iters=2,
                                         warmup=warm)
                lat_fb[key] += call_times(lambda: fwd_bwd(m, x, idx, w, gout), device, budget_s=BUDGET_S / ROUNDS,
                                          min_iters=2, warmup=warm)
        for key in live:
            m = methods[key]
            r = res["methods"][key] = {"ms_fwd": statistics.median(lat_f[key]),
                                       "ms_fwd_bwd": statistics.median(lat_fb[key]), "calls": len(lat_fb[key]),
                                       # every weight, x and the routing weights got a gradient
                                       "grads": all(t.grad is not None for t in m.params + [x, w])}
            # back to back, as a training loop runs its steps (the host issues a step while the
            # GPU runs the last): what a step costs in steady state, next to the single call above
            r["ms_fwd_bwd_steady"] = steady_ms(lambda: fwd_bwd(m, x, idx, w, gout), device, r["ms_fwd_bwd"])
            r["activation_mib"] = activation_mib(m, x, idx, w, device)
            r["peak_fwd_bwd_mib"] = peak_mib(lambda: fwd_bwd(m, x, idx, w, gout), device)
            sparse = key.startswith("samoyeds")   # (the recomputed gate_up not counted: it is extra work)
            flop = res["flop_samoyeds"] if sparse else dense_flop
            tflops = flop / (r["ms_fwd_bwd"] * 1e-3) / 1e12
            r["tflops"] = tflops
            r["frac_roofline"] = tflops / (2 * dense_tflops if sparse else dense_tflops)
        g = res["methods"].get("grouped_mm", {})
        for key, suffix in (("samoyeds", ""), ("samoyeds_recompute", "_recompute"),
                            ("samoyeds_glu_copy", "_glu_copy"), ("samoyeds_save_gate", "_save_gate")):
            s = res["methods"].get(key, {})
            if "ms_fwd_bwd" in s and "ms_fwd_bwd" in g:
                res["speedup_fwd_bwd" + suffix] = g["ms_fwd_bwd"] / s["ms_fwd_bwd"]
                res["speedup_fwd" + suffix] = g["ms_fwd"] / s["ms_fwd"]
                res["speedup_fwd_bwd_steady" + suffix] = g["ms_fwd_bwd_steady"] / s["ms_fwd_bwd_steady"]
                res["activation_ratio" + suffix] = (g["activation_mib"] / s["activation_mib"]
                                                    if s["activation_mib"] and s["activation_mib"] == s["activation_mib"]
                                                    else None)
        _print_case(res)
        del x, idx, w, gout
        free_memory(device)
    methods.clear()
    free_memory(device)
    return rows


def dense_dw(dy_t, xg, offsets):
    """Per-expert dense dW_e = dy_e^T x_e [E, R, C]: torch._grouped_mm over ragged rows, or a loop."""
    offs = offsets[1:].to(torch.int32)
    try:
        return torch._grouped_mm(dy_t, xg, offs=offs)
    except (RuntimeError, AttributeError, NotImplementedError):
        off = offsets.tolist()
        return torch.stack([dy_t[:, off[e]:off[e + 1]] @ xg[off[e]:off[e + 1]] for e in range(len(off) - 1)])


def dw_problems(name, tokens, fmt, device, dtype, tiny, seed):
    """The inputs of ssmm_dw for each T in tokens and projection of model ``name``'s layer,
    packed weights drawn once: a dict per problem with proj, T, R, C, E, S, the weight w, the
    routing r, dy and x as ssmm_dw reads them (dyin: by token ids dy_ids (down: the layer's
    output gradient, as its backward passes it) or in sorted order; xin: by token ids tok or in
    sorted order), the routing scale (down) and, for the dense reference, dy and x in sorted
    order (dy, xg) and dy scaled (dys).  :func:`run_dw` makes the call."""
    import bench_moe
    _, cfg = bench_moe._block(name, tiny)
    H, I, E, K = dims(cfg)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    gu = sm.pack((torch.randn(E, 2 * I, H, device=device, generator=gen) * H ** -0.5).to(dtype), fmt, glu=True)
    dn = sm.pack((torch.randn(E, H, I, device=device, generator=gen) * I ** -0.5).to(dtype), fmt)
    for T in tokens:
        S = T * K
        idx, _ = routing(T, E, K, device, dtype, gen)
        r = sm.route(idx, E)
        x = torch.randn(T, H, device=device, generator=gen).to(dtype)
        for proj, w, R, C in (("gate_up", gu, 2 * I, H), ("down", dn, H, I)):
            if proj == "gate_up":
                dy = dyin = torch.randn(S, R, device=device, generator=gen).to(dtype)
                dy_ids, xin, tok, scale = None, x, r.token_ids, None
                xg, dys = x[r.token_ids.long()], dy
            else:
                dyin, dy_ids = torch.randn(T, R, device=device, generator=gen).to(dtype), r.token_ids
                dy = dyin[dy_ids.long()]
                xin, tok = torch.randn(S, C, device=device, generator=gen).to(dtype), None
                scale = torch.rand(S, device=device, generator=gen)
                xg, dys = xin, (dy.float() * scale[:, None]).to(dtype)
            yield dict(proj=proj, T=T, R=R, C=C, E=E, S=S, w=w, r=r, dy=dy, dyin=dyin, dy_ids=dy_ids, xin=xin,
                       tok=tok, scale=scale, xg=xg, dys=dys)


def run_dw(pb: dict, out, impl: str = "auto"):
    """ssmm_dw on a :func:`dw_problems` problem, as the layer's backward calls it."""
    from samoyeds.ops import ssmm_dw
    return ssmm_dw(pb["dyin"], pb["xin"], pb["w"], pb["r"].offsets, pb["tok"], pb["scale"], out=out, impl=impl,
                   dy_token_ids=pb["dy_ids"])


def bench_dw(name, tokens, fmt, device, dtype, tiny, seed) -> list:
    """ssmm_dw alone against the dense weight gradient, per projection."""
    density = sm.SparseFormat.parse(fmt).density
    rows = []
    for pb in dw_problems(name, tokens, fmt, device, dtype, tiny, seed):
        proj, T, R, C, E, S = pb["proj"], pb["T"], pb["R"], pb["C"], pb["E"], pb["S"]
        w, r, xg, dys = (pb[k] for k in ("w", "r", "xg", "dys"))
        res = {"model": name, "T": T, "projection": proj, "format": fmt, "R": R, "C": C, "E": E,
               "routed_rows": S, "flop_dense": 2.0 * S * R * C}
        try:
            out = torch.empty_like(w.values)
            t_s = statistics.median(call_times(lambda: run_dw(pb, out),
                                               device, budget_s=BUDGET_S / 2, min_iters=3))
            dyt = dys.t()
            t_d = statistics.median(call_times(lambda: dense_dw(dyt, xg, r.offsets), device,
                                               budget_s=BUDGET_S / 2, min_iters=3))
            if device == "cuda":   # the mma.sync kernel too (the wgmma one's baseline) and, on sm_90a,
                # both producers of the wgmma kernel, whichever the rule picks
                for impl in ("mma", "gather", "copy"):
                    if impl != "mma" and not wgmma_runs():
                        continue
                    t_m = statistics.median(call_times(
                        lambda: run_dw(pb, out, impl),
                        device, budget_s=BUDGET_S / 2, min_iters=3))
                    res.update({f"ms_ssmm_dw_{impl}": t_m, f"speedup_{impl}": t_d / t_m})
            res.update(ms_ssmm_dw=t_s, ms_dense=t_d, speedup=t_d / t_s,
                       tflops_dense_equiv_ssmm_dw=res["flop_dense"] / (t_s * 1e-3) / 1e12,
                       tflops_kept_ssmm_dw=res["flop_dense"] * density / (t_s * 1e-3) / 1e12,
                       tflops_dense=res["flop_dense"] / (t_d * 1e-3) / 1e12)
        except Exception as exc:
            res["error"] = error_text(exc)
        rows.append(res)
        print(f"  dW {name:<16} T={T:>6} {proj:<8} ssmm_dw {res.get('ms_ssmm_dw', float('nan')):8.3f} ms  "
              f"dense {res.get('ms_dense', float('nan')):8.3f} ms  {res.get('speedup', float('nan')):5.2f}x  "
              f"(mma.sync {res.get('ms_ssmm_dw_mma', float('nan')):7.3f}, wgmma gather "
              f"{res.get('ms_ssmm_dw_gather', float('nan')):7.3f}, copy {res.get('ms_ssmm_dw_copy', float('nan')):7.3f} ms)",
              flush=True)
        free_memory(device)
    return rows


# --- --breakdown: where the time of one layer's forward and backward goes -----------------------

def _force_refresh(values) -> None:
    """Forget the cached relayouts' stamps of one packed weight (its transposed and unglued
    copies), so that the next transposed() / unglued() refreshes them as after an optimizer step."""
    from samoyeds import packed as _packed
    for per_meta in (list(_packed._RELAYOUTS.values()) if _packed._RELAYOUTS is not None else []):
        for entry in per_meta.values():
            if entry.stamp is not None and entry.stamp[0] == values.data_ptr():
                entry.stamp = None


def breakdown_stages(m: "SamoyedsExperts", x, idx, w, gout):
    """(group, stage, fn) for every step of samoyeds' layer forward (moe_forward_train_eager)
    and backward (moe_backward_eager, every gradient needed, the pre-activation saved), each
    fn running only its own step on inputs prepared once (untimed) by the steps before: the
    same ops, arguments and shapes as the composed op, so the stages add up to it (host
    overheads of the composed op apart)."""
    from samoyeds import torch_ops as to
    from samoyeds.ops import glu_backward, ssmm_dw as _ssmm_dw
    gu, dn = m.gu, m.dn
    act = to.ACT_IDS[m.act]
    alpha, limit = 1.702, 7.0
    E = gu.num_experts
    T, H = x.shape
    K = idx.shape[1]
    S, I = T * K, gu.rows // 2
    xd = x.detach()
    gub = m.gub.detach() if m.gub is not None else None
    dnb = m.dnb.detach() if m.dnb is not None else None
    xdt = to._dtype_name(xd.dtype)
    # the intermediates, computed once
    r = sm.route(idx.contiguous(), E)
    ws = sm.gather_weights(w.detach().contiguous(), r)
    h, preact = to._gate_up(xd, gu, r, to._opt(gub), m.act, alpha, limit)
    y = sm.ssmm(h, dn, r.offsets, None, bias=to._opt(dnb), scale=ws, check=False)
    dout = gout.detach().to(xd.dtype).contiguous()
    g = dout.index_select(0, r.token_ids) if dnb is not None else None   # (only a down bias's terms read it)
    dh_u = to._matmul_w(dout, dn, r.offsets, r.token_ids, None, S)
    dpre_dt = "float32" if gub is not None else xdt   # as moe_backward_eager: fp32 for the bias sum

    # the other dw_copy path (torch_ops.DW_COPY_PATHS, group "dw_copy_other", not in the sums):
    # glu_backward also writing the gate_up dW's copy of d(preact), ssmm_dw reading it
    dpre_t = to._dy_t_buffer(preact, xd, gu, S)

    def glu_bwd(out_t=None):   # with the routing weights' row dot products (hdot), as moe_backward_eager
        return glu_backward(dh_u, preact, scale=ws, offsets=r.offsets, act=m.act, alpha=alpha, limit=limit,
                            dtype=dpre_dt, hdot=torch.empty(S, dtype=torch.float32, device=xd.device), out_t=out_t)
    dpre = glu_bwd()
    dpre_x = dpre.to(xd.dtype)
    dxs = to._matmul_w(dpre_x, gu, r.offsets, None, None, S)
    pos = r.pos.to(torch.int64)

    def uses_t(wp) -> bool:   # the default dX path takes the transposed packing
        return to._dx_route(xd, wp) == "transposed"

    def refresh(values, get):
        def fn():
            _force_refresh(values)
            return get()
        return fn

    hdot = torch.zeros(S, dtype=torch.float32, device=xd.device)

    def dweights():   # what is left of the routing weights' gradient after glu_backward's hdot
        dws = hdot
        if dnb is not None:
            eid = torch.searchsorted(r.offsets[1:].to(torch.int64), torch.arange(S, device=xd.device),
                                     right=True).clamp(max=dn.num_experts - 1)
            dws = dws + (g.float() * dnb.float().index_select(0, eid)).sum(1)
        return torch.where(pos >= 0, dws[pos.clamp(min=0)], 0.0).to(w.dtype).reshape(w.shape)

    fwd = [
        ("route", lambda: sm.gather_weights(w.detach().contiguous(), sm.route(idx.contiguous(), E))),
        ("ssmm_gate_up", lambda: to._gate_up(xd, gu, r, to._opt(gub), m.act, alpha, limit)),  # h and preact
        ("ssmm_down", lambda: sm.ssmm(h, dn, r.offsets, None, bias=to._opt(dnb), scale=ws, check=False)),
        ("combine", lambda: sm.combine(y, r.pos, dtype=xdt)),
    ]
    bwd = [   # (the backward takes the forward's routing: torch_ops._route)
        ("gather_weights", lambda: sm.gather_weights(w.detach().contiguous(), r)),
        ("glu_recompute", lambda: sm.glu(preact[:, :I], preact[:, I:], act=m.act, alpha=alpha, limit=limit)),
        ("gather_dout", (lambda: dout.index_select(0, r.token_ids)) if dnb is not None else None),
        ("ssmm_dw_down", lambda: _ssmm_dw(dout, h, dn, r.offsets, None, ws, dy_token_ids=r.token_ids)),
        ("down_bias_sum", (lambda: to._segment_sum(g.float() * ws[:, None], r.offsets)) if dnb is not None else None),
        # dX by the default path: on the GPU the transposed packing, refreshed as after an
        # optimizer step, where the format has one; else ssmm_dx (torch_ops.DX_PATHS)
        ("transposed_refresh_down", refresh(dn.values, dn.transposed) if uses_t(dn) else None),
        ("dx_down", lambda: to._matmul_w(dout, dn, r.offsets, r.token_ids, None, S)),
        ("glu_backward", glu_bwd),
        ("dweights", dweights),
        ("gate_up_bias_sum", (lambda: to._segment_sum(dpre, r.offsets)) if gub is not None else None),
        ("cast_dpre", (lambda: dpre.to(xd.dtype)) if gub is not None else None),
        ("ssmm_dw_gate_up", lambda: _ssmm_dw(dpre_x, xd, gu, r.offsets, r.token_ids)),
        ("transposed_refresh_gate_up", refresh(gu.values, gu.transposed) if uses_t(gu) else None),
        ("dx_gate_up", lambda: to._matmul_w(dpre_x, gu, r.offsets, None, None, S)),
        ("combine", lambda: sm.combine(dxs, r.pos, dtype=xdt)),
    ]
    # dX by the other path (group "dx_other", not in the stage sums): ssmm_dx's kernel on the
    # forward's packing where the default takes the transposed one, and the other way round
    def other(dy, wp, tok, proj):
        if uses_t(wp):
            return [(f"ssmm_dx_{proj}", lambda: to._matmul_w(dy, wp, r.offsets, tok, None, S, "ssmm_dx"))]
        if not wp.transposable:
            return []
        return [(f"transposed_refresh_{proj}", refresh(wp.values, wp.transposed)),
                (f"dx_transposed_{proj}", lambda: to._matmul_w(dy, wp, r.offsets, tok, None, S, "transposed"))]
    alt = other(dout, dn, r.token_ids, "down") + other(dpre_x, gu, None, "gate_up")
    copy_other = [] if dpre_t is None else [
        ("glu_backward_out_t", lambda: glu_bwd(dpre_t)),
        ("ssmm_dw_gate_up_dy_t", lambda: _ssmm_dw(dpre_x, xd, gu, r.offsets, r.token_ids, dy_t=dpre_t))]
    n, mm, v = gu.fmt.c_args()
    _, gr, gc = gu.shape3
    _, dr, dc = dn.shape3
    fargs = (xd, idx, w.detach(), gu.values.detach(), gu.meta, gu.idx, gr, gc, dn.values.detach(), dn.meta, dn.idx,
             dr, dc, n, mm, v, act, gub, dnb, alpha, limit)
    total = [
        ("fwd", "op_total", lambda: torch.ops.samoyeds.moe_forward_train(*fargs)),
        ("bwd", "op_total", lambda: torch.ops.samoyeds.moe_backward(
            dout, xd, idx, w.detach(), gu.values.detach(), gu.meta, gu.idx, gr, gc, dn.values.detach(), dn.meta,
            dn.idx, dr, dc, n, mm, v, act, gub, dnb, alpha, limit, preact, None, (1 << 6) - 1)),
        ("fwd_bwd", "autograd", lambda: fwd_bwd(m, x, idx, w, gout)),
    ]
    return ([("fwd", s, f) for s, f in fwd if f is not None] + [("bwd", s, f) for s, f in bwd if f is not None]
            + [("dx_other", s, f) for s, f in alt if f is not None] + [("dw_copy_other", s, f) for s, f in copy_other]
            + total)


def bench_breakdown(name, tokens, fmt, device, dtype, tiny, seed) -> list:
    """Per model and T: median ms of every stage of breakdown_stages (CUDA events around each
    call, from an idle GPU), its share of its group's stage sum, and the composed ops' totals."""
    import bench_moe
    _, cfg = bench_moe._block(name, tiny)
    H, I, E, K = dims(cfg)
    gptoss = name.startswith("gpt-oss")
    gen = torch.Generator(device=device).manual_seed(seed)
    m = SamoyedsExperts(E, H, I, fmt, "gptoss" if gptoss else "swiglu", gptoss, device, dtype, gen)
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device=device, generator=gen).to(dtype).requires_grad_(True)
        idx, w = routing(T, E, K, device, dtype, gen)
        w.requires_grad_(True)
        gout = torch.randn(T, H, device=device, generator=gen).to(dtype)
        fwd_bwd(m, x, idx, w, gout)  # builds the cached relayouts
        case = []
        for group, stage, fn in breakdown_stages(m, x, idx, w, gout):
            row = {"model": name, "T": T, "format": fmt, "H": H, "I": I, "E": E, "K": K, "group": group,
                   "stage": stage}
            try:
                t = call_times(fn, device, budget_s=BUDGET_S / 4, min_iters=3, max_iters=30)
                row.update(ms=statistics.median(t), min_ms=min(t), calls=len(t))
            except Exception as exc:
                row["error"] = error_text(exc)
            case.append(row)
        for group in ("fwd", "bwd"):
            parts = [r for r in case if r["group"] == group and r["stage"] != "op_total" and "ms" in r]
            total = sum(r["ms"] for r in parts)
            for r in parts:
                r["share"] = r["ms"] / total if total > 0 else float("nan")
            case.append({"model": name, "T": T, "format": fmt, "H": H, "I": I, "E": E, "K": K, "group": group,
                         "stage": "stage_sum", "ms": total})
        _print_breakdown(case)
        rows += case
        del x, idx, w, gout
        free_memory(device)
    free_memory(device)
    return rows


def _print_breakdown(case) -> None:
    r0 = case[0]
    print(f"\n{r0['model']} T={r0['T']} (H={r0['H']} I={r0['I']} E={r0['E']} K={r0['K']} {r0['format']})")
    print(f"  {'group':<13} {'stage':<28} {'ms':>9} {'share':>7}")
    for r in case:
        ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9}"
        share = f"{100 * r['share']:6.1f}%" if "share" in r else f"{'':>7}"
        print(f"  {r['group']:<13} {r['stage']:<28} {ms} {share}" + (f"  [{r['error']}]" if "error" in r else ""),
              flush=True)


def _print_case(r) -> None:
    s, g = r["methods"].get("samoyeds", {}), r["methods"].get("grouped_mm", {})
    nan = float("nan")
    print(f"{r['model']:<16} T={r['T']:>6}  fwd+bwd: grouped_mm {g.get('ms_fwd_bwd', nan):8.3f} ms, samoyeds "
          f"{s.get('ms_fwd_bwd', nan):8.3f} ms ({r.get('speedup_fwd_bwd', nan):.2f}x; back to back "
          f"{g.get('ms_fwd_bwd_steady', nan):.3f} / {s.get('ms_fwd_bwd_steady', nan):.3f} ms, "
          f"{r.get('speedup_fwd_bwd_steady', nan):.2f}x)  fwd {r.get('speedup_fwd', nan):.2f}x  "
          f"activations {g.get('activation_mib', nan):.0f} / {s.get('activation_mib', nan):.0f} MiB  "
          f"roofline {g.get('frac_roofline', nan):.2f} / {s.get('frac_roofline', nan):.2f}"
          f"  | pre-activation recomputed: {r.get('speedup_fwd_bwd_recompute', nan):.2f}x, "
          f"activations {r['methods'].get('samoyeds_recompute', {}).get('activation_mib', nan):.0f} MiB"
          f"  | gate half kept: {r.get('speedup_fwd_bwd_save_gate', nan):.2f}x, activations "
          f"{r['methods'].get('samoyeds_save_gate', {}).get('activation_mib', nan):.0f} MiB"
          f"  | dy's gate_up copy by glu_backward: {r.get('speedup_fwd_bwd_glu_copy', nan):.2f}x"
          + "".join(f"  [{k}: {v['error']}]" for k, v in r["methods"].items() if "error" in v), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, "shapes / 16, T <= 64: a quick CPU check of the script")
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--format", default="samoyeds-1:2:128")
    ap.add_argument("--no-kernel", action="store_true", help="skip the ssmm_dw kernel-level timing")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="samoyeds variants timed beside it (comma-separated, '' for none): recompute "
                         "(save_preact=False), save_gate (save_preact='gate'), glu_copy (GPU: "
                         "config(dw_copy='glu_backward'))")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time every stage of samoyeds' layer forward and backward separately "
                         "(rows under 'breakdown' in the JSON)")
    ap.add_argument("--only-breakdown", action="store_true",
                    help="the stage breakdown alone (implies --breakdown; writes train_breakdown.json)")
    args = ap.parse_args()
    setup_run(args)
    global BUDGET_S
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = tuple(v for v in args.variants.split(",") if v)
    if any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: expected names from {', '.join(VARIANTS)}, got {args.variants!r}")
    if args.tiny:
        tokens = sorted({min(t, 64) for t in tokens})
        BUDGET_S = 0.02
    only = args.only_breakdown
    path = result_path(args, "train_breakdown.json" if only else "train.json")
    env = environment()
    dense = dense_rate_tflops(args.device) if not only else float("nan")
    cases, dw, parts = [], [], []

    def save(complete: bool) -> None:  # after every model: a run cut short keeps what it measured
        if path:
            write_json(path, {"env": env, "complete": complete, "format": args.format, "tokens": tokens,
                              "step_refreshes_caches": True,  # fwd_bwd: as after an optimizer step
                              "dense_bf16_tflops": dense, "cases": cases, "dw_kernel": dw, "breakdown": parts})
    for name in args.models.split(","):
        if not only:
            cases += bench_block(name, tokens, args.format, args.device, dtype, args.tiny, args.seed, dense,
                                 variants)
        if args.breakdown or only:
            parts += bench_breakdown(name, tokens, args.format, args.device, dtype, args.tiny, args.seed)
        if not args.no_kernel:
            dw += bench_dw(name, tokens, args.format, args.device, dtype, args.tiny, args.seed)
        save(False)
    save(True)
    print(f"\ndense bf16 matmul: {dense:.0f} TFLOP/s")
    for r in cases:
        _print_case(r)


if __name__ == "__main__":
    main()
