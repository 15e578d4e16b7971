"""moe_forward: C reference against a float64 oracle; on the GPU against the
reference, bit-identical across runs, and captured in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

import samoyeds as sm
from samoyeds.moe import moe_forward
from helpers import kernel_names, oracle_moe, random_topk, rel_err, wgmma_runs


def _layer(E, H, I, dtype, gen, fmt="samoyeds-1:2:128"):
    gu = sm.pack((torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(dtype), fmt, glu=True)
    dn = sm.pack((torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype), fmt)
    return gu, dn


@pytest.mark.parametrize("pattern", ["uniform", "skewed", "placeholder", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_forward_reference(pattern, dtype):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    T, K, E, H, I = 19, 2, 6, 64, 96
    gu, dn = _layer(E, H, I, dtype, gen)
    x = torch.randn(T, H, generator=gen).to(dtype)
    idx = random_topk(T, K, E, pattern, gen)
    w = torch.rand(T, K, generator=gen)
    y = moe_forward(x, idx, w, gu, dn)
    assert y.dtype == dtype and y.shape == (T, H)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(y, oracle_moe(x, idx, w, gu, dn)) < tol


def test_moe_forward_zero_tokens():
    gen = torch.Generator().manual_seed(1)
    gu, dn = _layer(4, 64, 64, torch.float32, gen)
    y = moe_forward(torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), gu, dn)
    assert y.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["samoyeds-1:2:128", "2:4", "1:4:128"])
@pytest.mark.parametrize("T", [1, 37, 1000])
def test_moe_forward_cuda(fmt, T):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    K, E, H, I = 4, 16, 256, 384
    gu, dn = _layer(E, H, I, torch.bfloat16, gen, fmt)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = random_topk(T, K, E, "placeholder", gen)
    w = torch.rand(T, K, generator=gen)
    ref = moe_forward(x, idx, w, gu, dn)
    gg, dg = gu.to("cuda"), dn.to("cuda")
    args = (x.cuda(), idx.cuda(), w.cuda(), gg, dg)
    y1 = moe_forward(*args)
    y2 = moe_forward(*args)
    torch.cuda.synchronize()
    assert torch.equal(y1, y2), "moe_forward must be deterministic"
    oracle = oracle_moe(x, idx, w, gu, dn)
    assert rel_err(y1, oracle) <= 2 * rel_err(ref, oracle) + 1e-6


def _captured(fn):
    """(a CUDA graph of fn, fn's output in the graph's memory), after one warm-up call on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn()
    return g, y


@pytest.mark.gpu
def test_moe_forward_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    T, K, E, H, I = 512, 2, 8, 256, 512
    gu, dn = _layer(E, H, I, torch.bfloat16, gen)
    gu, dn = gu.to("cuda"), dn.to("cuda")
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    idx = random_topk(T, K, E, "uniform", gen).cuda()
    w = torch.rand(T, K, generator=gen).cuda()
    g, y = _captured(lambda: moe_forward(x, idx, w, gu, dn))
    # new inputs and a new routing in the same buffers, then replay
    x.copy_(torch.randn(T, H, generator=gen).to(torch.bfloat16))
    idx.copy_(random_topk(T, K, E, "skewed", gen))
    w.copy_(torch.rand(T, K, generator=gen))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, moe_forward(x, idx, w, gu, dn))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["samoyeds-1:2:128", "2:4"])
@pytest.mark.parametrize("T", [1, 5, 37, 300])
def test_moe_forward_programmatic_launches(fmt, T, monkeypatch):
    """The routing, the decode kernels and the combine are programmatic dependent launches
    on sm_90 (each may start while the launch before it ends; the down projection finds its
    expert and requests weights before it waits): three layers chained, the routing from a
    torch top-k just before each, eagerly and in a CUDA graph, bit for bit what the same
    launches give one after the other (SAMOYEDS_PDL=0)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    K, E, H, I = 4, 48, 512, 768
    layers = [tuple(a.to("cuda") for a in _layer(E, H, I, torch.bfloat16, gen, fmt)) for _ in range(3)]
    router = (torch.randn(H, E, generator=gen) * H ** -0.5).to(torch.bfloat16).cuda()
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()

    def chain(x):
        for gu, dn in layers:
            w, idx = torch.topk(torch.softmax((x @ router).float(), dim=-1), K, dim=-1)
            x = moe_forward(x, idx, w, gu, dn) + x
        return x

    monkeypatch.setenv("SAMOYEDS_PDL", "0")
    want = chain(x)
    monkeypatch.setenv("SAMOYEDS_PDL", "1")
    got = [chain(x) for _ in range(3)]  # back to back, no synchronisation between
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = chain(x)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(want).all()
    for o in got + [y]:
        assert torch.equal(o, want)


def _composed(x, idx, w, gu, dn, act="swiglu", gu_bias=None, dn_bias=None, impl="auto"):
    """moe_forward's steps as separate public ops (route, gather_weights, ssmm x2, combine)."""
    r = sm.route(idx, gu.num_experts)
    scale = sm.gather_weights(w, r)
    h = sm.ssmm(x, gu, r.offsets, r.token_ids, act=act, bias=gu_bias, impl=impl, check=False)
    y = sm.ssmm(h, dn, r.offsets, None, bias=dn_bias, scale=scale, impl=impl, check=False)
    return sm.combine(y, r.pos)


def _poisoned(like):
    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


@pytest.mark.parametrize("fmt", ["samoyeds-1:2:64", "2:4"])
@pytest.mark.parametrize("T,pattern", [(0, "uniform"), (1, "one"), (23, "placeholder"), (40, "skewed")])
@pytest.mark.parametrize("act,bias", [("swiglu", False), ("gptoss", True)])
def test_fused_equals_composed_ops(fmt, T, pattern, act, bias):
    """One call into the extension gives, bit for bit, what the five public ops give."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    K, E, H, I = 3, 5, 64, 128
    gu, dn = _layer(E, H, I, torch.float32, gen, fmt)
    x = torch.randn(T, H, generator=gen)
    idx = random_topk(T, K, E, pattern, gen)
    w = torch.rand(T, K, generator=gen)
    gb = torch.randn(E, 2 * I, generator=gen) if bias else None
    db = torch.randn(E, H, generator=gen) if bias else None
    out = _poisoned(x)
    got = moe_forward(x, idx, w, gu, dn, act=act, gate_up_bias=gb, down_bias=db, out=out)
    assert got is out
    want = _composed(x, idx, w, gu, dn, act, gb, db)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["samoyeds-1:2:128", "2:4"])
@pytest.mark.parametrize("T", [0, 3, 300, 1100])
@pytest.mark.parametrize("impl", ["auto", "mma_sp", "decode"])
def test_fused_equals_composed_ops_cuda(fmt, T, impl):
    """moe_forward (routing weights gathered inside the routing launch) bit for bit against
    route, gather_weights, ssmm, ssmm and combine as separate ops; T = 1100 (4400 pairs) takes
    the multi-block routing, with bf16 routing weights."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    K, E, H, I = 4, 12, 256, 384
    gu, dn = _layer(E, H, I, torch.bfloat16, gen, fmt)
    gu, dn = gu.to("cuda"), dn.to("cuda")
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    idx = random_topk(T, K, E, "placeholder", gen).cuda()
    w = torch.rand(T, K, generator=gen).to(torch.bfloat16 if T > 1000 else torch.float32).cuda()
    gb = torch.randn(E, 2 * I, generator=gen).to(torch.bfloat16).cuda()
    out = _poisoned(x)
    got = moe_forward(x, idx, w, gu, dn, act="gptoss", gate_up_bias=gb, impl=impl, out=out)
    want = _composed(x, idx, w, gu, dn, "gptoss", gb, None, impl)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_silu_names_swiglu():
    """"silu" is ssmm's other name of the SwiGLU epilogue, and moe_forward takes it too."""
    gen = torch.Generator().manual_seed(5)
    gu, dn = _layer(4, 64, 64, torch.float32, gen, "2:4")
    x, idx, w = torch.randn(9, 64, generator=gen), random_topk(9, 2, 4, "uniform", gen), torch.rand(9, 2, generator=gen)
    assert torch.equal(moe_forward(x, idx, w, gu, dn, act="silu"), moe_forward(x, idx, w, gu, dn, act="swiglu"))
    with pytest.raises(ValueError, match=r"^act: expected one of \['gptoss', 'silu', 'swiglu'\], got 'none'"):
        moe_forward(x, idx, w, gu, dn, act="none")


def test_top_level_export():
    import samoyeds.moe

    assert sm.moe_forward is samoyeds.moe.moe_forward
    assert "moe_forward" in sm.__all__


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["samoyeds-1:2:128", "2:4", "1:4:128"])
@pytest.mark.parametrize("T,pattern", [(0, "uniform"), (1, "one"), (37, "placeholder"), (300, "skewed"),
                                       (1100, "placeholder")])
@pytest.mark.parametrize("impl", ["auto", "mma_sp", "decode"])
def test_x_copy_is_bit_identical(fmt, T, pattern, impl):
    """config(x_copy=...): gate_up reading x's routed rows from a copy in expert order (into
    the workspace) gives what reading them by index gives, to the bit, for every kernel;
    x's rows strided (ldx > H), H not a multiple of the 64-column k-tile, the output
    poisoned first; both against the float64 oracle."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    K, E, H, I = 4, 12, 264, 384
    gu, dn = _layer(E, H, I, torch.bfloat16, gen, fmt)
    gg, dg = gu.to("cuda"), dn.to("cuda")
    xs = torch.randn(T, H + 24, generator=gen).to(torch.bfloat16).cuda()
    x = xs[:, 8:H + 8]
    idx = random_topk(T, K, E, pattern, gen).cuda()
    w = torch.rand(T, K, generator=gen).cuda()
    got = {}
    for mode in ("never", "always"):
        with sm.config(x_copy=mode):
            got[mode] = moe_forward(x, idx, w, gg, dg, impl=impl, out=_poisoned(x))
    torch.cuda.synchronize()
    assert torch.equal(got["always"], got["never"])
    if T:
        oracle = oracle_moe(x.cpu(), idx.cpu(), w.cpu(), gu, dn)
        assert rel_err(got["always"].cpu(), oracle) < 2e-2


@pytest.mark.gpu
def test_x_copy_rule_takes_wide_experts():
    """Under x_copy="auto" the copy is made where the rule says (on the wgmma.sp kernel,
    I >= SAM_MOE_COPY_X_MIN_I = 4096 and >= SAM_MOE_COPY_X_MIN_ROWS = 256 sorted rows per
    expert), not for narrow experts, few rows per expert or decode sizes; the results are
    bit-identical either way, also captured in a CUDA graph."""
    if not wgmma_runs():
        pytest.skip("the rule copies only for the wgmma.sp kernel (sm_90a)")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    K, E, H = 2, 4, 256
    for I, T, copies in ((4096, 600, True), (1024, 600, False), (4096, 300, False), (4096, 8, False)):
        gu, dn = (a.to("cuda") for a in _layer(E, H, I, torch.bfloat16, gen))
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        idx = random_topk(T, K, E, "skewed", gen).cuda()
        w = torch.rand(T, K, generator=gen).cuda()
        names = kernel_names(lambda: moe_forward(x, idx, w, gu, dn))
        assert any("gather_rows" in n for n in names) == copies, (I, T, names)
        with sm.config(x_copy="never"):
            want = moe_forward(x, idx, w, gu, dn)
        g, y = _captured(lambda: moe_forward(x, idx, w, gu, dn))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want), (I, T)
