"""The sparsifier: every pattern's mask rule, the three methods on one stack of
expert weights (against a float64 reconstruction oracle), and calibration through
transformers models of the families whose experts differ (plain, GPT-OSS with
biases and interleaved transposed weights, Llama 4 with scaled inputs)."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import samoyeds as sm  # noqa: E402
import samoyeds.hf as shf  # noqa: E402
import samoyeds.sparsify as sp  # noqa: E402
from samoyeds.hf.experts import find_experts  # noqa: E402
from samoyeds.hf.families import Shape, build_model  # noqa: E402

from conftest import GPU  # noqa: E402

transformers.logging.set_verbosity_error()

FMT = "samoyeds-1:2:128"
SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=4, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _correlated_inputs(E, N, C, gen):
    """Per-expert inputs with correlated columns and uneven scales (like hidden states)."""
    mix = torch.randn(C // 4, C, generator=gen)
    scale = torch.rand(C, generator=gen) * 3 + 0.1
    return [(torch.randn(N, C // 4, generator=gen) @ mix + 0.3 * torch.randn(N, C, generator=gen)) * scale
            for _ in range(E)]


def _recon_err(w, pruned, xs):
    """float64 relative output error sum_e ||X_e (W_e - P_e)^T|| / ||X_e W_e^T||."""
    num = den = 0.0
    for e, x in enumerate(xs):
        x = x.double()
        num += (x @ (w[e].double() - pruned[e].double()).T).pow(2).sum().item()
        den += (x @ w[e].double().T).pow(2).sum().item()
    return (num / den) ** 0.5


def _fits(mask, w, fmt, glu=False):
    """The mask fits the format: pack accepts it and unpack gives w * mask."""
    packed = sm.pack(w, fmt, mask=mask, glu=glu)
    return torch.equal(sm.unpack(packed), torch.where(mask, w, torch.zeros_like(w)))


# --- patterns -------------------------------------------------------------------------------------

def test_pattern_parsing():
    assert isinstance(sp.pattern("2:4"), sp.FormatPattern) and sp.pattern("2:4").density == 0.5
    assert sp.pattern(FMT).fmt == sm.SparseFormat(1, 2, 128)
    u = sp.pattern("unstructured-75")
    assert isinstance(u, sp.Unstructured) and u.density == pytest.approx(0.25)
    v = sp.pattern("venom-64:2:8")
    assert isinstance(v, sp.Venom) and (v.v, v.n, v.m) == (64, 2, 8) and v.density == 0.25
    for bad in ("unstructured-0", "unstructured-x", "venom-64:3:8", "venom-64:2:6", "venom-a:b", "nonsense"):
        with pytest.raises(ValueError):
            sp.pattern(bad)


@pytest.mark.parametrize("fmt", [FMT, "2:4", "samoyeds-1:4:64", "samoyeds-2:4:32"])
def test_format_pattern_is_samoyeds_mask(fmt):
    w = torch.randn(3, 64, 256, generator=_gen(1))
    scores = torch.rand(3, 64, 256, generator=_gen(2))
    got = sp.pattern(fmt).mask(scores)
    assert torch.equal(got, sm.mask(w, fmt, scores=scores))
    assert _fits(got, w, fmt)


@pytest.mark.parametrize("fmt,C", [(FMT, 256), (FMT, 192), ("samoyeds-1:4:64", 128), ("samoyeds-2:4:32", 96)])
def test_glu_joint_rows(fmt, C):
    """Gate row i and up row i survive together in every slice, the mask fits the
    format, and the joint choice maximises the summed saliency of the pair."""
    f = sm.SparseFormat.parse(fmt)
    E, I = 2, 64
    w = torch.randn(E, 2 * I, C, generator=_gen(3))
    scores = torch.rand(E, 2 * I, C, generator=_gen(4))
    keep = sp.pattern(fmt).mask(scores, glu=True)
    assert _fits(keep, w, fmt, glu=True)
    for c0 in range(0, C, f.v):
        rows = keep[:, :, c0:c0 + f.v].any(-1)
        assert torch.equal(rows[:, :I], rows[:, I:])
        # the rule: per row group, the n rows with the largest sum of gate + up 2:4-pruned saliencies
        s = scores[:, :, c0:c0 + f.v]
        sal = s.reshape(E, 2 * I, -1, 4).topk(2, dim=-1).values.sum((-1, -2))
        joint = (sal[:, :I] + sal[:, I:]).reshape(E, I // f.m, f.m)
        want = torch.zeros_like(joint, dtype=torch.bool).scatter_(-1, joint.topk(f.n, dim=-1).indices, True)
        assert torch.equal(rows[:, :I], want.reshape(E, I))


def test_unstructured_keeps_the_largest_per_row():
    scores = torch.rand(2, 16, 64, generator=_gen(5))
    keep = sp.pattern("unstructured-75").mask(scores)
    assert (keep.sum(-1) == 16).all()
    kept_min = torch.where(keep, scores, torch.inf).amin(-1)
    dropped_max = torch.where(keep, -torch.inf, scores).amax(-1)
    assert (kept_min > dropped_max).all()


@pytest.mark.parametrize("v,m", [(4, 8), (3, 8), (2, 12)])
def test_venom_mask_structure_and_optimum(v, m):
    """In every v x m block the same 4 columns serve every row, 2 of them per row,
    and the total saliency is the best of all column choices (brute force)."""
    E, R, C = 2, 7, 3 * m
    scores = torch.rand(E, R, C, generator=_gen(6))
    keep = sp.Venom(v, 2, m).mask(scores)
    for e, r0, c0 in itertools.product(range(E), range(0, R, v), range(0, C, m)):
        blk, s = keep[e, r0:r0 + v, c0:c0 + m], scores[e, r0:r0 + v, c0:c0 + m]
        assert (blk.sum(-1) == 2).all()
        assert int(blk.any(0).sum()) <= 4
        best = max(s[:, list(cols)].topk(2, dim=-1).values.sum().item()
                   for cols in itertools.combinations(range(m), 4))
        assert s[blk].sum().item() == pytest.approx(best, rel=1e-6)


# --- one stack of expert weights ----------------------------------------------------------------

@pytest.mark.parametrize("pat", [FMT, "2:4", "unstructured-75", "venom-64:2:8", "samoyeds-1:4:64"])
def test_methods_on_a_weight_stack(pat):
    E, R, C, N = 3, 128, 256, 600
    gen = _gen(7)
    w = torch.randn(E, R, C, generator=gen)
    xs = _correlated_inputs(E, N, C, gen)
    p = sp.pattern(pat)
    errs = {}
    for method in sp.METHODS:
        pruned, keep = sp.prune_weight(w, p, method, inputs=xs)
        assert keep.dtype == torch.bool and keep.shape == w.shape
        assert (pruned[~keep] == 0).all()
        assert keep.float().mean().item() == pytest.approx(p.density, abs=1e-6 if p.fmt else 0.01)
        if p.fmt is not None:
            assert _fits(keep, w, p.fmt)
        if method != "sparsegpt":
            assert torch.equal(pruned, w * keep)
        errs[method] = _recon_err(w, pruned, xs)
    assert errs["activation"] < errs["magnitude"], errs
    assert errs["sparsegpt"] < 0.85 * errs["activation"], errs
    # magnitude and activation are samoyeds.mask's rule on |w| and |w| * ||x_col||
    if p.fmt is not None:
        assert torch.equal(sp.prune_weight(w, p, "magnitude")[1], sm.mask(w, p.fmt))
        norms = torch.stack([x.pow(2).sum(0).sqrt() for x in xs])
        scores = (w.abs() * norms[:, None, :]).contiguous()
        assert torch.equal(sp.prune_weight(w, p, "activation", inputs=xs)[1], sm.mask(w, p.fmt, scores=scores))


def test_sparsegpt_refit_and_dense_target():
    E, R, C, N = 2, 64, 256, 500
    gen = _gen(8)
    w = torch.randn(E, R, C, generator=gen)
    xs = _correlated_inputs(E, N, C, gen)
    plain, k0 = sp.prune_weight(w, FMT, "sparsegpt", inputs=xs, refit_iters=0)
    refit, k1 = sp.prune_weight(w, FMT, "sparsegpt", inputs=xs)
    assert torch.equal(k0, k1), "the re-fit keeps the mask"
    assert _recon_err(w, refit, xs) < _recon_err(w, plain, xs)
    # run to convergence, the re-fit reaches the exact least-squares optimum on the mask (float64 oracle)
    refit, _ = sp.prune_weight(w, FMT, "sparsegpt", inputs=xs, refit_iters=400)
    for e in range(E):
        x = xs[e].double()
        H = x.T @ x
        H += 0.01 * H.diagonal().mean() * torch.eye(C, dtype=torch.float64)
        for r in range(0, R, 9):
            K = k1[e, r].nonzero().squeeze(1)
            if K.numel() == 0:
                continue
            opt = torch.linalg.solve(H[K][:, K], (H @ w[e, r].double())[K])
            assert torch.allclose(refit[e, r, K].double(), opt, rtol=1e-3, atol=1e-3 * opt.abs().max().item())
    # with dense inputs given, the weights are fitted to reproduce the dense outputs from the pruned inputs
    distort = torch.eye(C) + 0.5 * torch.randn(C, C, generator=gen) / C ** 0.5    # what an earlier pruning does
    noisy = [x @ distort for x in xs]
    fitted, kf = sp.prune_weight(w, FMT, "sparsegpt", inputs=noisy, dense_inputs=xs)
    naive, kn = sp.prune_weight(w, FMT, "sparsegpt", inputs=noisy)

    def err_vs_dense(p):
        return sum((n.double() @ p[e].double().T - x.double() @ w[e].double().T).pow(2).sum().item()
                   for e, (n, x) in enumerate(zip(noisy, xs)))
    assert err_vs_dense(fitted) < err_vs_dense(naive)


def test_expert_without_tokens_falls_back_to_magnitude():
    E, R, C = 3, 64, 128
    w = torch.randn(E, R, C, generator=_gen(9))
    xs = _correlated_inputs(E, 200, C, _gen(10))
    xs[1] = torch.zeros(0, C)
    xs[2] = None
    mag = sm.mask(w, FMT)
    for method in ("activation", "sparsegpt"):
        pruned, keep = sp.prune_weight(w, FMT, method, inputs=xs)
        assert _fits(keep, w, FMT)
        assert torch.equal(keep[1:], mag[1:]) or method == "sparsegpt"
        assert torch.isfinite(pruned).all()


def test_prune_weight_errors():
    w = torch.randn(2, 64, 128)
    with pytest.raises(ValueError, match="method"):
        sp.prune_weight(w, FMT, "wanda")
    with pytest.raises(ValueError, match="inputs"):
        sp.prune_weight(w, FMT, "activation")
    with pytest.raises(ValueError, match=r"inputs\[1\]"):
        sp.prune_weight(w, FMT, "sparsegpt", inputs=[torch.randn(5, 128), torch.randn(5, 64)])
    with pytest.raises(ValueError, match=r"\[E, R, C\]"):
        sp.prune_weight(w[0], FMT)
    with pytest.raises(ValueError, match="venom"):
        sp.prune_weight(torch.randn(1, 64, 36), "venom-64:2:8")
    with pytest.raises(ValueError, match="m = 4"):
        sp.prune_weight(torch.randn(1, 66, 128), "samoyeds-1:4:64")


# --- through transformers models ------------------------------------------------------------------

def _model(family, seed=0):
    model = build_model(family, SHAPE, seed=seed)
    if family != "llama4":
        model.set_experts_implementation("eager")   # grouped_mm warms up for seconds on the CPU
    gen = _gen(seed + 1)
    with torch.no_grad():
        for _, mod in model.named_modules():
            for name, p in mod.named_parameters(recurse=False):
                if name.endswith("proj_bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _tokens(n, length, seed):
    return torch.randint(3, SHAPE.vocab, (n, length), generator=_gen(seed))


def _experts_error(pruned, dense, ids):
    """Relative error of every experts module's output on the dense model's inputs to it."""
    errs = []
    for (name, dm), (_, pm) in zip(((t.name, t.experts) for t in find_experts(dense)),
                                   ((t.name, t.experts) for t in find_experts(pruned))):
        cap = []
        h = dm.register_forward_hook(lambda m, a, o: cap.append((a, o)))
        with torch.no_grad():
            dense(ids)
        h.remove()
        with torch.no_grad():
            got = torch.cat([pm(*a).flatten() for a, _ in cap])
        want = torch.cat([o.flatten() for _, o in cap])
        errs.append(((got - want).norm() / want.norm()).item())
    return sum(errs) / len(errs)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4"])
def test_prune_model_orders_methods_and_keeps_the_format(family):
    dense = _model(family)
    calib = list(_tokens(48, 32, 11).split(16))
    held = _tokens(8, 32, 12)
    errs = {}
    for method in sp.METHODS:
        model = copy.deepcopy(dense)
        masks = sp.prune_model(model, FMT, method, calib, progress=False)
        assert sorted(masks) == sorted(t.name for t in find_experts(model))
        for name, mod in model.named_modules():
            if name in masks:
                orig = dict(dense.named_modules())[name]
                for proj, m in masks[name].items():
                    p = getattr(mod, proj)
                    assert m.shape == p.shape and (p[~m] == 0).all()
                    assert m.float().mean().item() == pytest.approx(0.25, abs=1e-6)
                    if method != "sparsegpt":
                        assert torch.equal(p, getattr(orig, proj) * m)
        errs[method] = _experts_error(model, dense, held)
        # the masks fit the format: patching with them reproduces the pruned model exactly
        ref = copy.deepcopy(model)
        if family != "llama4":
            ref.set_experts_implementation("eager")
        sm.patch_model(model, FMT, progress=False, masks=masks)
        with torch.no_grad():
            assert (model(held).logits - ref(held).logits).abs().max() < 1e-4
    assert errs["activation"] < errs["magnitude"] and errs["sparsegpt"] < errs["activation"], errs


def test_sparsify_model_patches_and_calibrates_layer_by_layer():
    dense = _model("qwen3_moe", seed=3)
    calib = [{"input_ids": t} for t in _tokens(8, 32, 13).split(4)]
    model = copy.deepcopy(dense)
    seen = []
    names = [t.name for t in find_experts(model)]
    hooks = [dict(model.named_modules())[n].register_forward_pre_hook(
        lambda m, a, n=n: seen.append((n, float(dict(model.named_modules())[names[0]].gate_up_proj.eq(0).float().mean()))))
        for n in names]
    masked = copy.deepcopy(dense)
    masks = sp.prune_model(masked, FMT, "activation", calib, progress=False)
    assert sm.sparsify_model(model, FMT, "activation", calibration=iter(calib), progress=False) is model
    for h in hooks:
        h.remove()
    assert shf.is_patched(model)
    # layer 1 was calibrated after layer 0 was pruned (75 % zeros), layer 0 on the dense model
    assert {n for n, z in seen if z == 0.0} == {names[0]} and all(z == 0.75 for n, z in seen if n == names[1])
    ids = _tokens(2, 16, 14)
    with torch.no_grad():
        masked.set_experts_implementation("eager")
        assert (model(ids).logits - masked(ids).logits).abs().max() < 1e-4
    sm.unpatch_model(model)
    for name, mod in model.named_modules():
        if name in masks:
            for proj, m in masks[name].items():
                assert torch.equal(getattr(mod, proj) != 0, m & (getattr(dict(masked.named_modules())[name], proj) != 0))


def test_prune_model_baseline_patterns_stay_dense():
    model = _model("mixtral", seed=5)
    calib = list(_tokens(8, 32, 15).split(4))
    for pat in ("unstructured-75", "venom-64:2:8"):
        m = copy.deepcopy(model)
        masks = sp.prune_model(m, pat, "sparsegpt", calib, progress=False)
        assert not shf.is_patched(m)
        for mm in masks.values():
            for k in mm.values():
                assert k.float().mean().item() == pytest.approx(0.25, abs=0.01)
        with pytest.raises(ValueError):
            sm.sparsify_model(copy.deepcopy(model), pat, "magnitude", progress=False)


def test_prune_model_errors():
    model = _model("qwen3_moe", seed=6)
    with pytest.raises(ValueError, match="calibration"):
        sp.prune_model(model, FMT, "activation", None, progress=False)
    with pytest.raises(ValueError, match="no batches"):
        sp.prune_model(model, FMT, "sparsegpt", [], progress=False)
    with pytest.raises(ValueError, match="method"):
        sp.prune_model(model, FMT, "obs", [torch.zeros(1, 4, dtype=torch.long)], progress=False)
    with pytest.raises(TypeError, match="calibration"):
        sp.prune_model(copy.deepcopy(model), FMT, "activation", ["text"], progress=False)
    with pytest.raises(NotImplementedError, match="sparsify_model"):
        sm.patch_model(copy.deepcopy(model), FMT, method="activation", progress=False)
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(shf.UnsupportedModelError):
        sp.prune_model(dense, FMT, "magnitude", progress=False)
    patched = sm.patch_model(copy.deepcopy(model), FMT, progress=False)
    with pytest.raises(ValueError, match="already patched"):
        sp.prune_model(patched, FMT, "magnitude", progress=False)
    # nothing was changed by the failures
    for (_, a), (_, b) in zip(model.named_parameters(), _model("qwen3_moe", seed=6).named_parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("method", sp.METHODS)
def test_sparsify_model_on_gpu_bf16(method):
    assert GPU
    dense = _model("qwen3_moe", seed=7).to("cuda", torch.bfloat16)
    calib = list(_tokens(8, 32, 16).split(4))
    masked = copy.deepcopy(dense)
    masks = sp.prune_model(masked, FMT, method, calib, progress=False)
    model = copy.deepcopy(masked)  # "sparsegpt" changes the kept weights: pack what it left
    sm.patch_model(model, FMT, progress=False, masks=masks)
    masked.set_experts_implementation("eager")
    ids = _tokens(2, 16, 17).cuda()
    with torch.no_grad():
        got, want = model(ids).logits.float(), masked(ids).logits.float()
    assert (got - want).norm() / want.norm() < 2e-2
    cpu = sp.prune_model(copy.deepcopy(_model("qwen3_moe", seed=7)), FMT, method, calib, progress=False)
    agree = [(masks[n][k].cpu() == cpu[n][k]).float().mean().item() for n in cpu for k in cpu[n]]
    assert min(agree) > 0.9, "bf16 on the GPU chooses nearly the masks fp32 on the CPU does"


@pytest.mark.parametrize("fmt,C,glu", [("samoyeds-1:2:32", 128, False), ("samoyeds-1:4:64", 256, True),
                                       ("samoyeds-1:2:64", 192, True)])
def test_joint_row_selection_is_the_least_total_drop_cost(fmt, C, glu):
    """With few slices, each row group gets the assignment of slices to rows whose
    summed exact group-OBS cost (float64 oracle, every row's whole dropped set) is least."""
    f = sm.SparseFormat.parse(fmt)
    E, R = 2, 16
    gen = _gen(20)
    W = torch.randn(E, R, C, generator=gen)
    X = _correlated_inputs(E, 300, C, gen)
    H = torch.stack([x.T @ x for x in X])
    Hinv = sp._inverse(H, 0.01)
    keep = sp._row_selection(W, Hinv, f, glu)
    S = -(-C // f.v)
    spans = [(j * f.v, min((j + 1) * f.v, C)) for j in range(S)]
    Rs = R // 2 if glu else R
    rows = keep[:, :, [c0 for c0, _ in spans]]                               # [E, R, S]
    assert (rows.view(E, -1, f.m, S).sum(2) == 1).all()
    if glu:
        assert torch.equal(rows[:, :Rs], rows[:, Rs:])

    def cost(e, r, dropped):
        if not dropped:
            return 0.0
        cols = torch.cat([torch.arange(*spans[j]) for j in dropped])
        w = W[e, r, cols].double()
        return (w @ torch.linalg.solve(Hinv[e][cols][:, cols].double(), w)).item()

    def total(e, g, assign):
        t = 0.0
        for k in range(f.m):
            dropped = [j for j in range(S) if assign[j] != k]
            for r in ([g * f.m + k, Rs + g * f.m + k] if glu else [g * f.m + k]):
                t += cost(e, r, dropped)
        return t

    for e in range(E):
        for g in range(Rs // f.m):
            chosen = [int(rows[e, g * f.m:(g + 1) * f.m, j].float().argmax()) for j in range(S)]
            best = min(total(e, g, a) for a in itertools.product(range(f.m), repeat=S))
            assert total(e, g, chosen) == pytest.approx(best, rel=1e-4)


def test_many_slices_choose_per_slice():
    """Past JOINT_MAX_SLICES the rows are chosen slice by slice; the mask still fits."""
    E, R, C = 2, 32, 512
    gen = _gen(21)
    w = torch.randn(E, R, C, generator=gen)
    xs = _correlated_inputs(E, 400, C, gen)
    fmt = "samoyeds-1:2:32"                  # 16 slices
    assert C // 32 > sp.JOINT_MAX_SLICES
    pruned, keep = sp.prune_weight(w, fmt, "sparsegpt", inputs=xs)
    assert _fits(keep, w, fmt)
    assert _recon_err(w, pruned, xs) < _recon_err(w, *sp.prune_weight(w, fmt, "activation", inputs=xs)[:1], xs)


def test_venom_obs_columns_and_mask_only_sparsegpt():
    """Venom(columns="obs"): sparsegpt picks each block's 4 columns by group-OBS cost (the
    structure holds); reconstruct=False returns the original weights under SparseGPT's mask."""
    torch.manual_seed(0)
    E, R, C, N = 2, 96, 32, 256
    w = torch.randn(E, R, C)
    x = [torch.randn(N, C) @ torch.randn(C, C) * 0.3 + torch.randn(N, C) for _ in range(E)]
    with pytest.raises(ValueError, match="columns"):
        sp.Venom(64, 2, 8, columns="greedy")
    for pat in (sp.Venom(64, 2, 8, columns="obs"), sp.Venom(64, 2, 8), FMT):
        pruned, keep = sp.prune_weight(w, pat, "sparsegpt", inputs=x)
        only, keep2 = sp.prune_weight(w, pat, "sparsegpt", inputs=x, reconstruct=False)
        assert torch.equal(only, w * keep2) and not torch.equal(pruned, w * keep)
        assert keep.float().mean() == pytest.approx(0.25) and keep2.float().mean() == pytest.approx(0.25)
        if isinstance(pat, sp.Venom):
            for k in (keep, keep2):
                blocks = [k[:, r0:r0 + 64].reshape(E, -1, C // 8, 8) for r0 in (0, 64)]
                for b in blocks:
                    assert (b.sum(-1) == 2).all() and (b.any(1).sum(-1) == 4).all()
