"""What the epilogue and the token stream cost the warp-specialised wgmma.sp kernel on
gate_up shapes: the same weights (random, one projection over all experts, the same
routed tokens) run four ways --

  gated  gather   glu-packed weights, SwiGLU, x read by index: what a MoE layer runs
  gated  tma      the same rows already in expert order (token_ids None): one TMA box
  plain  gather   the same weights packed without the GLU interleave, no activation:
                  twice the output columns, no gate/up pairing in the epilogue
  plain  tma

Each by CUDA-graph replay (median), with the fraction of the data ceiling
(samoyeds.shared_fill_rate, measured in the same run) that the tile's stream reaches.

  python dev/lab/probe_epilogue.py [--S 8192] [--formats 2:4,samoyeds-1:2:128] [--variant LABEL:VAR=V,VAR=V ...] [--out DIR]

--variant times every way again with those environment variables set (the kernels'
comparison switches, docs/PERFORMANCE.md), in the same run and on the same inputs.
A variant that sets SAMOYEDS_WS_DROP (parts of the kernel left out; read by builds with
SAMOYEDS_NVCC_FLAGS=-DSAM_WS_DROP=1 only) computes no result, so its output is not checked.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))  # common
import samoyeds as sm  # noqa: E402
from common import environment, shared_fill_rates, time_graph, write_json, ws_stream_bytes  # noqa: E402
from token_stream import CASES  # noqa: E402  (the same gate_up shapes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--S", type=int, default=8192, help="routed rows (tokens x top_k)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:VAR=V,...",
                    help="also time every way with these environment variables set")
    ap.add_argument("--formats", default="2:4,samoyeds-1:2:128")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # the breakdowns here are of 1:2:V's 128 x 128 tile (the stream bytes below count its stages)
    # unless SAMOYEDS_WS_TILE says otherwise
    os.environ.setdefault("SAMOYEDS_WS_TILE", "0")
    tall = {"1": 64, "2": 96}.get(os.environ["SAMOYEDS_WS_TILE"], 0)
    variants = [("", {})]
    for v in a.variant:
        label, _, assigns = v.partition(":")
        env = dict(kv.split("=", 1) for kv in assigns.split(",") if kv)
        if not label or not env:
            ap.error(f"--variant: expected LABEL:VAR=V[,VAR=V...], got {v!r}")
        variants.append((label, env))
    if any("SAMOYEDS_WS_DROP" in env for _, env in variants) and not sm.build_info()["ws_drop"]:
        ap.error("--variant sets SAMOYEDS_WS_DROP, which this build ignores: rebuild with "
                 "SAMOYEDS_NVCC_FLAGS=-DSAM_WS_DROP=1")
    gen = torch.Generator(device="cuda").manual_seed(0)
    fill = shared_fill_rates()
    fill_tb_s = fill.get("fill_tma_and_gather_tb_s")
    rows = []
    for fmt in a.formats.split(","):
        m = 1 if fmt == "2:4" else 2
        for name, E, R, C, K in CASES:
            w = torch.randn(E, R, C, generator=gen, device="cuda", dtype=torch.bfloat16) * C ** -0.5
            packed = {"gated": sm.pack(w, fmt, glu=True), "plain": sm.pack(w, fmt)}
            del w
            T = a.S // K
            r = sm.route(torch.rand(T, E, generator=gen, device="cuda").topk(K, -1).indices, E)
            x = torch.randn(T, C, generator=gen, device="cuda", dtype=torch.bfloat16)
            xs = x[r.token_ids.long()].contiguous()
            counts = (r.offsets[1:] - r.offsets[:-1]).tolist()
            row = {"case": name, "fmt": fmt, "E": E, "R": R, "C": C, "S": a.S}
            sbytes = ws_stream_bytes(m, R // (2 if m == 2 else 1), C, counts, tall)
            for kind, p in packed.items():
                act = "swiglu" if kind == "gated" else "none"
                cols = R // 2 if kind == "gated" else R
                for tokens in ("gather", "tma"):
                    out = torch.full((a.S, cols), float("nan"), device="cuda", dtype=torch.bfloat16)
                    for label, env in variants:
                        def fn(p=p, out=out, act=act, tokens=tokens, env=env, x=x, xs=xs):
                            env = dict(env)
                            if tokens == "tma":
                                env["SAMOYEDS_WGMMA_TOKENS_TMA"] = "2"  # an error unless this path runs
                            os.environ.update(env)
                            try:
                                if tokens == "gather":
                                    sm.ssmm(x, p, r.offsets, r.token_ids, out=out, act=act, impl="wgmma_sp")
                                else:
                                    sm.ssmm(xs, p, r.offsets, None, out=out, act=act, impl="wgmma_sp")
                            finally:
                                for k in env:
                                    os.environ.pop(k)
                        out.fill_(float("nan"))
                        fn()
                        torch.cuda.synchronize()
                        computes = env.get("SAMOYEDS_WS_DROP", "0") == "0"  # (dropping stages: no result)
                        if computes and not bool(torch.isfinite(out).all()):
                            raise RuntimeError(f"{fmt} {name} {kind} {tokens} {label}: output rows left unwritten")
                        ms = time_graph(fn)["ms"]
                        key = f"{kind}_{tokens}" + (f"@{label}" if label else "")
                        row[f"{key}_ms"] = ms
                        if fill_tb_s:
                            row[f"{key}_frac_fill"] = sbytes / (ms * 1e-3) / (fill_tb_s * 1e12)
                    del out
            rows.append(row)
            for label, _ in variants:
                at = f"@{label}" if label else ""
                print(f"{fmt:17} {name:24} {label or 'default':10} " + "  ".join(
                    f"{k} {row[f'{k}{at}_ms']:.3f} ms" + (f" ({row[f'{k}{at}_frac_fill']:.2f})" if fill_tb_s else "")
                    for k in ("gated_gather", "gated_tma", "plain_gather", "plain_tma")), flush=True)
            del packed, x, xs
            torch.cuda.empty_cache()
    if a.out:
        write_json(os.path.join(a.out, "probe_epilogue.json"),
                   {"environment": environment(), "command": " ".join(sys.argv), "variants": dict(variants),
                    "fill": fill, "rows": rows})


if __name__ == "__main__":
    main()
