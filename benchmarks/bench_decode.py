"""The decode / small-T ssmm kernel (cuda/ssmm_decode.cu) against the prefill kernels
on the same inputs and routed token sets, and against a device copy measured in the
same run; the threshold sweep with uniform and with skewed routing.

For every (model, projection, T): the routed experts' packed bytes (values + meta +
idx of each expert that gets at least one token) / the kernel time = achieved weight
bandwidth; its ratio to the device-to-device copy rate (read + write counted) is the
fraction of the memory ceiling; the same ratio against a copy moving the same bytes
(half read, half written, timed alike) shows what a launch of that size reaches.  Times
are CUDA-graph replays timed with CUDA events (common.time_graph).  Also the whole MoE
block (moe_forward) with impl="auto" (which runs the decode kernel for small S) against
the prefill kernels.

A call timed alone pays the graph's launch and leaves part of its weights in L2 for the
next replay.  "In a stream" times the decode kernel (and the same-bytes copy, and the
block) as a model's layers run it: n calls back to back in one graph, each on its own
copy of the packed weights (n copies of at least STREAM_BYTES routed bytes in all, so
that L2 cannot hold them across calls), the same inputs and token sets; the time per call.

    python benchmarks/bench_decode.py [--out DIR] [--models M,N] [--format 2:4] [--name bench_decode_24.json]

"auto/serial" is the block with programmatic dependent launch off
(samoyeds.config(pdl=False)): every launch waits for the one before it to end.
The decode kernel's tile variants and token-pass sizes that earlier files time
("decode/v<N>", "decode/t<N>") were decided and removed (docs/lab/decode.md).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from samoyeds.moe import moe_forward  # noqa: E402
from common import environment, gpu_dir, measure_ceilings, time_graph, write_json  # noqa: E402

FMT = "samoyeds-1:2:128"
CASES = [  # model, E, H, I, K, T values (all variants and the block), T values of the threshold sweep
    ("mixtral-8x7b", 8, 4096, 14336, 2, [1, 16], [32, 64, 128]),
    ("qwen3-30b-a3b", 128, 2048, 768, 8, [1, 16, 128], [8, 32, 64, 256, 512]),
    ("olmoe", 64, 2048, 1024, 8, [1, 16, 128], [32, 64, 256]),
]
# the threshold sweep again with skewed routing: expert e drawn with weight (e + 1) ** -SKEW
# (Gumbel top-k): the busiest expert gets 3-4x the mean rows (uniform routing: ~2x)
SKEW = 0.4
SKEWED = [("qwen3-30b-a3b", 128, 2048, 768, 8, [64, 128, 256]), ("olmoe", 64, 2048, 1024, 8, [64, 128, 256])]
# "in a stream": calls on rotated weight copies reading at least this many bytes in all
# (five times the H100's 50 MB L2), at least 2 and at most MAX_COPIES copies
STREAM_BYTES = 256 * 2**20
MAX_COPIES = 32


def pdl(on: bool):
    """samoyeds.config(pdl=on); for a build from before samoyeds.config (timing an older build
    against this one with the same script), SAMOYEDS_PDL, which such builds read at each launch."""
    if hasattr(sm, "config"):
        return sm.config(pdl=on)
    return _env_pdl(on)


@contextlib.contextmanager
def _env_pdl(on: bool):
    old = os.environ.get("SAMOYEDS_PDL")
    os.environ["SAMOYEDS_PDL"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SAMOYEDS_PDL", None)
        else:
            os.environ["SAMOYEDS_PDL"] = old


def stream_copies(nbytes: int) -> int:
    """How many rotated copies a stream of calls reading nbytes each takes."""
    return max(2, min(MAX_COPIES, -(-STREAM_BYTES // max(1, nbytes))))


class Copies:
    """Rotated copies of a packed weight (the first is the weight itself), made on demand."""

    def __init__(self, p: sm.PackedWeight) -> None:
        self.ws = [p]

    def __getitem__(self, n: int) -> list:
        while len(self.ws) < n:
            p = self.ws[0]
            self.ws.append(sm.PackedWeight(p.values.clone(), p.meta.clone(),
                                           None if p.idx is None else p.idx.clone(), p.fmt, p.shape, p.glu))
        return self.ws[:n]


def route_top_k(T: int, E: int, K: int, skew: float, dev: str) -> torch.Tensor:
    """[T, K] expert ids: uniform (skew 0) or with expert e weighted (e + 1) ** -skew."""
    scores = torch.rand(T, E, device=dev)
    if skew:
        gumbel = -torch.log(-torch.log(scores.clamp_min(1e-20)))
        scores = gumbel - skew * torch.log(torch.arange(1, E + 1, device=dev, dtype=torch.float32))
    return scores.topk(K, dim=1).indices


def packed_bytes(p: sm.PackedWeight, experts: torch.Tensor) -> int:
    """Bytes of the packed arrays of the given experts."""
    n = 0
    for a in (p.values, p.meta, p.idx):
        if a is not None:
            n += a[0].numel() * a.element_size() * int(experts.numel())
    return n


def copy_ms(nbytes: int, dev: str) -> float:
    """A device copy moving nbytes (half read, half written), timed as the kernels are: the
    copy rate at this size, launch and ramp-up included."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    return time_graph(lambda: dst.copy_(src), budget_s=0.2)["ms"]


def copy_stream_ms(nbytes: int, n: int, dev: str) -> float:
    """copy_ms in a stream: n such copies back to back, each on its own buffers; per copy."""
    pairs = [(torch.empty(nbytes // 2, dtype=torch.uint8, device=dev).random_(0, 255),
              torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)) for _ in range(n)]

    def fn():
        for src, dst in pairs:
            dst.copy_(src)
    ms = time_graph(fn, inner=n, budget_s=0.2)["ms"]
    del pairs
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--format", default=FMT, help="the packed format of both projections")
    ap.add_argument("--name", default="bench_decode.json", help="the results file's name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="", help="comma-separated subset of the models (default: all)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    dev, dt = "cuda", torch.bfloat16
    ceil = measure_ceilings()
    copy = ceil["copy_tb_s"]
    print(f"device copy {copy:.2f} TB/s (read + write); dense bf16 mm {ceil['dense_bf16_tflops']:.0f} TFLOP/s")
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    fmt = sm.SparseFormat.parse(args.format)
    wgmma_ok = sm90 and (fmt.n == fmt.m or (fmt.n, fmt.m) == (1, 2) and fmt.v % 128 == 0)  # what wgmma.sp takes
    rows = []
    skewed = {m: ts for m, *_, ts in SKEWED}
    only = [m for m in args.models.split(",") if m]
    unknown = sorted(set(only) - {c[0] for c in CASES})
    if unknown:
        ap.error(f"--models: unknown {unknown}; expected some of {[c[0] for c in CASES]}")
    for model, E, H, I, K, Ts, sweep in CASES:
        if only and model not in only:
            continue
        gu = sm.pack((torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).to(dt), args.format, glu=True)
        dn = sm.pack((torch.randn(E, H, I, device=dev) * I ** -0.5).to(dt), args.format)
        copies = {"gate_up": Copies(gu), "down": Copies(dn)}
        torch.cuda.empty_cache()
        for T, skew in [(t, 0.0) for t in Ts + sweep] + [(t, SKEW) for t in skewed.get(model, [])]:
            full = T in Ts and not skew
            x = torch.randn(T, H, device=dev, dtype=dt)
            topk = route_top_k(T, E, K, skew, dev)
            w = torch.softmax(torch.randn(T, K, device=dev), dim=1)
            r = sm.route(topk, E)
            sc = sm.gather_weights(w, r)
            used = torch.unique(topk)
            h = sm.ssmm(x, gu, r.offsets, r.token_ids, act="swiglu", check=False)
            for proj, p, inp, ids, act, scale in (("gate_up", gu, x, r.token_ids, "swiglu", None),
                                                  ("down", dn, h, None, "none", sc)):
                nbytes = packed_bytes(p, used)
                out = sm.ssmm(inp, p, r.offsets, ids, act=act, scale=scale, check=False)
                impls = ["decode", "mma_sp"] + (["wgmma_sp"] if wgmma_ok else [])
                res = {}
                for impl in impls:
                    def fn(impl=impl):
                        sm.ssmm(inp, p, r.offsets, ids, out=out, act=act, scale=scale, impl=impl, check=False)
                    res[impl] = time_graph(fn, budget_s=0.2)["ms"]
                copy_same_ms = copy_ms(nbytes, dev)
                n = stream_copies(nbytes)
                ws = copies[proj][n]

                stream = {}
                for impl in ["decode"] + (["wgmma_sp"] if wgmma_ok else []):
                    def fs(ws=ws, impl=impl):
                        for q in ws:
                            sm.ssmm(inp, q, r.offsets, ids, out=out, act=act, scale=scale, impl=impl, check=False)
                    stream[impl] = time_graph(fs, inner=n, budget_s=0.2)["ms"]
                stream_ms = stream["decode"]
                copy_same_stream = copy_stream_ms(nbytes, n, dev)
                counts = torch.bincount(topk.reshape(-1), minlength=E)
                row = dict(model=model, proj=proj, T=T, K=K, E=E, S=T * K, routed_experts=int(used.numel()),
                           skew=skew, max_rows=int(counts.max()), bytes=nbytes, ms=res, decode_ms=res["decode"],
                           decode_tb_s=nbytes / (res["decode"] * 1e-3) / 1e12)
                row["frac_of_copy"] = row["decode_tb_s"] / copy
                row["copy_same_bytes_ms"] = copy_same_ms
                row["frac_of_copy_same_bytes"] = copy_same_ms / res["decode"]
                row.update(stream_copies=n, stream_ms=stream, decode_stream_ms=stream_ms,
                           copy_same_bytes_stream_ms=copy_same_stream,
                           decode_stream_tb_s=nbytes / (stream_ms * 1e-3) / 1e12)
                row["frac_of_copy_stream"] = row["decode_stream_tb_s"] / copy
                row["frac_of_copy_same_bytes_stream"] = copy_same_stream / stream_ms
                rows.append(row)
                print(f"{model:14s} {proj:7s} T={T:3d}{' skewed' if skew else ''} S={T * K:4d} "
                      f"routed={row['routed_experts']:3d} max rows={row['max_rows']:3d} "
                      f"{nbytes / 1e6:7.1f} MB  " + "  ".join(f"{k} {v * 1e3:7.1f}us" for k, v in res.items())
                      + f"  -> {row['decode_tb_s']:.2f} TB/s ({100 * row['frac_of_copy']:.0f} % of copy; "
                      f"{100 * row['frac_of_copy_same_bytes']:.0f} % of a copy of the same bytes); in a stream of "
                      f"{n}: {stream_ms * 1e3:.1f}us {100 * row['frac_of_copy_stream']:.0f} % of copy, "
                      f"{100 * row['frac_of_copy_same_bytes_stream']:.0f} % of the same-bytes copies"
                      + "".join(f"; {k} {v * 1e3:.1f}us" for k, v in stream.items() if k != "decode") + ")")
            if not full:
                continue
            # the whole block: auto (decode for small S) vs the prefill kernels; "auto/serial":
            # auto with every launch after the one before it has ended (samoyeds.config(pdl=False)),
            # taken in turns with auto
            blk = {}
            names = ["auto", "auto/serial", "decode", "mma_sp"] + (["wgmma_sp"] if wgmma_ok else [])
            for rep in range(2):
                for name in names if rep == 0 else ["auto", "auto/serial"]:
                    impl = name.split("/")[0]

                    def fb(impl=impl, gu=gu, dn=dn):
                        moe_forward(x, topk, w, gu, dn, impl=impl)
                    with pdl(not name.endswith("/serial")):
                        ms = time_graph(fb, budget_s=0.2)["ms"]
                    blk[name] = ms if rep == 0 else min(blk[name], ms)
            # the block in a stream (auto), on rotated copies of both projections' weights
            nbytes = packed_bytes(gu, used) + packed_bytes(dn, used)
            n = stream_copies(nbytes)
            pairs = list(zip(copies["gate_up"][n], copies["down"][n]))

            stream = {}
            for impl in ["auto"] + (["wgmma_sp"] if wgmma_ok else []):
                def fbs(pairs=pairs, impl=impl):
                    for g, d in pairs:
                        moe_forward(x, topk, w, g, d, impl=impl)
                stream[impl] = time_graph(fbs, inner=n, budget_s=0.2)["ms"]
            stream_ms = stream["auto"]
            row = dict(model=model, proj="block", T=T, K=K, E=E, ms=blk, bytes=nbytes, stream_copies=n,
                       stream_ms=stream, auto_stream_ms=stream_ms)
            row["frac_of_copy"] = nbytes / (blk["auto"] * 1e-3) / 1e12 / copy
            row["frac_of_copy_stream"] = nbytes / (stream_ms * 1e-3) / 1e12 / copy
            rows.append(row)
            print(f"{model:14s} block   T={T:3d} S={T * K:4d} " + "  ".join(f"{k} {v * 1e3:7.1f}us" for k, v in blk.items())
                  + f"  weights {nbytes / 1e6:.1f} MB: {100 * row['frac_of_copy']:.0f} % of copy; in a stream of {n}: "
                  f"{stream_ms * 1e3:.1f}us {100 * row['frac_of_copy_stream']:.0f} %"
                  + "".join(f"; {k} {v * 1e3:.1f}us" for k, v in stream.items() if k != "auto"))
        del gu, dn, copies
        torch.cuda.empty_cache()
    path = os.path.join(gpu_dir(args.out), args.name)
    write_json(path, dict(environment(), ceilings=ceil, format=args.format, rows=rows))


if __name__ == "__main__":
    main()
