"""MoE routers: samoyeds.router (two launches) against each family's own transformers
router module (a GEMM launch, softmax or sigmoid, top-k and elementwise launches;
DeepSeek-V2's and V3's cast the hidden states and the weight to fp32 and run an FFMA GEMM) on the same
weights and tokens.

For every model and T: the router module of that model's real hidden size, experts and
top-k, built by transformers from its config, before and after samoyeds.patch_model gives
it the SamoyedsRouter subclass (the module's own forward against the patched one, which
runs samoyeds.router); CUDA-graph replays timed with CUDA events (common.time_graph).
Bytes = hidden states + router weight + logits; their rate against a device copy measured
in the same run is the fraction of the memory ceiling.  Each row also records whether the
two chose the same experts (token rows whose id sets differ, and whether every such row
is a tie of the module's own logits), and the time of samoyeds.router with
SAMOYEDS_ROUTER_KERNELS=1 (the split-K logits kernel at every T and the compare-based
arg-max) and, from 512 tokens, =3 (the tile kernel, then the selection kernel) in the same run.

    python dev/lab/bench_router.py [--out DIR] [--tokens 1,16,256,4096,16384]
                                      [--tiny --device cpu]   (a CPU smoke run: the C reference)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from samoyeds import hf  # noqa: E402
from samoyeds.hf import families as hf_families  # noqa: E402
from layer_trace import kernel_times  # noqa: E402
from common import (add_run_args, copy_rate_tb_s, default_dtype, environment, result_path, setup_run,  # noqa: E402
                    time_graph, time_ms, write_json)

MODELS = [  # name, family, hidden, experts, top-k, config overrides
    ("mixtral-8x7b", "mixtral", 4096, 8, 2, {}),
    ("qwen3-30b-a3b", "qwen3_moe", 2048, 128, 8, {"norm_topk_prob": True}),
    ("olmoe", "olmoe", 2048, 64, 8, {}),
    ("deepseek-v2-lite", "deepseek_v2", 2048, 64, 6, {}),
    ("deepseek-v2-group-limited", "deepseek_v2", 5120, 160, 6,
     {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3, "routed_scaling_factor": 16.0}),
    ("deepseek-v3", "deepseek_v3", 7168, 256, 8,
     {"n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    ("gpt-oss-20b", "gpt_oss", 2880, 32, 4, {}),
]
TINY = [("tiny-deepseek", "deepseek_v2", 64, 8, 2, {}), ("tiny-gpt-oss", "gpt_oss", 64, 8, 2, {}),
        ("tiny-deepseek-v3", "deepseek_v3", 64, 16, 4, {"n_group": 4, "topk_group": 2, "norm_topk_prob": True})]


def _router(family, H, E, k, overrides, dtype, dev):
    shape = hf_families.Shape(hidden=H, experts=E, top_k=k, intermediate=64, layers=1, vocab=128)
    model = hf_families.build_model(family, shape, seed=0, dtype=dtype, device=dev, **overrides)
    with torch.no_grad():
        for m in model.modules():  # (DeepSeek-V3: a score correction bias that changes the choice)
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
                m.e_score_correction_bias.normal_(0.0, 0.05)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("gate", "router") and hasattr(mod, "top_k"):
            return mod
    raise RuntimeError(f"{family}: no router module")


def _kernel_us(fn) -> dict:
    """Mean GPU time per call of each kernel fn launches (layer_trace.kernel_times), by short name."""
    out: dict = {}
    for name, us in kernel_times(fn, "cuda").items():
        short = name.replace("(anonymous namespace)::", "").split("<")[0].split("(")[0].split("::")[-1]
        short = short.replace("void ", "")
        out[short] = out.get(short, 0.0) + us
    return out


def _tie(key, got_ids, want_ids, spec) -> bool:
    """Whether one token's two choices differ only by ties of its router's rule: the chosen
    values (key: what the router chooses by, from its own logits) equal within bfloat16
    rounding, or, for a group-limited router, the groups taken differently scoring equal
    within bfloat16 rounding to the last group taken."""
    tol = dict(rtol=2 ** -7, atol=1e-3)
    if torch.allclose(key[got_ids].sort().values, key[want_ids].sort().values, **tol):
        return True
    if spec is None or spec.n_group <= 1:
        return False
    score = torch.softmax(key, 0) if spec.mode == "softmax_topk" else key
    gs = key.numel() // spec.n_group
    groups = score.view(spec.n_group, gs)
    gscore = groups.max(1).values if spec.mode == "softmax_topk" else groups.topk(2, dim=1).values.sum(1)
    kth = gscore.topk(spec.topk_group).values[-1]
    other = set((got_ids // gs).tolist()) ^ set((want_ids // gs).tolist())
    return bool(other) and all(torch.allclose(gscore[g], kth, **tol) for g in other)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=None, help="token counts (default 1,16,256,4096,16384; --tiny 1,37)")
    ap.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    add_run_args(ap, "toy shapes: a CPU check of the script (the C reference against torch)")
    args = ap.parse_args()
    setup_run(args)
    dev, dtype = args.device, default_dtype(args.device)
    torch.manual_seed(args.seed)
    tokens = [int(t) for t in (args.tokens or ("1,37" if args.tiny else "1,16,256,4096,16384")).split(",")]
    copy = copy_rate_tb_s() if dev == "cuda" else None
    rows = []
    models = TINY if args.tiny else MODELS
    if args.models:
        models = [m for m in models if m[0] in args.models.split(",")]
    for name, family, H, E, k, overrides in models:
        r = _router(family, H, E, k, overrides, dtype, dev)
        patched = type(r).__name__.startswith("SamoyedsRouter<")
        base = type(r)._samoyeds_base if patched else type(r)
        if dev == "cuda":  # the clocks up after building the model (its first row ran slow without)
            a = torch.randn(4096, 4096, device=dev, dtype=dtype)
            for _ in range(100):
                a @ a
            torch.cuda.synchronize()
            del a
        for T in tokens:
            x = torch.randn(T, H, device=dev).to(dtype)

            def theirs(x=x):
                with torch.no_grad():
                    base.forward(r, x)

            def ours(x=x):
                # (on the CPU the patched forward is the module's own: run the op, the C reference)
                with torch.no_grad():
                    return r(x) if dev == "cuda" else hf.router.router_run(r, r._samoyeds_router_spec, x)

            with torch.no_grad():
                want, got = base.forward(r, x), ours()
            rl = want[0].float()
            spec = getattr(r, "_samoyeds_router_spec", None)
            if spec is not None and spec.choice_bias:  # (DeepSeek-V3 chooses by sigmoid + its bias)
                rl = torch.sigmoid(rl) + r.e_score_correction_bias.float()
            same = (want[2].sort(1).values == got[2].sort(1).values).all(dim=1)
            differ = int((~same).sum())
            ties = all(_tie(rl[i], got[2][i], want[2][i], spec) for i in (~same).nonzero().flatten().tolist())
            t_prev = t_split = None
            if dev == "cuda":
                t_hf, t_ours = (time_graph(fn)["ms"] for fn in (theirs, ours))
                try:  # (the variable is read as the graph is captured)
                    os.environ["SAMOYEDS_ROUTER_KERNELS"] = "1"
                    t_prev = time_graph(ours)["ms"]
                    if T >= 512:
                        os.environ["SAMOYEDS_ROUTER_KERNELS"] = "3"
                        t_split = time_graph(ours)["ms"]
                finally:
                    del os.environ["SAMOYEDS_ROUTER_KERNELS"]
            else:
                t_hf, t_ours = (time_ms(fn, dev, budget_s=0.05)["ms"] for fn in (theirs, ours))
            kernels = _kernel_us(ours) if dev == "cuda" and T >= 4096 else None
            nbytes = (T * H + E * H) * 2 + T * E * got[0].element_size()
            tb_s = nbytes / (t_ours * 1e-3) / 1e12
            row = {"model": name, "family": family, "H": H, "E": E, "k": k, "T": T, "patched": patched,
                   "ms": {"transformers": t_hf, "samoyeds": t_ours, "samoyeds_previous_kernels": t_prev,
                          "samoyeds_tile_then_select": t_split},
                   "speedup": t_hf / t_ours, "speedup_vs_previous_kernels": t_prev / t_ours if t_prev else None,
                   "bytes": nbytes,
                   "samoyeds_tb_s": tb_s, "frac_of_copy": tb_s / copy if copy else None,
                   "rows_choosing_differently": differ, "differences_are_ties": ties,
                   "max_abs_logit_diff": float((got[0].float() - want[0].float()).abs().max()) if T else 0.0,
                   "kernels_us": kernels}
            rows.append(row)
            frac = f"{row['frac_of_copy']:.0%} of copy" if copy else "(CPU: the C reference)"
            print(f"{name:26s} T={T:5d}  transformers {t_hf * 1e3:8.1f} us  samoyeds {t_ours * 1e3:7.1f} us  "
                  f"{row['speedup']:5.2f}x  {frac}  differing rows {differ} (ties: {ties})"
                  + (f"  previous kernels {t_prev * 1e3:7.1f} us" if t_prev else "")
                  + (f"  tile, then select {t_split * 1e3:7.1f} us" if t_split else "")
                  + (f"  kernels {({k: round(v, 1) for k, v in kernels.items()})}" if kernels else ""), flush=True)
        del r
        if dev == "cuda":
            torch.cuda.empty_cache()
    payload = environment()
    payload.update(copy_tb_s=copy, rows=rows)
    path = result_path(args, "router.json")
    if path:
        write_json(path, payload)


if __name__ == "__main__":
    main()
