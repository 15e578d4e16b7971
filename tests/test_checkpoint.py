"""Packed checkpoints: a patched model written with samoyeds.save_pretrained and read
with samoyeds.from_pretrained gives the same logits and tokens, is built without
dense expert weights, is ~28 % of the dense experts' bytes at 75 %, and a corrupt,
truncated or mismatched checkpoint raises CheckpointError (never a crash)."""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

import samoyeds as sm  # noqa: E402
import samoyeds.hf as shf  # noqa: E402
from samoyeds.checkpoint import EXPERTS_FILE, MODEL_FILE, CheckpointError, checkpoint_sizes  # noqa: E402
from samoyeds.hf.families import Shape, build_model  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from conftest import GPU  # noqa: E402

transformers.logging.set_verbosity_error()

FMT = "samoyeds-1:2:128"
SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=8, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)


def _patched(family, fmt=FMT, seed=0, shape=SHAPE, dtype=None):
    model = build_model(family, shape, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, mod in model.named_modules():
            for name, p in mod.named_parameters(recurse=False):
                if name.endswith("proj_bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return sm.patch_model(model, fmt, progress=False)


def _ids(seed=5):
    return torch.randint(3, SHAPE.vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)


class _Allocations(TorchDispatchMode):
    """The largest tensor (bytes) any op creates on a real device."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", FMT), ("gpt_oss", FMT), ("llama4", FMT),
                                        ("deepseek_v3", "2:4"), ("mixtral", "samoyeds-1:4:64")])
def test_round_trip(tmp_path, family, fmt):
    model = _patched(family, fmt)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    sm.save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", MODEL_FILE, EXPERTS_FILE]

    spy = _Allocations()
    with spy:
        back = sm.from_pretrained(tmp_path)
    dense_bytes = SHAPE.experts * 2 * SHAPE.intermediate * SHAPE.hidden * 4
    assert 0 < spy.largest < dense_bytes, "no dense expert weight was created while loading"
    assert shf.is_patched(back) and not back.training
    assert shf.experts_weight_nbytes(back) == shf.experts_weight_nbytes(model)
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n, _ in back.named_parameters())
    sd, sd2 = model.state_dict(), back.state_dict()
    assert sorted(sd) == sorted(sd2)
    for k in sd:
        assert torch.equal(sd[k], sd2[k]) and sd[k].dtype == sd2[k].dtype, k
    if getattr(model.config, "tie_word_embeddings", False):
        assert back.lm_head.weight is back.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)
    assert torch.equal(_generate(back, ids), _generate(model, ids))
    # and back to dense: the same masked weights as the saved model's
    sm.unpatch_model(back)
    sm.unpatch_model(model)
    for (n, a), (_, b) in zip(sorted(model.named_parameters()), sorted(back.named_parameters())):
        assert torch.equal(a, b), n


def test_sizes_at_75_percent(tmp_path):
    shape = Shape(vocab=256, hidden=512, layers=1, experts=4, top_k=2, intermediate=256, heads=4, kv_heads=2,
                  head_dim=64)
    model = _patched("qwen3_moe", shape=shape, dtype=torch.bfloat16)
    sm.save_pretrained(model, tmp_path)
    s = checkpoint_sizes(tmp_path)
    assert s["dense_experts_bytes"] == 4 * 3 * 512 * 256 * 2
    # values 25 %, 2:4 metadata 3.1 %, row indices 0.2 % of the dense bf16 bytes (docs/FORMAT.md)
    assert s["packed_fraction"] == pytest.approx(0.25 + 1 / 32 + 1 / 512, abs=1e-9)
    assert s["packed_fraction"] < s["file_fraction"] < 0.29
    assert s["files"][MODEL_FILE] < s["files"][EXPERTS_FILE] * 2


def test_device_argument_and_save_from_any_device(tmp_path):
    model = _patched("qwen3_moe")
    sm.save_pretrained(model, tmp_path)
    back = sm.from_pretrained(tmp_path, device="cpu")
    assert all(t.device.type == "cpu" for t in back.state_dict().values())


# --- errors ---------------------------------------------------------------------------------------

def _rewrite(file, fn_tensors=None, fn_meta=None):
    """Rewrites a safetensors file through fn_tensors(dict) / fn_meta(dict)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(file, "pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if fn_tensors:
        fn_tensors(tensors)
    if fn_meta:
        fn_meta(meta)
    save_file(tensors, file, metadata=meta)


@pytest.fixture
def saved(tmp_path):
    model = _patched("qwen3_moe", seed=3)
    sm.save_pretrained(model, tmp_path / "ok")
    return tmp_path / "ok", model


def _copy(saved, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(saved[0], dst)
    return dst


def test_truncated_files(saved, tmp_path):
    for file in (EXPERTS_FILE, MODEL_FILE):
        for keep in (0.5, 0.999, 6):
            d = _copy(saved, tmp_path, f"trunc-{file}-{keep}")
            data = (d / file).read_bytes()
            n = int(len(data) * keep) if keep < 1 else keep
            (d / file).write_bytes(data[:n])
            with pytest.raises(CheckpointError, match=file):
                sm.from_pretrained(d)


def test_not_safetensors_and_missing_files(saved, tmp_path):
    d = _copy(saved, tmp_path, "garbage")
    (d / EXPERTS_FILE).write_bytes(struct.pack("<Q", 40) + b"{not json" + bytes(100))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        sm.from_pretrained(d)
    d = _copy(saved, tmp_path, "missing")
    os.remove(d / MODEL_FILE)
    with pytest.raises(FileNotFoundError, match=MODEL_FILE):
        sm.from_pretrained(d)
    with pytest.raises(FileNotFoundError, match="config.json"):
        sm.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize("key,value,match", [
    ("samoyeds_layout_version", "2", "layout version 2"),
    ("samoyeds_checkpoint_version", "9", "checkpoint version 9"),
    ("format", "samoyeds-1:2:64", "idx: expected shape"),
    ("format", "2:4", "unexpected for format 2:4"),
    ("modules", "[{]", "malformed"),
    ("model_class", "NoSuchModel", "NoSuchModel"),
])
def test_wrong_header(saved, tmp_path, key, value, match):
    d = _copy(saved, tmp_path, f"hdr-{key}")
    _rewrite(d / EXPERTS_FILE, fn_meta=lambda m: m.__setitem__(key, value))
    with pytest.raises(CheckpointError, match=match):
        sm.from_pretrained(d)


def test_foreign_safetensors_file(saved, tmp_path):
    d = _copy(saved, tmp_path, "foreign")
    _rewrite(d / EXPERTS_FILE, fn_meta=lambda m: m.clear())
    with pytest.raises(CheckpointError, match="samoyeds_checkpoint_version"):
        sm.from_pretrained(d)


def test_shape_and_config_mismatch(saved, tmp_path):
    name = "model.layers.0.mlp.experts.samoyeds_gate_up_values"
    d = _copy(saved, tmp_path, "shape")
    _rewrite(d / EXPERTS_FILE, fn_tensors=lambda t: t.__setitem__(name, t[name][:, :-16].contiguous()))
    with pytest.raises(CheckpointError, match=r"samoyeds_gate_up: values: expected shape"):
        sm.from_pretrained(d)

    d = _copy(saved, tmp_path, "config")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 2 * cfg["moe_intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="intermediate"):
        sm.from_pretrained(d)

    d = _copy(saved, tmp_path, "layers")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="experts modules"):
        sm.from_pretrained(d)

    d = _copy(saved, tmp_path, "dense-shape")
    _rewrite(d / MODEL_FILE, fn_tensors=lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:-1].clone()))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        sm.from_pretrained(d)

    d = _copy(saved, tmp_path, "dense-missing")
    _rewrite(d / MODEL_FILE, fn_tensors=lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        sm.from_pretrained(d)

    d = _copy(saved, tmp_path, "dtype")
    key = "model.layers.1.mlp.experts.samoyeds_down_meta"
    _rewrite(d / EXPERTS_FILE, fn_tensors=lambda t: t.__setitem__(key, t[key].to(torch.int64)))
    with pytest.raises(CheckpointError, match="meta uint32"):
        sm.from_pretrained(d)


def test_corrupt_codes(saved, tmp_path):
    key = "model.layers.1.mlp.experts.samoyeds_down_idx"

    def bad_idx(t):
        t[key] = t[key].clone()
        t[key][2, 0, 5] = 200

    d = _copy(saved, tmp_path, "idx")
    _rewrite(d / EXPERTS_FILE, fn_tensors=bad_idx)
    with pytest.raises(CheckpointError, match=r"samoyeds_down_idx\[2, 0, 5\] = 200"):
        sm.from_pretrained(d)

    key2 = "model.layers.0.mlp.experts.samoyeds_gate_up_meta"

    def bad_meta(t):
        m = t[key2].view(torch.int32).clone()
        m[1, 0, 0, 3] = 0x44F4                     # nibble 1 = 0xF: positions (3, 3)
        t[key2] = m.view(torch.uint32)

    d = _copy(saved, tmp_path, "meta")
    _rewrite(d / EXPERTS_FILE, fn_tensors=bad_meta)
    with pytest.raises(CheckpointError, match="invalid 2:4 code 0xf"):
        sm.from_pretrained(d)

    d = _copy(saved, tmp_path, "stray")
    _rewrite(d / EXPERTS_FILE, fn_tensors=lambda t: t.__setitem__("model.layers.0.mlp.experts.extra", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected"):
        sm.from_pretrained(d)

    d = _copy(saved, tmp_path, "gone")
    _rewrite(d / EXPERTS_FILE, fn_tensors=lambda t: t.pop("model.layers.0.mlp.experts.samoyeds_down_idx"))
    with pytest.raises(CheckpointError, match="missing"):
        sm.from_pretrained(d)
    # and the intact copy still loads
    assert shf.is_patched(sm.from_pretrained(saved[0]))


# --- issue 44: untrusted checkpoints (items 3 and 4) -----------------------------------------------

@pytest.mark.parametrize("name", [
    "os", "logging", "__class__", "AutoModel", "PreTrainedModel", "GenerationConfig", "AutoConfig", "pipeline",
    "BertModel", "LlamaForCausalLM", "Qwen3MoeConfig", "", "torch.nn.Module", "Qwen3MoeForCausalLM.__init__",
])
def test_model_class_from_an_allow_list(saved, tmp_path, name):
    """The header's model_class is only looked up among the classes transformers' auto
    mappings give for config.json's model_type; anything else (a module, a function, a
    config class, another architecture) is a CheckpointError naming the file and the field,
    before anything is instantiated (before: OSError, TypeError, AttributeError)."""
    d = _copy(saved, tmp_path, f"cls-{len(name)}-{name[:8]}")
    _rewrite(d / EXPERTS_FILE, fn_meta=lambda m: m.__setitem__("model_class", name))
    with pytest.raises(CheckpointError, match=rf"{EXPERTS_FILE}: metadata 'model_class'"):
        sm.from_pretrained(d)


def test_model_class_of_another_family_is_refused(saved, tmp_path):
    """Qwen3MoeModel (the base model) is registered for qwen3_moe: built, it has no lm_head and
    fails the experts check, still a CheckpointError."""
    d = _copy(saved, tmp_path, "base-model")
    _rewrite(d / EXPERTS_FILE, fn_meta=lambda m: m.__setitem__("model_class", "Qwen3MoeModel"))
    with pytest.raises(CheckpointError):
        sm.from_pretrained(d)


@pytest.mark.parametrize("key,value,match", [
    ("modules", "[1]", r"'modules'\[0\]: expected an object"),
    ("modules", "{}", "'modules': expected a JSON list"),
    ("modules", "null", "'modules': expected a JSON list"),
    ("modules", '[{"name": 3}]', r"'modules'\[0\]: no field"),
    ("aliases", "[]", "'aliases': expected a JSON dict"),
    ("aliases", '{"a": 1}', r"'aliases'\['a'\]: expected a tensor name"),
    ("aliases", '{"x.weight": "nowhere"}', "expected a tensor of model.safetensors"),
    ("aliases", '{"lm_head.weight": "model.norm.weight"}', "'lm_head.weight' is stored and aliased"),
    ("aliases", '{"model.nothing.weight": "lm_head.weight"}', "is stored and aliased|names no module"),
])
def test_malformed_metadata(saved, tmp_path, key, value, match):
    d = _copy(saved, tmp_path, f"meta-{key}-{abs(hash(value))}")
    _rewrite(d / EXPERTS_FILE, fn_meta=lambda m: m.__setitem__(key, value))
    with pytest.raises(CheckpointError, match=match):
        sm.from_pretrained(d)


def _module_field(field, value):
    def fn(meta):
        mods = json.loads(meta["modules"])
        mods[0][field] = value
        meta["modules"] = json.dumps(mods)
    return fn


@pytest.mark.parametrize("field,value", [("num_experts", "8"), ("alpha", "x"), ("limit", None), ("bias", 1),
                                         ("dtype", "int8"), ("name", 7), ("hidden", -1)])
def test_module_fields_are_typed(saved, tmp_path, field, value):
    d = _copy(saved, tmp_path, f"field-{field}")
    _rewrite(d / EXPERTS_FILE, fn_meta=_module_field(field, value))
    with pytest.raises(CheckpointError, match=rf"'modules'\[0\]\.{field}: expected"):
        sm.from_pretrained(d)


L0 = "model.layers.0.mlp.experts."


def _set(key, fn):
    return lambda t: t.__setitem__(key, fn(t[key]))


def _swap_idx(pos):
    def fn(t):
        key = L0 + "samoyeds_down_idx"
        x = t[key].clone()
        if pos == "swap":
            x[1, 0, [3, 4]] = t[key][1, 0, [4, 3]]
        else:
            x[1, 0, 4] = x[1, 0, 3]
        t[key] = x
    return fn


def _alias(alias, source):
    """The header aliases `alias` to `source`, and model.safetensors no longer stores it."""
    def fn_meta(m):
        m["aliases"] = json.dumps({alias: source})
    fn_meta.drop = alias
    return fn_meta


# the seven checkpoints of issue 44 that loaded and failed only at the first forward (or ran
# with wrong weights), each now refused on load, naming the file and the tensor
LOAD_TIME = [
    ("gate_up_values_dtype", "qwen3_moe", FMT, EXPERTS_FILE,
     _set(L0 + "samoyeds_gate_up_values", lambda v: v.to(torch.bfloat16)), None,
     r"samoyeds_gate_up_values has dtype torch.bfloat16; the experts module's metadata 'dtype' is 'float32'"),
    ("values_dtype_vs_model", "qwen3_moe", FMT, EXPERTS_FILE,
     lambda t: [t.__setitem__(k, t[k].to(torch.bfloat16)) for k in list(t) if k.endswith("_values")],
     None,
     r"has dtype torch.bfloat16; the experts module's metadata 'dtype' is 'float32'"),
    ("bias_dtype", "gpt_oss", FMT, EXPERTS_FILE,
     _set(L0 + "samoyeds_gate_up_bias", lambda v: v.double()), None,
     r"samoyeds_gate_up_bias is torch.float64 .*; expected torch.float32"),
    ("alias_shape", "qwen3_moe", FMT, EXPERTS_FILE, None, _alias("lm_head.weight", "model.norm.weight"),
     r"alias 'lm_head.weight' has shape \(128,\); the model built from config.json expects \(128, 128\)"),
    ("alias_of_a_packed_array", "qwen3_moe", FMT, EXPERTS_FILE, None,
     _alias("lm_head.weight", L0 + "samoyeds_down_values"),
     r"'lm_head.weight' -> '.*samoyeds_down_values': expected a tensor of model.safetensors"),
    ("idx_unordered", "qwen3_moe", "3:8:32", EXPERTS_FILE, _swap_idx("swap"), None,
     r"samoyeds_down_idx\[1, 0, 3\] = \d and \[1, 0, 4\] = \d: the rows one group keeps must increase"),
    ("idx_repeated", "qwen3_moe", "3:8:32", EXPERTS_FILE, _swap_idx("dup"), None,
     r"samoyeds_down_idx\[1, 0, 3\] = \d and \[1, 0, 4\] = \d: the rows one group keeps must increase"),
]


@pytest.mark.parametrize("case", LOAD_TIME, ids=[c[0] for c in LOAD_TIME])
def test_refused_on_load_not_at_first_forward(tmp_path, case):
    name, family, fmt, file, fn_t, fn_m, match = case
    model = _patched(family, fmt, seed=4)
    sm.save_pretrained(model, tmp_path / "ok")
    d = _copy((tmp_path / "ok", model), tmp_path, name)
    _rewrite(d / file, fn_tensors=fn_t, fn_meta=fn_m)
    if getattr(fn_m, "drop", None):
        _rewrite(d / MODEL_FILE, fn_tensors=lambda t: t.pop(fn_m.drop, None))
    with pytest.raises(CheckpointError, match=match) as e:
        sm.from_pretrained(d)
    assert str(e.value).startswith(str(d / file))
    assert shf.is_patched(sm.from_pretrained(tmp_path / "ok"))  # the intact copy loads


@pytest.mark.parametrize("what", ["values_and_header", "dense", "buffer", "int"])
def test_dtypes_agree_with_the_experts(saved, tmp_path, what):
    """The experts' dtype (the header's, which the values must have) is the model's: every
    floating tensor has it or the dtype the model builds it in; nothing else passes."""
    d = _copy(saved, tmp_path, f"dtype-{what}")
    if what == "values_and_header":   # all experts bf16, header too, the rest float32
        def fn_m(meta):
            mods = json.loads(meta["modules"])
            for m in mods:
                m["dtype"] = "bfloat16"
            meta["modules"] = json.dumps(mods)
        _rewrite(d / EXPERTS_FILE, fn_tensors=lambda t: [t.__setitem__(k, t[k].to(torch.bfloat16))
                                                         for k in list(t) if k.endswith("_values")], fn_meta=fn_m)
        match = r"model.safetensors: tensor 'model.embed_tokens.weight' \(the input embeddings: the hidden states' " \
                r"dtype\) is torch.float32; the experts are torch.bfloat16"
    elif what == "dense":
        _rewrite(d / MODEL_FILE, fn_tensors=_set("model.layers.0.self_attn.q_proj.weight", lambda v: v.bfloat16()))
        match = r"model.safetensors: tensor 'model.layers.0.self_attn.q_proj.weight' has dtype torch.bfloat16"
    elif what == "buffer":
        _rewrite(d / EXPERTS_FILE, fn_tensors=lambda t: [t.__setitem__(k, t[k].half())
                                                         for k in list(t) if k.startswith("buffers/")])
        match = r"samoyeds_experts.safetensors: tensor 'model.rotary_emb.\w+' has dtype torch.float16"
    else:   # before: RuntimeError from nn.Parameter
        _rewrite(d / MODEL_FILE, fn_tensors=_set("model.norm.weight", lambda v: v.long()))
        match = r"tensor 'model.norm.weight' has dtype torch.int64"
    with pytest.raises(CheckpointError, match=match):
        sm.from_pretrained(d)


def test_packed_arrays_only_from_the_experts_file(saved, tmp_path):
    """model.safetensors cannot overwrite a checked packed array (nor can an alias)."""
    key = "model.layers.0.mlp.experts.samoyeds_down_idx"
    d = _copy(saved, tmp_path, "smuggled")
    from safetensors import safe_open
    with safe_open(str(d / EXPERTS_FILE), "pt") as f:
        idx = f.get_tensor(key)
    _rewrite(d / MODEL_FILE, fn_tensors=lambda t: t.__setitem__(key, torch.full_like(idx, 200)))
    with pytest.raises(CheckpointError, match="is a packed experts array"):
        sm.from_pretrained(d)


def test_bfloat16_round_trip_on_the_cpu(tmp_path):
    model = build_model("qwen3_moe", SHAPE, seed=2, dtype=torch.bfloat16)
    sm.patch_model(model, "3:8:32", progress=False)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    sm.save_pretrained(model, tmp_path)
    back = sm.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)


@pytest.mark.parametrize("layers", [2**40, 10**6, -1])
def test_config_cannot_ask_for_more_layers_than_stored(saved, tmp_path, layers):
    """Building 2**40 layers on the meta device never ends (found by the fuzzer): a layer
    count above model.safetensors' tensor count is refused before anything is built."""
    d = _copy(saved, tmp_path, f"layers-{layers}")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: num_hidden_layers|config.json: not a transformers"):
        sm.from_pretrained(d)


def test_save_needs_a_patched_model(tmp_path):
    model = build_model("qwen3_moe", SHAPE)
    with pytest.raises(ValueError, match="patch_model"):
        sm.save_pretrained(model, tmp_path)
    assert not os.listdir(tmp_path)


@pytest.mark.gpu
def test_round_trip_gpu_bf16(tmp_path):
    assert GPU
    model = build_model("qwen3_moe", SHAPE, seed=9, dtype=torch.bfloat16, device="cuda")
    sm.patch_model(model, FMT, progress=False)
    ids = _ids().cuda()
    with torch.no_grad():
        want = model(ids).logits
    sm.save_pretrained(model, tmp_path)
    back = sm.from_pretrained(tmp_path, device="cuda")
    assert all(t.device.type == "cuda" for t in back.state_dict().values())
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)
