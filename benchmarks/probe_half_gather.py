"""PROBE (its results are wrong by design): how fast the warp-specialised kernel's gathered
projections run when each stage gathers only half of its 128 token rows
(SAMOYEDS_PROBE_HALF_GATHER=1), against the full gather, on the same inputs: the most that
sharing each gathered tile between two CTAs (each gathering half) could buy."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import samoyeds as sm  # noqa: E402
from common import SHAPES, environment, time_graph  # noqa: E402

rows = []
for model, T in (("mixtral-8x7b", 4096), ("mixtral-8x7b", 16384), ("qwen3-30b-a3b", 4096), ("olmoe", 16384)):
    s = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.rand(T, s.experts, generator=gen, device="cuda").topk(s.top_k, -1).indices
    r = sm.route(idx, s.experts)
    x = torch.randn(T, s.hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    for fmt in ("samoyeds-1:2:128", "2:4"):
        p = sm.pack(torch.randn(s.experts, 2 * s.inter, s.hidden, generator=gen, device="cuda",
                                dtype=torch.bfloat16), fmt, glu=True)
        out = torch.empty(T * s.top_k, s.inter, device="cuda", dtype=torch.bfloat16)
        res = {}
        for half in ("0", "1"):
            os.environ["SAMOYEDS_PROBE_HALF_GATHER"] = half
            res[half] = time_graph(lambda: sm.ssmm(x, p, r.offsets, r.token_ids, out=out, act="swiglu"))["ms"]
        os.environ.pop("SAMOYEDS_PROBE_HALF_GATHER")
        rows.append({"model": model, "T": T, "fmt": fmt, "full_ms": res["0"], "half_ms": res["1"],
                     "ratio": res["0"] / res["1"]})
        print(f"{model:14} T={T:6} {fmt:17} gate_up full gather {res['0']:.3f} ms, half {res['1']:.3f} ms:"
              f" {res['0'] / res['1']:.2f}x", flush=True)
out_dir = sys.argv[1] if len(sys.argv) > 1 else None
if out_dir:
    with open(os.path.join(out_dir, "probe_half_gather.json"), "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)
