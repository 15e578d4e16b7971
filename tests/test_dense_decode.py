"""samoyeds.dense_decode: dense weights at a few tokens, ``act(x @ w.T, x @ up.T)``.

The C reference against a float64 oracle (CPU), the GPU kernel against both on fresh
random inputs (odd sizes, T = 0, tails of every tile, strided rows, poisoned outputs),
the dependent launch of the down projection, CUDA graphs, and the unpruned shared
experts of a patched model that run it."""
from __future__ import annotations

import copy
import io
import os

import pytest
import torch
import torch.nn.functional as F

import samoyeds as sm

from helpers import kernel_names as _kernel_names, rel_err

ACTS = ("none", "swiglu", "gptoss")


def oracle(x, w, up=None, act="none", alpha=1.702, limit=7.0):
    xd, g = x.cpu().double(), x.cpu().double() @ w.cpu().double().T
    if act == "none":
        return g
    u = xd @ up.cpu().double().T
    if act == "swiglu":
        return F.silu(g) * u
    gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
    return (uc + 1) * gc * torch.sigmoid(alpha * gc)


def _inputs(T, R, C, dtype, gen, device="cpu", scale=1.0):
    x = torch.randn(T, C, generator=gen).to(dtype)
    w = (scale * torch.randn(R, C, generator=gen) / C ** 0.5).to(dtype)
    up = (scale * torch.randn(R, C, generator=gen) / C ** 0.5).to(dtype)
    return x.to(device), w.to(device), up.to(device)


def _condition(x, w, up, act, alpha=1.702, limit=7.0):
    """How much the activation amplifies the fp32 rounding of the two dot products: GPT-OSS's
    (u + 1) cancels where u is near -1, so an error of eps * |u| in u becomes eps * |u| / |u + 1|
    of the result.  The ratio of the result computed with |u| + 1 to the result itself (>= 1)."""
    if act != "gptoss":
        return 1.0
    g = (x.cpu().double() @ w.cpu().double().T).clamp(max=limit)
    u = (x.cpu().double() @ up.cpu().double().T).clamp(-limit, limit)
    gate = g * torch.sigmoid(alpha * g)
    return max(1.0, rel_err((u.abs() + 1) * gate, torch.zeros_like(gate)) /
               max(rel_err((u + 1) * gate, torch.zeros_like(gate)), 1e-300))


def _rounding(want, dtype):
    """The error of rounding the float64 result once to dtype (the kernel's floor)."""
    return rel_err(want.to(dtype).double(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
def test_reference_matches_oracle(dtype, act):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for T, R, C in ((1, 1, 1), (5, 7, 24), (3, 33, 19), (0, 5, 8), (4, 0, 8), (2, 3, 0)):
        x, w, up = _inputs(T, R, C, dtype, gen)
        out = torch.full((T, R), float("nan"), dtype=dtype)
        got = sm.dense_decode(x, w, up if act != "none" else None, out, act=act)
        assert got is out
        want = oracle(x, w, up, act)
        if T * R == 0:
            continue
        tol = 1e-6 * _condition(x, w, up, act) if dtype == torch.float32 else 2 * _rounding(want, dtype) + 1e-6
        assert rel_err(got, want) <= tol, (T, R, C, rel_err(got, want))


def test_reference_strided_rows():
    """x rows of a wider array and out rows of a wider array: only the R columns are written."""
    gen = torch.Generator().manual_seed(3)
    x_big = torch.randn(6, 40, generator=gen)
    w = torch.randn(5, 24, generator=gen)
    out_big = torch.full((6, 9), -7.0)
    sm.dense_decode(x_big[:, :24], w, out=out_big[:, :5])
    assert rel_err(out_big[:, :5], oracle(x_big[:, :24], w)) < 1e-6
    assert torch.equal(out_big[:, 5:], torch.full((6, 4), -7.0))


def test_errors_name_the_argument():
    x, w, up = torch.randn(4, 16), torch.randn(6, 16), torch.randn(6, 16)
    cases = [
        (lambda: sm.dense_decode(x, w, act="swiglu"), ValueError, "up: expected a tensor with a gated activation"),
        (lambda: sm.dense_decode(x, w, up), ValueError, "up: expected None without a gated activation"),
        (lambda: sm.dense_decode(x, w, act="relu"), ValueError, "act: expected one of"),
        (lambda: sm.dense_decode(x, w, up[:5], act="swiglu"), ValueError, r"up: expected shape \(6, 16\)"),
        (lambda: sm.dense_decode(x[:, :8], w), ValueError, r"x: expected shape \(4, 16\), got \(4, 8\)"),
        (lambda: sm.dense_decode(x.double(), w.double()), TypeError, "x"),
        (lambda: sm.dense_decode(x, w.half()), TypeError, r"(w: expected dtype float32 \(that of x\)|x: expected dtype float16 \(that of w\))"),
        (lambda: sm.dense_decode(x, w[:, ::2]), ValueError, r"x: expected shape \(4, 8\)"),
        (lambda: sm.dense_decode(x, w, out=torch.empty(4, 5)), ValueError, r"out: expected shape \(4, 6\), got \(4, 5\)"),
        (lambda: sm.dense_decode(x, w, out=torch.empty(4, 6).half()), TypeError, "out: expected dtype"),
        (lambda: sm.dense_decode(x, w, out=x[:, :6]), ValueError, "out: expected an output that shares no memory with x"),
        (lambda: sm.dense_decode(x, w.reshape(2, 6, 8)), ValueError, "w"),
        (lambda: sm.dense_decode([1.0], w), TypeError, "x: expected a tensor"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()


# ---- GPU ------------------------------------------------------------------------------------

SHAPES = [  # (T, R, C): tails of the 16-row tile, of the 8-warp column blocks, token passes
    (1, 1, 8), (1, 16, 64), (1, 17, 40), (2, 100, 1416), (3, 33, 72), (5, 2816 // 8, 2048 // 4),
    (7, 64, 8), (8, 48, 4104), (9, 31, 200), (16, 129, 512), (17, 40, 136), (24, 8, 1032),
    (32, 63, 328), (33, 16, 96), (70, 50, 264),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
def test_gpu_matches_reference_and_oracle(dtype, act):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for T, R, C in SHAPES:
        x, w, up = _inputs(T, R, C, dtype, gen, scale=3.0)
        upd = up.cuda() if act != "none" else None
        out = torch.full((T, R), float("nan"), dtype=dtype, device="cuda")
        got = sm.dense_decode(x.cuda(), w.cuda(), upd, out, act=act)
        ref = sm.dense_decode(x, w, up if act != "none" else None, act=act)
        want = oracle(x, w, up, act)
        assert torch.isfinite(got).all(), (T, R, C)
        floor = _rounding(want, dtype)
        assert rel_err(got, want) <= 2 * floor + 1e-5, (T, R, C, rel_err(got, want), floor)
        assert rel_err(got, ref) <= 3 * floor + 1e-5, (T, R, C, rel_err(got, ref))


@pytest.mark.gpu
def test_gpu_edges_strides_and_determinism():
    gen = torch.Generator().manual_seed(11)
    # T = 0 and R = 0 launch nothing and write nothing
    w = torch.randn(24, 64, generator=gen).to(torch.bfloat16).cuda()
    assert sm.dense_decode(torch.empty(0, 64, dtype=torch.bfloat16, device="cuda"), w).shape == (0, 24)
    empty_rows = torch.empty(0, 64, dtype=torch.bfloat16, device="cuda")
    assert sm.dense_decode(torch.randn(3, 64, device="cuda").bfloat16(), empty_rows).shape == (3, 0)
    # C = 0: the sums are 0
    z = sm.dense_decode(torch.empty(3, 0, dtype=torch.bfloat16, device="cuda"),
                        torch.empty(5, 0, dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(z, torch.zeros(3, 5, dtype=torch.bfloat16, device="cuda"))
    # x rows inside a wider array, out rows inside a wider array, the rest untouched
    x_big = torch.randn(13, 200, generator=gen).to(torch.bfloat16).cuda()
    w = torch.randn(37, 136, generator=gen).to(torch.bfloat16).cuda()
    out_big = torch.full((13, 50), 5.0, dtype=torch.bfloat16, device="cuda")
    got = sm.dense_decode(x_big[:, 8:144], w, out=out_big[:, 3:40])
    want = oracle(x_big[:, 8:144], w)
    assert rel_err(got, want) <= 2 * _rounding(want, torch.bfloat16)
    assert (out_big[:, :3] == 5).all() and (out_big[:, 40:] == 5).all()
    # the same bits every call (fixed reduction order)
    x = torch.randn(16, 2048, generator=gen).to(torch.bfloat16).cuda()
    g, u = (torch.randn(300, 2048, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    first = sm.dense_decode(x, g, u, act="swiglu")
    for _ in range(5):
        assert torch.equal(sm.dense_decode(x, g, u, act="swiglu"), first)


@pytest.mark.gpu
def test_gpu_errors():
    x = torch.randn(4, 20, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="multiple of 8 .*on the GPU"):
        sm.dense_decode(x, torch.randn(6, 20, device="cuda").bfloat16())
    with pytest.raises(TypeError, match="x"):
        sm.dense_decode(torch.randn(4, 16, device="cuda"), torch.randn(6, 16, device="cuda"))
    with pytest.raises(ValueError, match="x: expected a row stride that is a multiple of 8 elements on the GPU"):
        big = torch.randn(4, 20, device="cuda").bfloat16()
        sm.dense_decode(big[:, :16], torch.randn(6, 16, device="cuda").bfloat16())
    with pytest.raises(ValueError, match="w: expected a 16-byte aligned address on the GPU"):
        flat = torch.randn(6 * 16 + 1, device="cuda").bfloat16()
        sm.dense_decode(torch.randn(4, 16, device="cuda").bfloat16(), flat[1:].view(6, 16))
    with pytest.raises(ValueError, match=r"(x|w): expected a tensor on (cuda:0|cpu) \((where w|where x) is\)"):
        sm.dense_decode(torch.randn(4, 16).bfloat16(), torch.randn(6, 16, device="cuda").bfloat16())


@pytest.mark.gpu
def test_gpu_chained_down_projection_and_graph():
    """The MLP as the patched shared experts run it: gate/up with SwiGLU, then down with
    weights_ready (its weights requested while the first kernel ends): bit for bit the
    unchained result, eager and replayed in a CUDA graph, over many back-to-back calls."""
    gen = torch.Generator().manual_seed(21)
    H, I = 2048, 1408
    g, u = ((torch.randn(I, H, generator=gen) / H ** 0.5).to(torch.bfloat16).cuda() for _ in range(2))
    d = (torch.randn(H, I, generator=gen) / I ** 0.5).to(torch.bfloat16).cuda()
    for T in (1, 5, 16):
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        plain = sm.dense_decode(sm.dense_decode(x, g, u, act="swiglu"), d)
        want = oracle(oracle(x, g, u, "swiglu").to(torch.bfloat16), d)
        assert rel_err(plain, want) <= 2 * _rounding(want, torch.bfloat16) + 1e-3
        outs = []
        for _ in range(50):
            h = sm.dense_decode(x, g, u, act="swiglu")
            outs.append(sm.dense_decode(h, d, weights_ready=True))
        torch.cuda.synchronize()
        assert all(torch.equal(o, plain) for o in outs), T
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = sm.dense_decode(sm.dense_decode(x, g, u, act="swiglu"), d, weights_ready=True)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, plain), T


# ---- unpruned shared experts of a patched model ---------------------------------------------

transformers = pytest.importorskip("transformers")
from samoyeds.hf.families import Shape, build_model  # noqa: E402

SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=8, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)


def _shared(model):
    return {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("shared_experts", "shared_expert")}


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe", "llama4"])
def test_patch_keeps_unpruned_shared_experts_dense(family, tmp_path):
    """patch_model without shared_experts=True: the shared MLPs keep their weights, their
    parameters and their state-dict names, take a SamoyedsDense subclass of their own class,
    give the same logits on the CPU (their own forward runs there), survive deepcopy and
    pickling (also into a fresh process), and get their class back from unpatch_model."""
    model = build_model(family, SHAPE, seed=5)
    ids = torch.randint(3, SHAPE.vocab, (2, 9), generator=torch.Generator().manual_seed(6))
    before = {n: type(m) for n, m in _shared(model).items()}
    assert before
    params = {n: m.gate_proj.weight for n, m in _shared(model).items()}

    def shared_keys():
        return {k for k in model.state_dict() if ".shared_expert" in k}

    keys = shared_keys()
    assert any(k.endswith("gate_proj.weight") for k in keys)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    assert shared_keys() == keys
    for n, m in _shared(model).items():
        assert type(m).__name__.startswith("SamoyedsDense<") and isinstance(m, before[n])
        assert type(m)._samoyeds_base is before[n]
        assert m.gate_proj.weight is params[n]
    with torch.no_grad():
        logits = model(ids).logits
    clone = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, logits)
        assert torch.equal(loaded(ids).logits, logits)
    assert type(next(iter(_shared(loaded).values()))) is type(next(iter(_shared(model).values())))
    import subprocess
    import sys
    code = (f"import torch; m = torch.load({str(path)!r}, weights_only=False); "
            "s = [x for n, x in m.named_modules() if n.endswith(('shared_experts', 'shared_expert'))]; "
            "print(type(s[0]).__mro__[1].__name__)")
    # from tmp_path, the package this process imported first on the path (a checkout in the
    # working directory would shadow the installed package; an in-place build is on no path)
    import os
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(sm.__file__))] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == next(iter(before.values())).__name__
    sm.unpatch_model(model)
    assert {n: type(m) for n, m in _shared(model).items()} == before
    assert shared_keys() == keys


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe"])
def test_unpruned_shared_experts_gpu(family):
    """On the GPU in bf16 inference, a patched model's unpruned shared MLP runs two
    dense_decode launches up to samoyeds.get_config().dense_decode_max_rows tokens and the
    matmuls with one samoyeds.glu pass above (and with 0), its own forward with autograd: against the
    float64 MLP; the whole model's logits stay as close to the float64 model as
    transformers' own bf16 run."""
    model = build_model(family, SHAPE, seed=9)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    model.to(device="cuda", dtype=torch.bfloat16)
    name, mlp = next(iter(_shared(model).items()))
    ref = copy.deepcopy(mlp)
    ref.__class__ = type(mlp)._samoyeds_base
    ref64 = copy.deepcopy(ref).to(torch.float64)
    gen = torch.Generator().manual_seed(10)
    H = SHAPE.hidden
    for T in (1, 3, 16, 17, 40):
        x = torch.randn(2, T, H, generator=gen).to(torch.bfloat16).cuda()[:, :max(1, T // 2)]
        rows = x.shape[0] * x.shape[1]
        with torch.no_grad():
            names = _kernel_names(lambda: mlp(x))
            got = mlp(x)
            want = ref64(x.double())
            theirs = ref(x)
        fast = rows <= 16
        assert any("dense_decode_kernel" in k for k in names) == fast, (T, names)
        assert any("glu_kernel" in k for k in names) == (not fast), (T, names)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        assert rel_err(got, want) <= max(2 * rel_err(theirs, want), 1e-2), (T, rel_err(got, want))
    x = torch.randn(4, H, generator=gen).to(torch.bfloat16).cuda()
    with torch.no_grad(), sm.config(dense_decode_max_rows=0):
        names = _kernel_names(lambda: mlp(x))
        assert not any("dense_decode_kernel" in k for k in names) and any("glu_kernel" in k for k in names)
        assert rel_err(mlp(x), ref64(x.double())) <= max(2 * rel_err(ref(x), ref64(x.double())), 1e-2)
    xg = x.clone().requires_grad_(True)
    assert not any("glu_kernel" in k or "dense_decode" in k for k in _kernel_names(lambda: mlp(xg)))
    y = mlp(xg)
    y.float().sum().backward()  # autograd: the module's own forward
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    ids = torch.randint(3, SHAPE.vocab, (1, 7), generator=gen).cuda()
    dense = build_model(family, SHAPE, seed=9)
    sm.patch_model(dense, "samoyeds-1:2:128", progress=False)
    dense64 = sm.unpatch_model(copy.deepcopy(dense)).to(device="cuda", dtype=torch.float64)
    hf16 = sm.unpatch_model(copy.deepcopy(dense)).to(device="cuda", dtype=torch.bfloat16)
    for m in (dense64, hf16):  # (grouped_mm takes no float64)
        m.set_experts_implementation("eager")
    with torch.no_grad():
        want = dense64(ids).logits
        got = model(ids).logits
        theirs = hf16(ids).logits
    assert rel_err(got, want) <= 2 * rel_err(theirs, want) + 1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_shared_mlp_op(device):
    """torch.ops.samoyeds.shared_mlp: the gated MLP on dense weights (on the GPU in bf16 by the
    dense decode kernel, elsewhere in torch) against the float64 MLP, through torch.library's
    op checks and inside a torch.compile'd function (one opaque node, no graph break)."""
    gen = torch.Generator().manual_seed(31)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    H, I = 64, 40
    g, u = ((torch.randn(I, H, generator=gen) / H ** 0.5).to(dtype).to(device) for _ in range(2))
    d = (torch.randn(H, I, generator=gen) / I ** 0.5).to(dtype).to(device)
    x = torch.randn(2, 3, H, generator=gen).to(dtype).to(device)
    want = oracle(oracle(x.reshape(-1, H), g, u, "swiglu"), d).reshape(2, 3, H)
    got = torch.ops.samoyeds.shared_mlp(x, g, u, d)
    assert got.shape == x.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(got, want) <= tol
    compiled = torch.compile(lambda t: torch.ops.samoyeds.shared_mlp(t, g, u, d), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), got)
    torch.library.opcheck(torch.ops.samoyeds.shared_mlp.default, (x, g, u, d))
    with pytest.raises(ValueError, match="expected"):
        torch.ops.samoyeds.shared_mlp(x, g, u[:5], d)


@pytest.mark.gpu
def test_unpruned_shared_experts_compiled_gpu():
    """Under torch.compile the patched shared MLP runs torch.ops.samoyeds.shared_mlp (the
    dense decode kernel) at decode sizes, and its own compiled forward above the limit;
    both agree with the eager module."""
    model = build_model("deepseek_v2", SHAPE, seed=13)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    model.to(device="cuda", dtype=torch.bfloat16)
    mlp = next(iter(_shared(model).values()))
    compiled = torch.compile(mlp, backend="eager", fullgraph=True)
    gen = torch.Generator().manual_seed(14)
    for T in (1, 9, 40):
        x = torch.randn(T, SHAPE.hidden, generator=gen).to(torch.bfloat16).cuda()
        with torch.no_grad():
            names = _kernel_names(lambda: compiled(x))
            got = compiled(x)
            eager = mlp(x)
        assert any("dense_decode_kernel" in k for k in names) == (T <= 16), (T, names)
        assert rel_err(got, eager) <= 1e-2, T


def test_checkpoint_and_sparsify_keep_the_dense_shared_path(tmp_path):
    """A model saved with save_pretrained and loaded with samoyeds.from_pretrained, and one
    pruned by sparsify_model, hold their unpruned shared experts on the dense decode path
    too; the loaded model's logits equal the saved one's, and unpatch_model undoes it."""
    model = build_model("deepseek_v2", SHAPE, seed=15)
    sm.patch_model(model, "samoyeds-1:2:128", progress=False)
    ids = torch.randint(3, SHAPE.vocab, (1, 9), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        want = model(ids).logits
    sm.save_pretrained(model, tmp_path / "ckpt")
    loaded = sm.from_pretrained(tmp_path / "ckpt")
    kinds = [type(m) for m in _shared(loaded).values()]
    assert kinds and all(k.__name__.startswith("SamoyedsDense<") for k in kinds)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    sm.unpatch_model(loaded)
    assert not any(type(m).__name__.startswith("SamoyedsDense<") for m in loaded.modules())
    pruned = build_model("qwen2_moe", SHAPE, seed=17)
    sm.sparsify_model(pruned, "samoyeds-1:2:128", "magnitude")
    kinds = [type(m) for m in _shared(pruned).values()]
    assert kinds and all(k.__name__.startswith("SamoyedsDense<") for k in kinds)



# ---- samoyeds.glu ---------------------------------------------------------------------------

def _glu64(g, u, act):
    g, u = g.cpu().double(), u.cpu().double()
    if act == "swiglu":
        return F.silu(g) * u
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    return (uc + 1) * gc * torch.sigmoid(1.702 * gc)


GLU_SHAPES = [(1, 8), (3, 7), (5, 64), (0, 16), (4, 0), (33, 1416), (257, 2816), (1000, 24), (9, 13)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
def test_glu(device, dtype, act):
    """samoyeds.glu against the float64 activation, one rounding (the C reference on the CPU,
    the kernel's 16-byte and element paths on the GPU: I a multiple of 8 or not, column
    slices of wider rows, T = 0, I = 0, a poisoned output); the GPU also against the CPU."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for T, I in GLU_SHAPES:
        wide = (3 * torch.randn(T, 2 * I + 8, generator=gen)).to(dtype).to(device)
        for g, u in ((wide[:, :I], wide[:, I + 8:2 * I + 8]), (wide[:, :I].contiguous(), wide[:, I:2 * I].clone())):
            out = torch.full((T, I), float("nan"), dtype=dtype, device=device)
            got = sm.glu(g, u, out, act=act)
            assert got is out
            want = _glu64(g, u, act)
            if T * I == 0:
                continue
            assert torch.isfinite(got).all()
            assert rel_err(got, want) <= 2 * _rounding(want, dtype) + 1e-5, (T, I, rel_err(got, want))
            if device == "cuda":
                ref = sm.glu(g.cpu(), u.cpu(), act=act)
                assert rel_err(got, ref) <= 3 * _rounding(want, dtype) + 1e-5


def test_glu_errors():
    g, u = torch.randn(4, 16), torch.randn(4, 16)
    cases = [
        (lambda: sm.glu(g, u, act="none"), ValueError, "act: expected"),
        (lambda: sm.glu(g, u[:, :8]), ValueError, r"up: expected shape \(4, 16\), got \(4, 8\)"),
        (lambda: sm.glu(g, u.double()), TypeError, r"up: expected dtype float32 \(that of gate\)"),
        (lambda: sm.glu(g.double(), u.double()), TypeError, "g"),
        (lambda: sm.glu(g, u, out=torch.empty(4, 16).half()), TypeError, "out: expected dtype"),
        (lambda: sm.glu(g, u, out=g), ValueError, "out: expected an output that shares no memory with gate"),
        (lambda: sm.glu(g[:, ::2], u[:, ::2]), ValueError, "gate: expected rows of unit column stride"),
        (lambda: sm.glu(g.reshape(2, 2, 16), u), ValueError, "g"),
        (lambda: sm.glu([1.0], u), TypeError, "gate: expected a tensor"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
