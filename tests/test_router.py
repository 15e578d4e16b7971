"""samoyeds.router: an MoE block's logits, routing weights and top-k experts.

Every output (the C reference on the CPU, the GPU kernels) is checked against the rule in
float64: the logits against x @ w.T + bias; the choice against the scores computed from
the logits as returned (a valid top-k, largest first, the group limit honoured, equal
scores by either id); the weights against those scores.  Then the patched routers of
transformers' MoE families against their own forward."""
from __future__ import annotations

import copy
import io
import os

import pytest
import torch

import samoyeds as sm
from samoyeds.hf import families as hf_families

from helpers import kernel_names as _kernel_names

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _eps(dtype):
    return {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]


def _chosen_groups(gscore, ids, gs, topk_group):
    """The groups a valid choice took: those above the topk_group-th group score, and of those
    tied with it, the ones an expert was picked from (equal group scores may go either way)."""
    kth = gscore.topk(topk_group, dim=1).values[:, -1:]
    tol_g = 1e-6 * gscore.abs().amax(dim=1, keepdim=True) + 1e-12
    tied = (gscore - kth).abs() <= tol_g
    picked = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, ids // gs, True)
    chosen = (gscore > kth + tol_g) | (tied & picked)
    assert (chosen.sum(dim=1) <= topk_group).all(), "more groups than topk_group"
    return chosen.repeat_interleave(gs, dim=1)


def check(x, w, k, got, *, bias=None, mode="softmax_topk", n_group=1, topk_group=1, renorm=False, scale=1.0,
          choice_bias=None):
    """Asserts that (logits, weights, ids) follow samoyeds.router's rule for these inputs."""
    logits, weights, ids = (t.cpu() for t in got)
    T, E = x.shape[0], w.shape[0]
    assert logits.shape == (T, E) and weights.shape == (T, k) and ids.shape == (T, k)
    assert ids.dtype == torch.int64
    if T == 0:
        return
    assert (ids >= 0).all() and (ids < E).all()
    l64 = x.cpu().double() @ w.cpu().double().T
    if bias is not None:
        l64 = l64 + bias.cpu().double()
    mag = x.cpu().double().abs() @ w.cpu().double().abs().T + 1e-30
    # one rounding to the logits' dtype, plus fp32 sums of H products
    tol_l = _eps(logits.dtype) * l64.abs() + 1e-5 * mag + 1e-6
    assert ((logits.double() - l64).abs() <= tol_l).all(), float((logits.double() - l64).abs().max())
    ld = logits.double()
    if mode == "softmax_topk":
        s = torch.softmax(ld, dim=1)
        if n_group > 1:
            gs = E // n_group
            chosen = _chosen_groups(s.view(T, n_group, gs).amax(dim=2), ids, gs, topk_group)
            s = torch.where(chosen, s, torch.zeros_like(s))
        tol_s = 1e-6 * s.abs().amax(dim=1, keepdim=True) + 1e-12
    elif mode == "sigmoid_topk":
        p = torch.sigmoid(ld)
        s = p + (choice_bias.cpu().double() if choice_bias is not None else 0.0)
        if n_group > 1:
            gs = E // n_group
            chosen = _chosen_groups(s.view(T, n_group, gs).topk(2, dim=2).values.sum(dim=2), ids, gs, topk_group)
            s = torch.where(chosen, s, torch.full_like(s, float("-inf")))
        tol_s = 1e-6 * (s.abs().nan_to_num(posinf=0.0).amax(dim=1, keepdim=True) + 1)
    else:
        s = ld
        tol_s = 1e-6 * (ld.abs().amax(dim=1, keepdim=True) + 1)
    assert all(len(set(r)) == k for r in ids.tolist()), "an expert picked twice"
    pick = s.gather(1, ids)
    bad = ~(pick[:, :-1] >= pick[:, 1:] - tol_s).all(dim=1)
    assert not bad.any(), ("not largest first", bad.nonzero()[:3].tolist(), ids[bad][:3].tolist(), pick[bad][:3])
    rest = s.scatter(1, ids, float("-inf"))
    bad = ~(pick[:, -1:] >= rest.amax(dim=1, keepdim=True) - tol_s).all(dim=1)
    assert not bad.any(), ("not the k largest", bad.nonzero()[:3].tolist(), ids[bad][:3].tolist(), pick[bad][:3],
                           rest[bad].topk(2, dim=1))
    if mode == "softmax_topk":
        v = pick
        if renorm:
            v = v / v.sum(dim=1, keepdim=True)
    elif mode == "sigmoid_topk":
        v = p.gather(1, ids)
        if renorm:
            v = v / (v.sum(dim=1, keepdim=True) + 1e-20)
    else:
        v = torch.softmax(pick, dim=1)
    v = v * scale
    tol_w = 2 * _eps(weights.dtype) * v.abs() + 1e-6 * abs(scale)
    assert ((weights.double() - v).abs() <= tol_w).all(), float((weights.double() - v).abs().max())


def _inputs(T, E, H, dtype, gen, device="cpu", bias_dtype=None, spread=3.0):
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = (spread * torch.randn(E, H, generator=gen) / H ** 0.5).to(dtype)
    b = None if bias_dtype is None else torch.randn(E, generator=gen).to(bias_dtype).to(device)
    return x.to(device), w.to(device), b


def _poisoned(T, E, k, ld, wd, device="cpu"):
    return (torch.full((T, E), float("nan"), dtype=ld, device=device),
            torch.full((T, k), float("nan"), dtype=wd, device=device),
            torch.full((T, k), -7, dtype=torch.int64, device=device))


CASES = [  # (mode, k, n_group, topk_group, renorm, scale, with bias: the choice bias for sigmoid_topk)
    ("softmax_topk", 2, 1, 1, True, 1.0, False),       # Mixtral
    ("softmax_topk", 8, 1, 1, False, 1.0, False),      # Qwen3 / OLMoE without norm_topk_prob
    ("softmax_topk", 6, 1, 1, False, 2.5, False),      # DeepSeek-V2 greedy
    ("softmax_topk", 6, 4, 2, False, 16.0, False),     # DeepSeek-V2 group-limited
    ("softmax_topk", 1, 1, 1, True, 1.0, True),
    ("topk_softmax", 4, 1, 1, False, 1.0, True),       # GPT-OSS
    ("sigmoid_topk", 8, 4, 2, True, 2.5, True),        # DeepSeek-V3
    ("sigmoid_topk", 3, 1, 1, False, 1.0, False),
]


def _kwargs(case, b):
    mode, k, ng, tg, renorm, scale, _ = case
    return dict(mode=mode, n_group=ng, topk_group=tg, renorm=renorm, scale=scale,
                **{"choice_bias" if mode == "sigmoid_topk" else "bias": b})


def _on(kw, device):
    return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in kw.items()}


def _fits(case, E):
    mode, k, ng, tg, *_ = case
    return k <= E and E % ng == 0 and (mode != "sigmoid_topk" or ng == 1 or E // ng >= 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_follows_the_rule(dtype):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for T, E, H in ((1, 8, 8), (5, 12, 24), (9, 64, 40), (3, 33, 3), (0, 16, 8), (4, 16, 0)):
        for case in CASES:
            if not _fits(case, E):
                continue
            k, with_bias = case[1], case[6]
            for ld in {dtype, "float32"}:
                x, w, b = _inputs(T, E, H, DT[dtype], gen, bias_dtype=DT[dtype] if with_bias else None)
                out = _poisoned(T, E, k, DT[ld], torch.float32)
                kw = _kwargs(case, b)
                got = sm.router(x, w, k, out=out, **kw)
                assert all(a is b_ for a, b_ in zip(got, out))
                check(x, w, k, got, **kw)


def test_reference_ties_pick_the_lower_id():
    x = torch.ones(3, 8)
    w = torch.zeros(6, 8)
    w[[1, 3, 4]] = 1.0   # experts 1, 3 and 4 tie at the top
    logits, weights, ids = sm.router(x, w, 2, logits_dtype="float32")
    assert ids.tolist() == [[1, 3]] * 3
    assert torch.allclose(weights, weights[:, :1].expand(3, 2))
    # group-limited: groups {0, 1}, {2, 3}, {4, 5}; the first two tie at the top
    _, _, ids = sm.router(x, w, 2, n_group=3, topk_group=1, logits_dtype="float32")
    assert ids.tolist() == [[1, 0]] * 3


def test_defaults_and_strided_rows():
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(6, 40, generator=gen).to(torch.bfloat16)
    w = torch.randn(10, 24, generator=gen).to(torch.bfloat16)
    logits, weights, ids = sm.router(big[:, :24], w, 3)
    assert logits.dtype == torch.bfloat16 and weights.dtype == torch.float32
    check(big[:, :24], w, 3, (logits, weights, ids))


def test_errors_name_the_argument():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    i64 = torch.empty(4, 2, dtype=torch.int64)
    cases = [
        (lambda: sm.router(x, w, 0), ValueError, r"k: expected 1 <= k <= min\(experts = 8, 32\), got 0"),
        (lambda: sm.router(x, w, 9), ValueError, r"k: expected .*, got 9"),
        (lambda: sm.router(x, torch.randn(40, 16), 33), ValueError, r"k: expected 1 <= k <= min\(experts = 40, 32\), got 33"),
        (lambda: sm.router(x, torch.randn(513, 16), 2), ValueError, "w: expected 1 to 512 rows"),
        (lambda: sm.router(x, w, 2, n_group=3), ValueError, "n_group, topk_group: expected .*, got 3, 1"),
        (lambda: sm.router(x, w, 2, n_group=4, topk_group=5), ValueError, "n_group, topk_group: expected .*, got 4, 5"),
        (lambda: sm.router(x, w, 2, n_group=2, mode="topk_softmax"), ValueError, "groups only with modes 0 and 2"),
        (lambda: sm.router(x, w, 2, mode="sigmoid"), ValueError, "mode: expected one of"),
        (lambda: sm.router(x, w, 2, choice_bias=torch.randn(8)), ValueError, "choice_bias: expected None with mode 0"),
        (lambda: sm.router(x, w, 2, mode="sigmoid_topk", choice_bias=torch.randn(7)), ValueError, "choice_bias"),
        (lambda: sm.router(x, w, 2, mode="sigmoid_topk", n_group=8), ValueError, "at least two experts per group"),
        (lambda: sm.router(x[:, :8], w, 2), ValueError, r"x: expected shape \(4, 16\), got \(4, 8\)"),
        (lambda: sm.router(x, w.half(), 2), TypeError, r"(w: expected dtype float32 \(that of x\)|x: expected dtype float16 \(that of w\))"),
        (lambda: sm.router(x, w, 2, bias=torch.randn(7)), ValueError, "bias"),
        (lambda: sm.router(x, w, 2, bias=torch.randn(8).double()), TypeError, "bias: expected dtype"),
        (lambda: sm.router(x, w, 2, logits_dtype="float64"), TypeError, "logits: expected dtype"),
        (lambda: sm.router(x, w, 2, out=(torch.empty(4, 8), torch.empty(4, 2), torch.empty(4, 2, dtype=torch.int32))),
         TypeError, "ids"),
        (lambda: sm.router(x, w, 2, out=(torch.empty(4, 7), torch.empty(4, 2), i64)), ValueError, "logits"),
        (lambda: sm.router(x, w, 2, out=(torch.empty(4, 8), torch.empty(4, 3), i64)), ValueError, "weights"),
        (lambda: sm.router(x, w, 2, out=(x.view(-1)[:32].view(4, 8), torch.empty(4, 2), i64)), ValueError, "logits: expected an output that shares no memory with x"),
        (lambda: sm.router(x, w, 2, out=(torch.empty(4, 8),)), TypeError, "out: expected a tuple"),
        (lambda: sm.router([1.0], w, 2), TypeError, "x: expected a tensor"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()


# ---- patched models (CPU) -------------------------------------------------------------------

SHAPE = hf_families.Shape(hidden=64, intermediate=32, experts=8, top_k=2, layers=2)
ROUTED = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"]


def _routers(model):
    return {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("gate", "router")
            and hasattr(m, "top_k")}


@pytest.mark.parametrize("family", ROUTED + ["phimoe", "granitemoe"])
def test_patch_swaps_known_routers(family):
    """The routers whose rule samoyeds knows take a SamoyedsRouter subclass of their own class
    (checked against their own forward at patch time), keep their parameters and give the
    same logits on the CPU (their own forward runs there); others are left alone;
    unpatch_model gives the class back."""
    model = hf_families.build_model(family, SHAPE, seed=3)
    before = {n: type(m) for n, m in _routers(model).items()}
    params = {n: m.weight for n, m in _routers(model).items()}
    keys = set(model.state_dict())
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    known = family in ROUTED
    for n, m in _routers(model).items():
        assert isinstance(m, before[n]) and m.weight is params[n]
        assert type(m).__name__.startswith("SamoyedsRouter<") == known, type(m).__name__
    router_keys = {k for k in keys if any(k.startswith(n + ".") for n in before)}
    assert router_keys and router_keys <= set(model.state_dict())
    ids = torch.randint(3, SHAPE.vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert torch.equal(loaded(ids).logits, logits)
        assert torch.equal(copy.deepcopy(model)(ids).logits, logits)
    assert [type(m) for m in _routers(loaded).values()] == [type(m) for m in _routers(model).values()]
    sm.unpatch_model(model)
    assert {n: type(m) for n, m in _routers(model).items()} == before


def test_checkpoint_and_sparsify_swap_routers(tmp_path):
    """samoyeds.from_pretrained and sparsify_model give the routers their SamoyedsRouter
    subclass as patch_model does; unpatch_model undoes it."""
    model = hf_families.build_model("deepseek_v3", SHAPE, seed=4, n_group=4, topk_group=2)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    sm.save_pretrained(model, tmp_path / "ckpt")
    loaded = sm.from_pretrained(tmp_path / "ckpt")
    kinds = [type(m).__name__ for m in _routers(loaded).values()]
    assert kinds and all(k.startswith("SamoyedsRouter<") for k in kinds), kinds
    sm.unpatch_model(loaded)
    assert not any(type(m).__name__.startswith("SamoyedsRouter<") for m in loaded.modules())
    pruned = hf_families.build_model("mixtral", SHAPE, seed=5)
    sm.sparsify_model(pruned, "samoyeds-1:2:128", "magnitude")
    kinds = [type(m).__name__ for m in _routers(pruned).values()]
    assert kinds and all(k.startswith("SamoyedsRouter<") for k in kinds), kinds


def test_patch_keeps_a_router_whose_rule_differs(monkeypatch):
    """A rule that does not give the module's own outputs on the probe is not used."""
    from samoyeds.hf import router as hf_router

    real = hf_router.router_spec

    def wrong(mod):
        spec = real(mod)
        return None if spec is None else hf_router.RouterSpec(spec.k, renorm=not spec.renorm)

    monkeypatch.setattr(hf_router, "router_spec", wrong)
    model = hf_families.build_model("mixtral", SHAPE, seed=3)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    assert not any(type(m).__name__.startswith("SamoyedsRouter<") for m in _routers(model).values())


def test_patch_model_router_false_keeps_every_router(tmp_path):
    """patch_model(..., router=False) and from_pretrained(..., router=False) leave every
    router its own class; a router argument that is not a bool is refused."""
    model = hf_families.build_model("mixtral", SHAPE, seed=3)
    before = [type(m) for m in _routers(model).values()]
    sm.patch_model(model, "samoyeds-1:2:128", progress=False, router=False)
    assert [type(m) for m in _routers(model).values()] == before
    sm.save_pretrained(model, tmp_path / "ckpt")
    loaded = sm.from_pretrained(tmp_path / "ckpt", router=False)
    assert [type(m) for m in _routers(loaded).values()] == before
    with pytest.raises(TypeError, match="router: expected a bool"):
        sm.patch_model(hf_families.build_model("mixtral", SHAPE, seed=3), progress=False, router=0)


def test_group_limited_deepseek_router_is_swapped():
    model = hf_families.build_model("deepseek_v2", SHAPE, seed=3, topk_method="group_limited_greedy", n_group=4,
                                    topk_group=2)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    (r,) = _routers(model).values()
    assert type(r).__name__.startswith("SamoyedsRouter<")
    assert (r._samoyeds_router_spec.n_group, r._samoyeds_router_spec.topk_group) == (4, 2)


# ---- GPU ------------------------------------------------------------------------------------

SHAPES = [  # (T, E, H): token tiles of 8 / 16 / 32, expert tiles of 16 / 32 / 64, 8-warp column blocks
    (1, 8, 8), (1, 64, 2048), (2, 60, 72), (5, 128, 264), (8, 16, 40), (9, 33, 136), (16, 64, 8),
    (17, 256, 1032), (33, 100, 256), (100, 64, 2048), (1023, 512, 64), (1025, 64, 264), (2051, 128, 512),
    (0, 64, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_follows_the_rule_and_matches_reference(dtype):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for i, (T, E, H) in enumerate(SHAPES):
        for j, case in enumerate(CASES):
            if not _fits(case, E) or (T > 1000 and j % 2):
                continue
            k, with_bias = case[1], case[6]
            ld = "float32" if (i + j) % 2 else dtype
            wd = "float32" if (i + j) % 3 else dtype
            bd = (torch.float32 if j % 2 else DT[dtype]) if with_bias else None
            x, w, b = _inputs(T, E, H, DT[dtype], gen, bias_dtype=bd)
            kw = _kwargs(case, b)
            out = _poisoned(T, E, k, DT[ld], DT[wd], "cuda")
            got = sm.router(x.cuda(), w.cuda(), k, out=out, **_on(kw, "cuda"))
            assert all(a is b_ for a, b_ in zip(got, out))
            check(x, w, k, got, **kw)
            ref = sm.router(x, w, k, logits_dtype=ld, weights_dtype=wd, **kw)
            check(x, w, k, ref, **kw)
            if T:
                gl, rl = got[0].cpu().double(), ref[0].double()
                assert ((gl - rl).abs() <= 2 * _eps(DT[ld]) * rl.abs() + 1e-4).all(), (T, E, H, case)


TILE_SHAPES = [  # (T, E, H, the tile kernel chooses): from 512 tokens (8192 up to 16 experts), on a 132-SM H100
    (4000, 16, 64, None),        # the split-K kernel (tokens x experts a CTA below)
    (512, 20, 16, True),         # 32 x 64
    (6500, 24, 72, True),        # 64 x 32
    (12800 + 37, 8, 136, True),  # 128 x 32
    (1025, 64, 264, True),       # 32 x 64
    (7001, 64, 136, True),       # 64 x 64
    (12600, 60, 40, False),      # 128 x 64 (8 lanes a token: four turns a warp)
    (3300, 100, 200, True),      # 32 x 128
    (9000, 128, 40, False),      # 64 x 128 (16 lanes a token: four turns)
    (12700, 72, 24, False),      # 128 x 128 (eight turns)
    (4000, 250, 72, False),      # 64 x 128, two expert tiles
    (3300, 512, 200, False),     # 128 x 128, four expert tiles
]


@pytest.mark.gpu
def test_gpu_tile_kernel_shapes():
    """From 512 tokens the logits run on the tile kernel (every tile shape it picks, rows
    past T, experts past E, columns past H), which with up to 128 experts also chooses
    (64-bit keys, a segment of lanes per token); each follows the rule."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for i, (T, E, H, tile_chooses) in enumerate(TILE_SHAPES):
        fit = [c for c in CASES if _fits(c, E)]
        case = fit[(5 * i) % len(fit)]
        k, with_bias = case[1], case[6]
        dtype = (torch.bfloat16, torch.float16)[i % 2]
        ld = torch.float32 if i % 3 else dtype
        x, w, b = _inputs(T, E, H, dtype, gen, bias_dtype=torch.float32 if with_bias else None)
        kw = _kwargs(case, b)
        out = _poisoned(T, E, k, ld, torch.float32, "cuda")
        xc, wc = x.cuda(), w.cuda()
        if i % 2:  # rows 8 elements apart from the next
            xc = torch.nn.functional.pad(xc, (0, 8))[:, :H]
        names = _kernel_names(lambda: sm.router(xc, wc, k, out=out, **_on(kw, "cuda")))
        want = "router_logits_kernel" if tile_chooses is None else "router_tile_kernel"
        assert any(want in n for n in names), (T, E, H, names)
        chooses = not tile_chooses  # the selection kernel runs (None: not the tiles)
        assert any("router_select_kernel" in n for n in names) == chooses, (T, E, H, names)
        check(x, w, k, out, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["softmax_topk", "topk_softmax", "sigmoid_topk"])
def test_gpu_keys_order_nan_inf_and_ties(mode):
    """The 64-bit keys choose as the C reference: NaN below every
    number, -inf above NaN, equal values by the lower id.  The values come in through the
    bias (the choice bias for sigmoid_topk) on zero logits."""
    E, k = 64, 4
    nan, inf = float("nan"), float("inf")
    patterns = [torch.full((E,), nan), torch.full((E,), 2.0), torch.full((E,), inf), torch.full((E,), -inf),
                torch.arange(E, dtype=torch.float32).flip(0) * 1e-3, torch.randn(E).round()]
    patterns[0][7], patterns[0][3], patterns[0][50] = 1.0, -inf, -inf
    patterns[3][1::2] = nan
    patterns[2][::3] = nan
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    w = torch.zeros(E, 16, dtype=torch.bfloat16)
    for pat in patterns:
        kw = dict(mode=mode, logits_dtype="float32", weights_dtype="float32",
                  **{"choice_bias" if mode == "sigmoid_topk" else "bias": pat})
        got = sm.router(x.cuda(), w.cuda(), k, **_on(kw, "cuda"))
        ref = sm.router(x, w, k, **kw)
        assert torch.equal(got[2].cpu(), ref[2]), (pat, got[2], ref[2])


@pytest.mark.gpu
def test_gpu_strided_rows_and_deterministic():
    gen = torch.Generator().manual_seed(4)
    big = torch.randn(300, 2056, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(64, 2048, generator=gen) / 16).to(torch.bfloat16).cuda()
    x = big[:, :2048]
    a = sm.router(x, w, 6, n_group=8, topk_group=3, logits_dtype="float32", scale=16.0)
    b = sm.router(x, w, 6, n_group=8, topk_group=3, logits_dtype="float32", scale=16.0)
    check(x, w, 6, a, n_group=8, topk_group=3, scale=16.0)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.gpu
def test_gpu_errors():
    x = torch.randn(4, 20, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(8, 20, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of 8"):
        sm.router(x, w, 2)
    with pytest.raises(TypeError, match="x"):
        sm.router(x.float(), w.float(), 2)
    w16 = torch.randn(8, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="w"):
        sm.router(torch.randn(4, 16, dtype=torch.bfloat16, device="cuda"), w16.cpu(), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("family,overrides", [
    ("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": True}), ("qwen2_moe", {}), ("olmoe", {}),
    ("deepseek_v2", {}), ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
    ("deepseek_v3", {"n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    ("gpt_oss", {}),
])
def test_patched_router_gpu(family, overrides):
    """On the GPU in bf16 inference a patched router runs the two router kernels and gives
    its own forward's outputs (dtypes, shapes; the choice up to equal scores); with
    autograd and under torch.compile its own forward runs; patch_model(..., router=False)
    leaves the router as it is."""
    shape = hf_families.Shape(hidden=256, intermediate=64, experts=16, top_k=4, layers=2)
    model = hf_families.build_model(family, shape, seed=7, dtype=torch.bfloat16, device="cuda", **overrides)
    with torch.no_grad():
        for m in model.modules():  # (DeepSeek-V3: a score correction bias that changes the choice)
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
                m.e_score_correction_bias.normal_(0.0, 0.05)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    (name, r), *_ = _routers(model).items()
    assert type(r).__name__.startswith("SamoyedsRouter<"), type(r).__name__
    base = type(r)._samoyeds_base
    spec = r._samoyeds_router_spec
    cb = r.e_score_correction_bias if spec.choice_bias else None

    def key(logits):  # what the router chooses by
        return torch.sigmoid(logits) + cb.float() if cb is not None else logits

    gen = torch.Generator().manual_seed(8)
    for T in (1, 37, 300):
        h = torch.randn(T, 256, generator=gen).to(torch.bfloat16).cuda()
        with torch.no_grad():
            want = base.forward(r, h)
            names = _kernel_names(lambda: r(h))
            got = r(h)
        assert any("router_logits_kernel" in n for n in names) and any("router_select_kernel" in n for n in names)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
        check(h, r.weight, spec.k, got, bias=r.bias if spec.bias else None, mode=spec.mode, n_group=spec.n_group,
              topk_group=spec.topk_group, renorm=spec.renorm, scale=spec.scale, choice_bias=cb)
        rl = want[0].float()
        tol = 2 ** -7 * rl.abs() + 1e-3
        assert ((got[0].float() - rl).abs() <= tol).all()
        kl = key(rl)
        pick_w, pick_g = kl.gather(1, want[2]).sort(1).values, kl.gather(1, got[2]).sort(1).values
        assert ((pick_g - pick_w).abs() <= 2 * (2 ** -7 * pick_w.abs() + 1e-3)).all()
    h = torch.randn(5, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    assert not any("router_" in n for n in _kernel_names(lambda: r(h)))
    plain = hf_families.build_model(family, shape, seed=7, dtype=torch.bfloat16, device="cuda", **overrides)
    sm.patch_model(plain, "samoyeds-1:2:128", progress=False, router=False)
    r_plain = _routers(plain)[name]
    assert type(r_plain) is base
    with torch.no_grad():
        assert not any("router_" in n for n in _kernel_names(lambda: r_plain(h)))
    compiled = torch.compile(r, fullgraph=False)
    with torch.no_grad():
        out = compiled(h.detach())
        want = base.forward(r, h.detach())
    for a, b in zip(out, want):
        assert a.dtype == b.dtype and a.shape == b.shape
    rl = want[0].float()
    assert ((out[0].float() - rl).abs() <= 2 ** -7 * rl.abs() + 1e-3).all()
    kl = key(rl)
    assert torch.allclose(kl.gather(1, out[2]).sort(1).values, kl.gather(1, want[2]).sort(1).values, atol=1e-3)
