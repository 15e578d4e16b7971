import os, sys, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))
import samoyeds as sm
from common import time_graph
tag = sys.argv[1]
print(tag, sm.__file__, flush=True)
gen = torch.Generator(device="cuda").manual_seed(0)
S = 8192
for fmt in ("2:4", "samoyeds-1:2:128"):
    for name, R, C, act, tokmode in [("gate_up", 28672, 4096, "swiglu", "arange"), ("down", 4096, 14336, "none", "none")]:
        w = torch.randn(1, R, C, generator=gen, device="cuda", dtype=torch.bfloat16)
        p = sm.pack(w, fmt, glu=act != "none"); del w
        x = torch.randn(S, C, generator=gen, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([0, S], dtype=torch.int32, device="cuda")
        tok = torch.arange(S, device="cuda", dtype=torch.int32) if tokmode == "arange" else None
        out = torch.empty(S, R // 2 if act != "none" else R, device="cuda", dtype=torch.bfloat16)
        res = []
        for bt in ("0", "1"):
            os.environ["SAMOYEDS_WGMMA_TOKENS_TMA"] = bt
            ts = [time_graph(lambda: sm.ssmm(x, p, offs, tok, out=out, act=act, impl="wgmma_sp"))["ms"] for _ in range(2)]
            res.append(f"tma={bt} {min(ts):.3f}")
        print(f"{tag:4} {fmt:17} {name:8} " + "  ".join(res), flush=True)
        del p, x, out
