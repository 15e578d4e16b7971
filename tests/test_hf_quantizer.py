"""Samoyeds through transformers' own save/load (quant_method "samoyeds", hf/quantizer.py):
for every family, ``model.save_pretrained`` of a patched model and plain
``AutoModelForCausalLM.from_pretrained`` give back the same logits bit for bit, with no dense
expert weight created; packing a dense checkpoint while loading gives exactly what
``patch_model`` gives on the same weights; switching implementation raises
samoyeds errors naming ``samoyeds.unpatch_model``."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import io
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import samoyeds as sm  # noqa: E402
from helpers import run_python  # noqa: E402
import samoyeds.hf as shf  # noqa: E402
from samoyeds.hf import quantizer as shq  # noqa: E402
from samoyeds.hf.families import FAMILIES, Shape, build_model  # noqa: E402

transformers.logging.set_verbosity_error()

SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=8, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)
FMT = "samoyeds-1:2:128"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SHAPE.vocab, (2, 11), generator=g)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _load(path, **kw):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, bad
    return model


def _no_dense_experts(model):
    for name, mod in model.named_modules():
        if getattr(mod, "_samoyeds", None) is not None:
            assert "gate_up_proj" not in mod._parameters and "down_proj" not in mod._parameters, name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_load_roundtrip_is_bit_identical(family, tmp_path):
    model = build_model(family, SHAPE, seed=3)
    sm.patch_model(model, FMT, progress=False)
    ids = _ids()
    want = _logits(model, ids)
    model.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))["quantization_config"]
    assert cfg["quant_method"] == "samoyeds" and cfg["format"] == FMT
    assert cfg["layout_version"] == sm._C.LAYOUT_VERSION

    loaded = _load(tmp_path)
    assert shf.is_patched(loaded)
    _no_dense_experts(loaded)
    assert isinstance(loaded.config.quantization_config, shq.SamoyedsConfig)
    assert torch.equal(_logits(loaded, ids), want)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sorted(sd) == sorted(sd2)
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_time_packing_equals_patch_model(family, tmp_path):
    dense = build_model(family, SHAPE, seed=4)
    dense.save_pretrained(tmp_path)
    ids = _ids(1)
    sm.patch_model(dense, FMT, progress=False)
    want = _logits(dense, ids)

    loaded = _load(tmp_path, quantization_config=shq.SamoyedsConfig(format=FMT, method="magnitude"),
                   device_map="cpu")
    assert shf.is_patched(loaded)
    _no_dense_experts(loaded)
    sd, sd2 = dense.state_dict(), loaded.state_dict()
    assert sorted(sd) == sorted(sd2)
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    assert torch.equal(_logits(loaded, ids), want)

    # a model packed while loading saves as a samoyeds model
    loaded.save_pretrained(tmp_path / "packed")
    again = _load(tmp_path / "packed")
    assert torch.equal(_logits(again, ids), want)


def test_pre_quantized_load_never_packs_or_builds_dense_experts(tmp_path, monkeypatch):
    model = build_model("qwen3_moe", SHAPE, seed=5)
    sm.patch_model(model, FMT, progress=False)
    model.save_pretrained(tmp_path)

    def refuse(*a, **k):
        raise AssertionError("a pre-quantized load must not pack")

    monkeypatch.setattr(shq, "pack", refuse)
    shapes = []
    real = torch.nn.Module.register_parameter

    def spy(self, name, param):
        if name in ("gate_up_proj", "down_proj") and param is not None and param.device.type != "meta":
            shapes.append((name, tuple(param.shape)))
        return real(self, name, param)

    monkeypatch.setattr(torch.nn.Module, "register_parameter", spy)
    loaded = _load(tmp_path)
    assert shapes == []
    _no_dense_experts(loaded)


def test_device_map_auto_on_cpu(tmp_path):
    model = build_model("mixtral", SHAPE, seed=6)
    sm.patch_model(model, FMT, progress=False)
    ids = _ids(2)
    want = _logits(model, ids)
    model.save_pretrained(tmp_path)
    loaded = _load(tmp_path, device_map="auto")
    assert torch.equal(_logits(loaded, ids), want)


def test_plain_24_and_another_format_roundtrip(tmp_path):
    for fmt in ("2:4", "samoyeds-2:4:64"):
        try:
            model = build_model("olmoe", SHAPE, seed=7)
            sm.patch_model(model, fmt, progress=False)
        except (ValueError, shf.UnsupportedModelError):
            continue
        ids = _ids(3)
        want = _logits(model, ids)
        out = tmp_path / fmt.replace(":", "_")
        model.save_pretrained(out)
        loaded = _load(out)
        assert loaded.config.quantization_config.format == sm.SparseFormat.parse(fmt).name
        assert torch.equal(_logits(loaded, ids), want)


def test_corrupt_metadata_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build_model("qwen3_moe", SHAPE, seed=8)
    sm.patch_model(model, FMT, progress=False)
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    key = next(k for k in sd if k.endswith("samoyeds_down_meta"))
    sd[key] = torch.zeros_like(sd[key])  # nibble 0 is not a 2:4 code
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="2:4 code"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_other_layout_version_is_refused(tmp_path):
    model = build_model("mixtral", SHAPE, seed=9)
    sm.patch_model(model, FMT, progress=False)
    model.save_pretrained(tmp_path)
    cfg = json.load(open(tmp_path / "config.json"))
    cfg["quantization_config"]["layout_version"] = sm._C.LAYOUT_VERSION + 1
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="layout version"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_load_time_packing_takes_magnitude_only(tmp_path):
    build_model("mixtral", SHAPE).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="sparsify_model"):
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, quantization_config=shq.SamoyedsConfig(format=FMT, method="sparsegpt"))


def test_config_roundtrips_and_checks():
    cfg = shq.SamoyedsConfig(format="samoyeds-1:2:128", router=False)
    again = shq.SamoyedsConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()
    with pytest.raises(ValueError):
        shq.SamoyedsConfig(format="3:5")
    with pytest.raises(TypeError):
        shq.SamoyedsConfig(shared_stream="yes")
    with pytest.raises(TypeError, match="unexpected"):
        shq.SamoyedsConfig(bits=4)


def test_config_records_how_weights_were_chosen():
    model = build_model("mixtral", SHAPE)
    sm.patch_model(model, FMT, progress=False)
    assert model.config.quantization_config.method == "magnitude"
    sm.unpatch_model(model)
    sm.patch_model(model, FMT, progress=False, method=lambda name, proj, w, fmt: sm.mask(w, fmt))
    assert model.config.quantization_config.method == "custom"


def test_packed_shared_experts_are_not_serialisable(tmp_path):
    model = build_model("qwen2_moe", SHAPE)
    sm.patch_model(model, FMT, progress=False, shared_experts=True)
    with pytest.raises(NotImplementedError, match="shared_experts"):
        model.save_pretrained(tmp_path)


def test_unpatch_gives_a_plain_dense_model(tmp_path):
    model = build_model("deepseek_v3", SHAPE, seed=10)
    sm.patch_model(model, FMT, progress=False)
    ids = _ids(4)
    want = _logits(model, ids)
    sm.unpatch_model(model)
    assert getattr(model, "hf_quantizer", None) is None
    assert not hasattr(model.config, "quantization_config")
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in json.load(open(tmp_path / "config.json"))
    loaded = _load(tmp_path)
    assert not shf.is_patched(loaded)
    loaded.set_experts_implementation("eager")
    torch.testing.assert_close(_logits(loaded, ids), want, rtol=1e-4, atol=1e-4)


def test_dequantize_unpatches(tmp_path):
    model = build_model("olmoe", SHAPE, seed=11)
    sm.patch_model(model, FMT, progress=False)
    model.save_pretrained(tmp_path)
    loaded = _load(tmp_path)
    loaded.dequantize()
    assert not shf.is_patched(loaded)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(loaded.named_parameters())
    loaded.set_experts_implementation("batched_mm")
    _logits(loaded, _ids())


def test_copies_and_pickles_keep_the_quantizer(tmp_path):
    model = build_model("granitemoe", SHAPE, seed=12)
    sm.patch_model(model, FMT, progress=False)
    ids = _ids(5)
    want = _logits(model, ids)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        with pytest.raises(shf.PatchedModelError):
            clone.set_experts_implementation("eager")
        out = tmp_path / str(id(clone))
        clone.save_pretrained(out)
        assert torch.equal(_logits(_load(out), ids), want)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v2"])
def test_switching_implementation_raises_naming_unpatch(family, impl):
    model = build_model(family, SHAPE, seed=13)
    sm.patch_model(model, FMT, progress=False)
    ids = _ids(6)
    want = _logits(model, ids)
    with pytest.raises(shf.PatchedModelError, match=r"samoyeds\.unpatch_model"):
        model.set_experts_implementation(impl)
    assert model.config._experts_implementation == "samoyeds"
    assert torch.equal(_logits(model, ids), want)
    model.set_experts_implementation("samoyeds")  # the same choice is fine
    sm.unpatch_model(model)
    model.set_experts_implementation(impl)
    _logits(model, ids)


def test_switching_after_loading_raises(tmp_path):
    model = build_model("qwen3_moe", SHAPE)
    sm.patch_model(model, FMT, progress=False)
    model.save_pretrained(tmp_path)
    loaded = _load(tmp_path)
    with pytest.raises(shf.PatchedModelError, match=r"samoyeds\.unpatch_model"):
        loaded.set_experts_implementation("grouped_mm")


@pytest.mark.parametrize("family", ["mixtral", "llama4"])
def test_a_loaded_model_trains(family, tmp_path):
    """The packed values load as trainable Parameters; a backward reaches them (docs/HF.md, Training)."""
    model = build_model(family, SHAPE)
    sm.patch_model(model, FMT, progress=False)
    model.save_pretrained(tmp_path)
    loaded = _load(tmp_path)
    values = [p for n, p in loaded.named_parameters() if n.endswith("_values")]
    assert values and all(p.requires_grad for p in values)
    out = loaded(_ids()).logits
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in values)


def test_import_hook_registers_without_importing_transformers(tmp_path):
    model = build_model("phimoe", SHAPE, seed=14)
    sm.patch_model(model, FMT, progress=False)
    model.save_pretrained(tmp_path)
    ids = _ids(7)
    torch.save({"ids": ids, "want": _logits(model, ids)}, tmp_path / "ref.pt")
    code = (
        "import sys, samoyeds, samoyeds._hf_hook as hook\n"
        "hook.install()\n"
        "assert 'transformers' not in sys.modules, 'import samoyeds imported transformers'\n"
        "import torch, transformers\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        f"ref = torch.load({str(tmp_path / 'ref.pt')!r})\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(m(ref['ids']).logits, ref['want'])\n"
        "print('ok')\n")
    r = run_python(["-c", code], cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# VmHWM: this process's peak RSS (ru_maxrss would carry the parent's over fork + exec)
_PEAK = """
import json, sys, torch, transformers
import transformers.modeling_utils
import samoyeds.hf.quantizer as q
def hwm():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))
kw = {'quantization_config': q.SamoyedsConfig()} if sys.argv[2] == 'pack' else {}
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
before = hwm()
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map='cpu', **kw)
print(json.dumps({'grew_kib': hwm() - before}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc (Linux)")
def test_load_time_packing_peak_memory_is_below_dense(tmp_path):
    """Peak RSS growth while loading (a fresh process each; the checkpoint file's pages count too):
    dense > packing while loading > loading the packed model."""
    shape = Shape(vocab=128, hidden=512, layers=3, experts=16, top_k=2, intermediate=512, heads=8, kv_heads=4,
                  head_dim=64)
    model = build_model("qwen3_moe", shape)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    model.save_pretrained(tmp_path / "dense")
    sm.patch_model(model, FMT, progress=False)
    model.save_pretrained(tmp_path / "packed")
    del model


    def grew(path, mode):
        r = run_python(["-c", _PEAK, str(path), mode])
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])["grew_kib"] * 1024

    dense, packing, packed = grew(tmp_path / "dense", "dense"), grew(tmp_path / "dense", "pack"), \
        grew(tmp_path / "packed", "x")
    print(f"expert weights {expert_bytes / 2**20:.0f} MiB; peak RSS growth: dense {dense / 2**20:.0f} MiB, "
          f"packing while loading {packing / 2**20:.0f} MiB, packed {packed / 2**20:.0f} MiB")
    assert packing < dense
    assert packed < expert_bytes / 2 < dense


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "llama4"])
def test_load_time_packing_bf16(family, device, tmp_path):
    """In bf16 (on the GPU with device_map="cuda"): packing while loading equals patch_model of
    the same checkpoint loaded dense, a save -> load round trip is bit-identical, and (GPU) the
    loads allocate less memory than the dense experts.  The reference is loaded, not the
    built model: a model built and cast to bf16 keeps its rotary frequencies in bf16, a loaded
    one in fp32, and their logits differ (what this test once compared, H100 2026-11-27)."""
    gpu = device == "cuda"
    # six layers: the loader holds one layer's dense experts (and, where the checkpoint stores
    # experts one by one, their merged copy) at a time, a third of the whole on this depth
    dense = build_model(family, dataclasses.replace(SHAPE, layers=6), seed=15, dtype=torch.bfloat16)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in dense.named_parameters() if ".experts." in n)
    dense.save_pretrained(tmp_path / "dense")
    del dense
    ref = _load(tmp_path / "dense", device_map=device, dtype=torch.bfloat16)
    sm.patch_model(ref, FMT, progress=False)
    ids = _ids(8).to(device)
    want = _logits(ref, ids)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    del ref
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loaded = _load(tmp_path / "dense", quantization_config=shq.SamoyedsConfig(format=FMT), device_map=device,
                   dtype=torch.bfloat16)
    sd2 = loaded.state_dict()
    assert sorted(sd) == sorted(sd2)
    for k in sd:   # the packed arrays first: a difference in the logits has a cause here
        assert sd[k].dtype == sd2[k].dtype and torch.equal(sd[k], sd2[k].to(sd[k].device)), \
            (k, sd[k].dtype, sd2[k].dtype, sd2[k].device)
    assert torch.equal(_logits(loaded, ids), want)
    non_expert = sum(p.numel() * p.element_size() for n, p in loaded.named_parameters())
    if gpu:
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < non_expert + expert_bytes / 2, (peak, non_expert, expert_bytes)

    loaded.save_pretrained(tmp_path / "packed")
    del loaded
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    again = _load(tmp_path / "packed", device_map=device)
    if gpu:
        assert torch.cuda.max_memory_allocated() - base < non_expert + expert_bytes / 2
    assert torch.equal(_logits(again, ids), want)
