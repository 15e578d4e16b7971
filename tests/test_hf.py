"""Patching Hugging Face MoE models: for every supported family, the patched model
gives the logits and greedy tokens of the same model run with transformers'
eager experts on the identically masked dense weights."""
from __future__ import annotations

import copy
import dataclasses
import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import samoyeds as sm  # noqa: E402
import samoyeds.hf as shf  # noqa: E402
from samoyeds.hf.families import FAMILIES, Shape, build_model  # noqa: E402

from helpers import rel_err  # noqa: E402

transformers.logging.set_verbosity_error()

# Experts dominate the logits at init_std=0.1, so an error in them cannot hide.
SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=8, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)
FMT = "samoyeds-1:2:128"

# How each family stores gate_up_proj, read from its modeling file (not from samoyeds.hf):
# (transposed [E, H, 2I], gate/up interleaved along 2I).
LAYOUT = {"gpt_oss": (True, True), "llama4": (True, False)}


def _experts(model):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m._parameters.get("gate_up_proj"), torch.Tensor) and m.gate_up_proj.dim() == 3]


def _model(family, shape=SHAPE, seed=0, **overrides):
    model = build_model(family, shape, seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, mod in _experts(model):
            for name, p in mod.named_parameters(recurse=False):
                if name.endswith("bias"):   # zero at init; random here so the bias path is exercised
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _hf_masks(model, family, fmt):
    """Magnitude masks of every experts module in the model's own parameter layout."""
    transposed, interleaved = LAYOUT.get(family, (False, False))
    out = {}
    for name, mod in _experts(model):
        masks = {}
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(mod, proj).detach()
            w = w.transpose(1, 2) if transposed else w            # [E, out, in]
            perm = None
            if proj == "gate_up_proj" and interleaved:
                perm = torch.cat([torch.arange(0, w.shape[1], 2), torch.arange(1, w.shape[1], 2)])
                w = w[:, perm]                                     # gate rows, then up rows
            m = sm.mask(w.contiguous(), fmt)
            if perm is not None:
                m = m[:, torch.argsort(perm)]
            masks[proj] = (m.transpose(1, 2) if transposed else m).contiguous()
        out[name] = masks
    return out


def _masked_eager(model, masks):
    """A copy of model with w * mask expert weights and transformers' eager experts."""
    ref = copy.deepcopy(model)
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for name, mm in masks.items():
            for proj, m in mm.items():
                getattr(mods[name], proj).mul_(m.to(getattr(mods[name], proj).device))
    if ref.get_experts_implementation()[""] != "eager":
        ref.set_experts_implementation("eager")
    return ref


def _ids(batch=2, length=12, seed=5):
    return torch.randint(3, SHAPE.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_model_matches_masked_eager(family):
    model = _model(family)
    previous = model.get_experts_implementation()
    masks = _hf_masks(model, family, FMT)
    assert masks, "the family has experts modules"
    ref = _masked_eager(model, masks)
    dense = copy.deepcopy(model)
    ids = _ids()
    dense_bytes = shf.experts_weight_nbytes(model)
    old = [weakref.ref(p) for _, mod in _experts(model) for p in (mod.gate_up_proj, mod.down_proj)]

    assert sm.patch_model(model, FMT, progress=False) is model
    gc.collect()
    assert all(r() is None for r in old), "the dense expert weights are freed"
    assert shf.is_patched(model)
    for name, mod in dict(model.named_modules()).items():
        if name in masks:
            assert "gate_up_proj" not in mod._parameters and "down_proj" not in mod._parameters
            assert mod.samoyeds_gate_up_values.shape[0] == SHAPE.experts
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n, _ in model.named_parameters())
    assert shf.experts_weight_nbytes(model) < 0.6 * dense_bytes
    if family != "llama4":
        assert model.get_experts_implementation()[""] == "samoyeds"

    with torch.no_grad():
        got, want, unmasked = model(ids).logits, ref(ids).logits, dense(ids).logits
    assert (unmasked - want).abs().max() > 0.05, "sparsifying the experts must change the logits"
    assert (got - want).abs().max() < 1e-4
    assert torch.equal(_generate(model, ids), _generate(ref, ids))

    assert sm.unpatch_model(model) is model
    assert not shf.is_patched(model)
    assert model.get_experts_implementation() == previous
    restored = dict(model.named_modules())
    for name, mm in masks.items():
        for proj in mm:
            assert torch.equal(getattr(restored[name], proj), getattr(dict(ref.named_modules())[name], proj)), \
                (name, proj)
    if family == "gpt_oss":
        for name in masks:
            assert torch.equal(restored[name].gate_up_proj_bias, dict(ref.named_modules())[name].gate_up_proj_bias)
    if family != "llama4":
        model.set_experts_implementation("eager")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "2:4"), ("gpt_oss", "samoyeds-1:2:64"),
                                        ("llama4", "samoyeds-1:4:64"), ("mixtral", "samoyeds-3:4:128")])
def test_other_formats(family, fmt):
    model = _model(family, seed=3)
    ref = _masked_eager(model, _hf_masks(model, family, fmt))
    ids = _ids(seed=9)
    sm.patch_model(model, fmt, progress=False)
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max() < 1e-4


def test_precomputed_masks_and_mask_function():
    family = "gpt_oss"
    model = _model(family, seed=11)
    gen = torch.Generator().manual_seed(12)
    # masks chosen by random saliency: nothing like magnitude, so the given ones must be used
    masks = {}
    for name, mod in _experts(model):
        masks[name] = {}
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(mod, proj).detach().transpose(1, 2)
            perm = torch.arange(w.shape[1])
            if proj == "gate_up_proj":
                perm = torch.cat([perm[0::2], perm[1::2]])
            scores = torch.rand(w.shape, generator=gen)
            m = sm.mask(w[:, perm].contiguous(), FMT, scores=scores)[:, torch.argsort(perm)]
            masks[name][proj] = m.transpose(1, 2).contiguous()
    ref = _masked_eager(model, masks)
    ids = _ids(seed=13)
    with torch.no_grad():
        want = ref(ids).logits

    m1 = copy.deepcopy(model)
    sm.patch_model(m1, FMT, progress=False, masks=masks)
    with torch.no_grad():
        assert (m1(ids).logits - want).abs().max() < 1e-4

    calls = []

    def method(name, proj, w, fmt):
        calls.append((name, proj, tuple(w.shape)))
        return sm.mask(w, fmt, scores=-w.abs())     # smallest magnitudes: a deliberately odd choice

    m2 = copy.deepcopy(model)
    sm.patch_model(m2, FMT, method=method, progress=False)
    E, H, I = SHAPE.experts, SHAPE.hidden, SHAPE.intermediate
    assert sorted(calls) == sorted([(n, "gate_up_proj", (E, 2 * I, H)) for n in masks]
                                   + [(n, "down_proj", (E, H, I)) for n in masks])
    sm.to_dense(m2)
    for name, mod in _experts(m2):
        orig = dict(model.named_modules())[name]
        for proj in ("gate_up_proj", "down_proj"):
            kept = getattr(mod, proj) != 0
            assert kept.float().mean() == pytest.approx(0.25, abs=0.02)
            # the kept weights are the smallest ones: none larger than the largest dropped one in its group
            assert getattr(orig, proj).abs()[kept].mean() < getattr(orig, proj).abs()[~kept].mean()


def test_from_pretrained_with_samoyeds_implementation(tmp_path):
    shf.register()
    for family in ("qwen3_moe", "gpt_oss"):
        model = _model(family, seed=21)
        path = tmp_path / family
        model.save_pretrained(path)
        ref = _masked_eager(model, _hf_masks(model, family, FMT))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="samoyeds").eval()
        assert loaded.get_experts_implementation()[""] == "samoyeds"
        ids = _ids(seed=22)
        with pytest.raises(RuntimeError, match="patch_model"):
            loaded(ids)
        sm.patch_model(loaded, FMT, progress=False)
        with torch.no_grad():
            assert (loaded(ids).logits - ref(ids).logits).abs().max() < 1e-4
        assert torch.equal(_generate(loaded, ids), _generate(ref, ids))
        sm.unpatch_model(loaded)
        # loaded as "samoyeds": unpatching falls back to transformers' default
        assert loaded.get_experts_implementation()[""] in ("grouped_mm", "eager")


def test_compile_patched_model_fullgraph():
    for family in ("qwen3_moe", "llama4"):
        model = _model(family, seed=31)
        sm.patch_model(model, FMT, progress=False)
        ids = _ids(seed=32)
        with torch.no_grad():
            want = model(ids).logits
            torch._dynamo.reset()
            got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_errors_and_untouched_model():
    model = _model("qwen3_moe", seed=41)
    with pytest.raises(NotImplementedError, match="wanda"):
        sm.patch_model(model, method="wanda", progress=False)
    with pytest.raises(ValueError, match="masks"):
        sm.patch_model(model, masks={"model.layers.9.mlp.experts": {}}, progress=False)

    # an expert width of 36 gives 36 gate rows: not a multiple of m = 8
    odd = _model("mixtral", dataclasses.replace(SHAPE, intermediate=36), seed=42)
    with pytest.raises(shf.UnsupportedModelError, match=r"MixtralForCausalLM.*samoyeds-1:8:128"):
        sm.patch_model(odd, "samoyeds-1:8:128", progress=False)
    assert not shf.is_patched(odd) and len(_experts(odd)) == SHAPE.layers

    gelu = _model("mixtral", seed=43, hidden_act="gelu")
    with pytest.raises(shf.UnsupportedModelError, match=r"MixtralForCausalLM.*MixtralExperts.*SiLU"):
        sm.patch_model(gelu, progress=False)

    nogate = _model("olmoe", seed=44)
    _experts(nogate)[-1][1].has_gate = False
    with pytest.raises(shf.UnsupportedModelError, match=r"OlmoeForCausalLM.*no gate"):
        sm.patch_model(nogate, progress=False)
    assert not shf.is_patched(nogate), "checks run on every module before anything changes"

    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(shf.UnsupportedModelError, match="LlamaForCausalLM: no Mixture-of-Experts"):
        sm.patch_model(dense, progress=False)

    with pytest.raises(ValueError, match="masks.*shape"):
        sm.patch_model(model, masks={"model.layers.0.mlp.experts": {"down_proj": torch.ones(3, 3)}},
                       progress=False)

    # a mask that does not fit the format, for the last module only: the first one was packed, then unpacked
    names = [n for n, _ in _experts(model)]
    first = dict(model.named_modules())[names[0]].gate_up_proj.detach().clone()

    def bad_last(name, proj, w, fmt):
        return torch.ones_like(w, dtype=torch.bool) if name == names[-1] else sm.mask(w, fmt)

    with pytest.raises(ValueError):
        sm.patch_model(model, method=bad_last, progress=False)
    assert not shf.is_patched(model) and model.get_experts_implementation()[""] == "grouped_mm"
    now = dict(model.named_modules())[names[0]].gate_up_proj
    assert torch.equal(now, first * sm.mask(first, FMT))

    sm.patch_model(model, progress=False)
    with pytest.raises(ValueError, match="already patched"):
        sm.patch_model(model, progress=False)
    sm.unpatch_model(model)
    with pytest.raises(ValueError, match="no experts module patched"):
        sm.unpatch_model(model)


def _fresh_python(code, **kw):
    """Runs ``code`` in a fresh interpreter that imports this samoyeds (installed or built in place)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(sm.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                          capture_output=True, text=True, **kw)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_import_samoyeds_is_light():
    _fresh_python("import sys, samoyeds; assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
                  "assert callable(samoyeds.patch_model) and 'samoyeds.hf' in sys.modules; "
                  "assert samoyeds.is_patched is samoyeds.hf.is_patched")


HF_MODULES = ["families", "swap", "experts", "streams", "shared", "parallel", "router", "llama4"]
# above the package: imported on demand only (transformers' quantizer registry, the import
# hook, patch_model), never by __init__ at import time, so it may use __init__'s functions
HF_TOP = ["quantizer"]


def test_hf_package_imports_form_no_cycle():
    """samoyeds/hf/: each module imports only modules listed before it in HF_MODULES (so no
    cycle, and streams.py knows shared MLPs only by their protocol), __init__ imports HF_TOP
    only inside functions, and none reads the environment."""
    import ast

    pkg = os.path.dirname(os.path.abspath(shf.__file__))
    assert sorted(HF_MODULES + HF_TOP + ["__init__"]) == sorted(f[:-3] for f in os.listdir(pkg) if f.endswith(".py"))
    init_names = set(shf.__all__) | {"check_options", "install", "select"}
    for i, name in enumerate(HF_MODULES + HF_TOP):
        with open(os.path.join(pkg, f"{name}.py")) as f:
            src = f.read()
        assert "os.environ" not in src and "getenv" not in src, name
        siblings = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                siblings |= {node.module} if node.module else {a.name for a in node.names}
        allowed = set(HF_MODULES[:i]) | (init_names if name in HF_TOP else set())
        assert siblings <= allowed, (name, siblings - allowed)
    with open(os.path.join(pkg, "__init__.py")) as f:
        tree = ast.parse(f.read())
    top = {a.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 1
           for a in node.names} | {node.module for node in tree.body if isinstance(node, ast.ImportFrom)
                                   and node.level == 1 and node.module}
    assert not top & set(HF_TOP), top & set(HF_TOP)


@pytest.mark.parametrize("name", HF_MODULES + HF_TOP)
def test_hf_module_imports_first(name):
    _fresh_python(f"import samoyeds.hf.{name}")


def test_pickled_patched_models_load_in_a_fresh_process(tmp_path):
    """A patched model's swapped classes (SamoyedsDense, SamoyedsRouter, SamoyedsBlock,
    SamoyedsLlama4) are found again by name through samoyeds.hf in a process that never
    patched a model: the loaded model gives the same logits and unpatches."""
    ids = _ids()
    for family in ("deepseek_v2", "llama4"):
        model = _model(family)
        sm.patch_model(model, FMT, progress=False)
        kinds = sorted({type(m).__name__.split("<")[0] for m in model.modules()
                        if getattr(type(m), "_samoyeds_swapped", False)})
        assert kinds == (["SamoyedsBlock", "SamoyedsDense", "SamoyedsRouter"] if family == "deepseek_v2"
                         else ["SamoyedsDense", "SamoyedsLlama4"]), kinds
        with torch.no_grad():
            want = model(ids).logits
        torch.save({"model": model, "ids": ids}, tmp_path / f"{family}.pt")
        torch.save(want, tmp_path / f"{family}_want.pt")
        _fresh_python(
            "import torch, samoyeds\n"
            f"got = torch.load({str(tmp_path / (family + '.pt'))!r}, weights_only=False)\n"
            f"want = torch.load({str(tmp_path / (family + '_want.pt'))!r})\n"
            "model = got['model']\n"
            "assert samoyeds.is_patched(model)\n"
            "with torch.no_grad():\n"
            "    assert torch.equal(model(got['ids']).logits, want)\n"
            "samoyeds.unpatch_model(model)\n"
            "assert not any(getattr(type(m), '_samoyeds_swapped', False) for m in model.modules())\n")


def _low_precision_truth(family, device, dtype, pack_on_device):
    """STYLE.md's rule on the logits: samoyeds at ``dtype`` is at most 2x as far from the
    float64 masked-dense model as transformers' eager experts at ``dtype``."""
    base = _model(family, seed=51)
    masks = _hf_masks(base, family, FMT)
    ref = _masked_eager(base, masks)
    oracle = copy.deepcopy(ref).to(torch.float64)
    eager = copy.deepcopy(ref).to(device=device, dtype=dtype)
    model = copy.deepcopy(base)
    if pack_on_device:
        model.to(device=device, dtype=dtype)
        if dtype != torch.float32:   # the magnitude mask of the rounded weights may break ties differently
            masks = _hf_masks(model, family, FMT)
            eager = _masked_eager(model, masks)
            oracle = copy.deepcopy(eager).to(device="cpu", dtype=torch.float64)
        sm.patch_model(model, FMT, progress=False)
    else:
        sm.patch_model(model, FMT, progress=False)
        model.to(device=device, dtype=dtype)
    ids = _ids(seed=52)
    with torch.no_grad():
        want = oracle(ids).logits
        e_sam = rel_err(model(ids.to(device)).logits, want)
        e_eager = rel_err(eager(ids.to(device)).logits, want)
    assert e_sam <= 2 * e_eager + 1e-6, (e_sam, e_eager)
    out = _generate(model, ids.to(device))
    assert out.shape == (ids.shape[0], ids.shape[1] + 8)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4"])
def test_bf16_cpu_within_rule(family):
    _low_precision_truth(family, "cpu", torch.bfloat16, pack_on_device=False)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("pack_on_device", [False, True])
def test_patched_model_gpu_bf16(family, pack_on_device):
    _low_precision_truth(family, "cuda", torch.bfloat16, pack_on_device)


SHARED_FAMILIES = ["deepseek_v2", "deepseek_v3", "qwen2_moe", "llama4"]


def _shared_mlps(model):
    return {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in ("shared_experts", "shared_expert")}


@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_shared_experts_packed_match_masked_eager(family):
    """patch_model(shared_experts=True): every block's shared MLP becomes a SamoyedsMLP, and
    the model's logits equal those of the dense model with both the routed experts' and the
    shared experts' weights masked (fp32 on the CPU); unpatching gives back the original
    modules with exactly w * mask, and the default leaves the shared experts dense."""
    model = _model(family)
    shared = _shared_mlps(model)
    assert shared, family
    ids = _ids()
    masks = _hf_masks(model, family, FMT)
    shared_masks = {}
    for name, mod in shared.items():
        gu = torch.cat([mod.gate_proj.weight, mod.up_proj.weight], 0)[None].detach()
        m_gu = sm.mask(gu.contiguous(), FMT)[0]
        I = mod.gate_proj.weight.shape[0]
        shared_masks[name] = {"gate_proj": m_gu[:I], "up_proj": m_gu[I:],
                              "down_proj": sm.mask(mod.down_proj.weight.detach()[None].contiguous(), FMT)[0]}
    ref = _masked_eager(model, masks)
    ref_mods = dict(ref.named_modules())
    with torch.no_grad():
        for name, mm in shared_masks.items():
            for proj, m in mm.items():
                getattr(ref_mods[name], proj).weight.mul_(m)
    originals = {n: type(m) for n, m in shared.items()}
    sm.patch_model(model, FMT, progress=False, shared_experts=True)
    now = _shared_mlps(model)
    assert set(now) == set(shared) and all(isinstance(m, shf.SamoyedsMLP) for m in now.values())
    assert sm.hf.is_patched(model)
    with torch.no_grad():
        got = model(ids).logits
        want = ref(ids).logits
    assert rel_err(got, want) < 1e-4
    sm.unpatch_model(model)
    back = _shared_mlps(model)
    for name, mod in back.items():
        assert type(mod) is originals[name] and not isinstance(mod, shf.SamoyedsMLP)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert isinstance(getattr(mod, proj), torch.nn.Linear)
            assert torch.equal(getattr(mod, proj).weight, getattr(ref_mods[name], proj).weight), (name, proj)
    # the default packs the routed experts only
    plain = _model(family)
    sm.patch_model(plain, FMT, progress=False)
    assert not any(isinstance(m, shf.SamoyedsMLP) for m in plain.modules())


def test_experts_weight_nbytes_counts_shared_experts_on_request():
    """experts_weight_nbytes(shared_experts=True) adds the shared MLPs: their Linear weights
    when dense, their packed arrays when packed (fewer bytes); without it, routed experts only."""
    model = _model("deepseek_v2", seed=81)

    def shared_bytes(kind):
        mods = [m for m in model.modules() if isinstance(m, kind)]
        assert mods
        if kind is shf.SamoyedsMLP:
            return sum(b.numel() * b.element_size() for m in mods for b in (*m.parameters(), *m.buffers()))
        return sum(m.weight.numel() * m.weight.element_size()
                   for n, m in model.named_modules() if isinstance(m, kind) and ".shared_experts." in f".{n}.")

    dense_routed = shf.experts_weight_nbytes(model)
    assert shf.experts_weight_nbytes(model, shared_experts=True) == dense_routed + shared_bytes(torch.nn.Linear)
    dense_shared = shared_bytes(torch.nn.Linear)
    sm.patch_model(model, FMT, progress=False, shared_experts=True)
    packed_routed = shf.experts_weight_nbytes(model)
    packed_shared = shared_bytes(shf.SamoyedsMLP)
    assert shf.experts_weight_nbytes(model, shared_experts=True) == packed_routed + packed_shared
    assert packed_routed < dense_routed and 0 < packed_shared < dense_shared


def test_shared_experts_masks_method_errors_and_checkpoint(tmp_path):
    """Shared experts take precomputed masks and mask functions like the routed experts;
    bad masks and models without shared experts raise before anything changes; a model
    with packed shared experts is refused by save_pretrained, and its forward runs through
    torch.compile's op."""
    model = _model("qwen2_moe")
    shared = _shared_mlps(model)
    name, mod = next(iter(shared.items()))
    seen = []

    def keep_all_but_fmt(n, proj, w, fmt):
        seen.append((n, proj, tuple(w.shape)))
        return sm.mask(w, fmt)

    sm.patch_model(copy.deepcopy(model), FMT, keep_all_but_fmt, progress=False, shared_experts=True)
    H, I = mod.down_proj.weight.shape
    assert (name, "gate_up_proj", (1, 2 * I, H)) in seen and (name, "down_proj", (1, H, I)) in seen
    bad = {name: {"gate_proj": torch.ones(3, 3, dtype=torch.bool), "up_proj": torch.ones(I, H, dtype=torch.bool),
                  "down_proj": torch.ones(H, I, dtype=torch.bool)}}
    with pytest.raises(ValueError, match=r"masks\[.*\]\['gate_proj'\]: expected shape"):
        sm.patch_model(model, FMT, progress=False, shared_experts=True, masks=bad)
    with pytest.raises(ValueError, match="expected all of 'gate_proj', 'up_proj' and 'down_proj'"):
        sm.patch_model(model, FMT, progress=False, shared_experts=True,
                       masks={name: {"down_proj": torch.ones(H, I, dtype=torch.bool)}})
    assert not sm.hf.is_patched(model)  # nothing changed

    def fails_on_shared(n, proj, w, fmt):
        if n == name:
            raise ValueError("no mask for the shared experts")
        return sm.mask(w, fmt)

    with pytest.raises(ValueError, match="no mask for the shared experts") as info:
        sm.patch_model(model, FMT, fails_on_shared, progress=False, shared_experts=True)
    assert any(name in note for note in getattr(info.value, "__notes__", [])), info.value
    assert not sm.hf.is_patched(model)  # the routed experts packed before it were unpacked
    with pytest.raises(shf.UnsupportedModelError, match="shared_experts=True, but its MoE blocks have no shared"):
        sm.patch_model(_model("mixtral"), FMT, progress=False, shared_experts=True)
    sm.patch_model(model, FMT, progress=False, shared_experts=True)
    with pytest.raises(NotImplementedError, match="shared experts .* are packed"):
        sm.save_pretrained(model, tmp_path / "ckpt")
    ids = _ids()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend="eager")(ids).logits
    assert torch.equal(eager, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe"])
def test_shared_mlp_direct_path_gpu(family):
    """A SamoyedsMLP in eager inference on the GPU runs two ssmm calls on the rows as they lie
    (decode kernel for a few rows, wgmma.sp with the rows by TMA for many): against the float64
    MLP on the same masked weights and against the routed op (one expert, weight 1), for
    T = 0, 1, odd sizes, and past the decode limit; the result is fresh each call (no stale
    rows) and follows the module across .to()."""
    model = _model(family, seed=71)
    sm.patch_model(model, FMT, progress=False, shared_experts=True)
    dense = sm.unpatch_model(copy.deepcopy(model))
    name, mlp = next((n, m) for n, m in model.named_modules() if isinstance(m, shf.SamoyedsMLP))
    ref = copy.deepcopy(dense.get_submodule(name)).to(torch.float64)
    mlp.to(device="cuda", dtype=torch.bfloat16)
    n, m, v = mlp.fmt.c_args()
    H, I = mlp.hidden, mlp.intermediate
    gen = torch.Generator().manual_seed(72)
    for T in (0, 1, 37, 129, 300, 2100):
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            want = ref(x.to(torch.float64))
            got = mlp(x.cuda())
            op = torch.ops.samoyeds.moe_forward(
                x.cuda(), torch.zeros((T, 1), dtype=torch.int64, device="cuda"),
                torch.ones((T, 1), dtype=torch.float32, device="cuda"),
                mlp.samoyeds_gate_up_values, mlp.samoyeds_gate_up_meta, mlp.samoyeds_gate_up_idx, 2 * I, H,
                mlp.samoyeds_down_values, mlp.samoyeds_down_meta, mlp.samoyeds_down_idx, H, I,
                n, m, v, sm.torch_ops.act_id("swiglu"))
        assert got.shape == (T, H) and got.dtype == torch.bfloat16 and got.is_cuda
        if T == 0:
            continue
        assert torch.isfinite(got).all()
        bf16 = rel_err(want.to(torch.bfloat16).double(), want)  # one rounding of the output
        assert rel_err(got.cpu(), want) <= 4 * bf16 + 2e-3, (T, rel_err(got.cpu(), want))
        assert rel_err(got, op) <= 2e-3, (T, rel_err(got, op))
    # a CUDA graph captured at a token count the module has not seen: the capture's [0, T] is
    # not kept for eager calls (it holds its values only when the graph runs)
    x = torch.randn(23, H, generator=gen).to(torch.bfloat16).cuda()
    g = torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(g):
            y_graph = mlp(x)
        eager = mlp(x)
        g.replay()
        torch.cuda.synchronize()
    want = ref(x.cpu().to(torch.float64))
    assert rel_err(eager.cpu(), want) <= 2e-2 and torch.equal(y_graph, eager)
    # the packed view is made again for moved buffers: the fp16 module computes in fp16
    mlp.to(dtype=torch.float16)
    x = torch.randn(37, H, generator=gen)
    with torch.no_grad():
        got = mlp(x.to(device="cuda", dtype=torch.float16))
    assert got.dtype == torch.float16
    assert rel_err(got.cpu(), ref(x.to(torch.float64))) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_shared_experts_gpu_bf16(family):
    """Shared experts packed too, run on the GPU in bf16: the logits at most 2x as far from
    the float64 masked-dense model (routed and shared weights masked) as transformers'
    eager model at bf16 on the same masked weights."""
    model = _model(family, seed=61)
    sm.patch_model(model, FMT, progress=False, shared_experts=True)
    dense = sm.unpatch_model(copy.deepcopy(model))  # exactly w * mask, routed and shared
    if dense.get_experts_implementation()[""] != "eager":
        dense.set_experts_implementation("eager")
    oracle = copy.deepcopy(dense).to(torch.float64)
    eager = copy.deepcopy(dense).to(device="cuda", dtype=torch.bfloat16)
    model.to(device="cuda", dtype=torch.bfloat16)
    assert any(isinstance(m, shf.SamoyedsMLP) for m in model.modules())
    ids = _ids(seed=62)
    with torch.no_grad():
        want = oracle(ids).logits
        e_sam = rel_err(model(ids.cuda()).logits, want)
        e_eager = rel_err(eager(ids.cuda()).logits, want)
    assert e_sam <= 2 * e_eager + 1e-6, (e_sam, e_eager)
