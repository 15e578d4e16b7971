"""Shared test helpers: random routing patterns, the float64 oracle, error norms."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import samoyeds as sm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def random_topk(T: int, K: int, E: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """[T, K] int64 expert ids: 'uniform', 'one' (all to expert 0 as far as K allows),
    'skewed' (some experts empty), 'placeholder' (some ids >= E)."""
    if T == 0:
        return torch.empty(0, K, dtype=torch.int64)
    if pattern == "one":
        base = torch.arange(K).repeat(T, 1)
        return base % E
    scores = torch.rand(T, E, generator=gen)
    if pattern == "skewed":
        scores[:, E // 2:] *= 0.01  # the upper half rarely chosen; often empty
    idx = scores.topk(K, dim=1).indices
    if pattern == "placeholder":
        drop = torch.rand(T, K, generator=gen) < 0.3
        idx = torch.where(drop, idx + E, idx)
    return idx


def oracle_ssmm(x, dense, offsets, token_ids, act="none", bias=None, scale=None, alpha=1.702, limit=7.0):
    """float64 result for rows [offsets[0], offsets[E]) (same shapes as ssmm's out)."""
    off = offsets.cpu().tolist()
    E, R, C = dense.shape
    S = token_ids.shape[0] if token_ids is not None else x.shape[0]
    cols = R if act == "none" else R // 2
    out = torch.zeros(S, cols, dtype=torch.float64)
    xd, wd = x.cpu().double(), dense.cpu().double()
    for e in range(E):
        s0, s1 = off[e], off[e + 1]
        if s1 == s0:
            continue
        rows = token_ids[s0:s1].cpu().long() if token_ids is not None else torch.arange(s0, s1)
        y = xd[rows] @ wd[e].T
        if bias is not None:
            y = y + bias[e].cpu().double()
        if act == "swiglu":
            y = F.silu(y[:, : R // 2]) * y[:, R // 2:]
        elif act == "gptoss":
            g = y[:, : R // 2].clamp(max=limit)
            u = y[:, R // 2:].clamp(-limit, limit)
            y = (u + 1) * g * torch.sigmoid(alpha * g)
        if scale is not None:
            y = y * scale[s0:s1].cpu().double()[:, None]
        out[s0:s1] = y
    return out


def oracle_moe(x, idx, w, gu, dn, act="swiglu", gate_up_bias=None, down_bias=None, alpha=1.702, limit=7.0):
    """float64 sum_k w[t,k] * down_e(act(gate_up_e(x[t]) + b) + b') from the unpacked weights."""
    G, D = sm.unpack(gu).double(), sm.unpack(dn).double()
    E, I = G.shape[0], G.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if not 0 <= e < E:
                continue
            h = G[e] @ x[t].double()
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].double()
            g, u = h[:I], h[I:]
            if act == "swiglu":
                a = F.silu(g) * u
            else:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                a = (u + 1) * g * torch.sigmoid(alpha * g)
            y = D[e] @ a
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[t] += float(w[t, k]) * y
    return out


def wgmma_runs() -> bool:
    """Whether the sm_90a kernels (ssmm's wgmma.sp, ssmm_dw's wgmma) run here: an sm_90
    device and a build that holds sm_90a code."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and "sm_90a" in str(sm.build_info().get("cuda_archs", "")))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double().cpu(), ref.double().cpu()
    denom = ref.norm().item()
    return (a - ref).norm().item() / (denom if denom > 0 else 1.0)


def to_cpu_packed(p: sm.PackedWeight) -> sm.PackedWeight:
    return p.to("cpu")


def kernel_names(fn) -> list:
    """The names of the CUDA kernels fn launches (torch.profiler; synchronises)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def run_python(args: list, *, env: dict | None = None, **kw):
    """``python ARGS`` in a child process that imports the samoyeds these tests import (an
    installed package, or a tree built in place): that package's folder leads PYTHONPATH and
    the child starts in a temporary folder, since the working directory comes first on the
    path of ``python -c`` and a source checkout there would shadow the installed package."""
    import os
    import subprocess
    import sys
    import tempfile

    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(sm.__file__)),
                                                     full.get("PYTHONPATH")) if p)
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    with tempfile.TemporaryDirectory(prefix="samoyeds-test-") as cwd:
        return subprocess.run([sys.executable] + list(args), env=full, cwd=kw.pop("cwd", cwd), **kw)


def dy_t_of(dy, offsets, scale=None, dtype=None):
    """``dy`` (``[S, R]``, times ``scale`` rounded to dy's dtype where given) in the transposed
    layout by expert segment that ssmm_dw's ``dy_t`` and glu_backward's ``out_t`` hold, built in
    torch from its definition (samoyeds_layout.h, sam_dyt_segment), in ``dtype`` (default
    dy's): zeros but for each expert's rows at its segment."""
    from samoyeds.ops import dy_t_shape
    S, R = dy.shape
    off = [int(v) for v in offsets.tolist()]
    d = dy if scale is None else (dy.float() * scale[:, None]).to(dy.dtype)
    dtype = dtype or dy.dtype
    t = torch.zeros(dy_t_shape(R, S, len(off) - 1), dtype=dtype)
    for e in range(len(off) - 1):
        c0 = (max(off[e], 0) + 64 * e + 63) // 64 * 64
        t[:R, c0:c0 + off[e + 1] - off[e]] = d[off[e]:off[e + 1]].to(dtype).T
    return t
