"""Training through patched Hugging Face models (CPU, fp32, every family's tiny model).

The reference is the same model unpatched, on the identically masked dense expert weights
with transformers' eager experts: the loss, the gradients of the hidden states, of every
Parameter outside the experts (attention, routers, norms, embeddings, shared experts) and of
the expert biases agree within rounding, and the gradient of the packed values is the dense
gradient at the kept positions, packed.  Gradient checkpointing gives the same gradients; an
optimizer step moves only the kept weights; PEFT LoRA on attention trains over frozen packed
experts; samoyeds.finetune heals a sparsified model that then saves and loads bit for bit.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import samoyeds as sm  # noqa: E402
import samoyeds.hf as shf  # noqa: E402
from samoyeds import torch_ops  # noqa: E402
from samoyeds.hf.experts import moe_op  # noqa: E402
from samoyeds.hf.families import FAMILIES, Shape, build_model  # noqa: E402

from helpers import rel_err  # noqa: E402

transformers.logging.set_verbosity_error()

SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=4, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)
FMT = "samoyeds-1:2:128"
# How each family stores gate_up_proj, read from its modeling file (not from samoyeds.hf):
# (transposed [E, H, 2I], gate/up interleaved along 2I).
LAYOUT = {"gpt_oss": (True, True), "llama4": (True, False)}
TOL = 1e-4   # relative error (norm) of an fp32 gradient: the sums run in another order


def _experts(model):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m._parameters.get("gate_up_proj"), torch.Tensor) and m.gate_up_proj.dim() == 3]


def _model(family, seed=0, shape=SHAPE):
    model = build_model(family, shape, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, mod in _experts(model):
            for name, p in mod.named_parameters(recurse=False):
                if name.endswith("bias"):   # zero at init; random here so that their gradients mean something
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def _to_pack(w, family, proj):
    """A tensor in the model's layout -> [E, out, in] with gate rows before up rows."""
    transposed, interleaved = LAYOUT.get(family, (False, False))
    w = w.transpose(1, 2) if transposed else w
    if proj == "gate_up_proj" and interleaved:
        w = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
    return w.contiguous()


def _from_pack(w, family, proj):
    transposed, interleaved = LAYOUT.get(family, (False, False))
    if proj == "gate_up_proj" and interleaved:
        half = w.shape[1] // 2
        w = torch.stack([w[:, :half], w[:, half:]], dim=2).flatten(1, 2)
    return (w.transpose(1, 2) if transposed else w).contiguous()


def _masks(model, family):
    """Magnitude masks of every experts module, in the model's layout."""
    return {name: {proj: _from_pack(sm.mask(_to_pack(getattr(mod, proj).detach(), family, proj), FMT), family, proj)
                   for proj in ("gate_up_proj", "down_proj")}
            for name, mod in _experts(model)}


def _pair(family, seed=0):
    """(patched model, masked dense reference on transformers' eager experts, masks), train mode."""
    model = _model(family, seed)
    masks = _masks(model, family)
    ref = copy.deepcopy(model)
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for name, mm in masks.items():
            for proj, m in mm.items():
                getattr(mods[name], proj).mul_(m)
    if family != "llama4":
        ref.set_experts_implementation("eager")
    sm.patch_model(model, FMT, progress=False, masks=masks)
    return model.train(), ref.train(), masks


def _ids(batch=2, length=12, seed=5):
    return torch.randint(3, SHAPE.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _aux(model):
    return "output_router_logits" in inspect.signature(type(model).forward).parameters


def _backward(model, ids):
    """Loss (with the router's aux loss where the family has one) and the gradient of the
    first layer's output (retain_grad)."""
    kw = dict(input_ids=ids, labels=ids, use_cache=False, output_hidden_states=True)
    if _aux(model):
        kw["output_router_logits"] = True
    out = model(**kw)
    h = out.hidden_states[1]
    h.retain_grad()
    out.loss.backward()
    return out.loss.detach(), h.grad


def _checkpointing(model, kwargs):
    """Gradient checkpointing on (``kwargs``: torch.utils.checkpoint's) or off (None)."""
    on = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    if kwargs is None:
        off()
    else:
        try:
            on(activation_checkpointing_kwargs=kwargs)
        except TypeError:
            on(gradient_checkpointing_kwargs=kwargs)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_match_masked_dense_and_a_step_moves_only_kept_weights(family):
    model, ref, masks = _pair(family)
    ids = _ids()
    loss, h_grad = _backward(model, ids)
    ref_loss, ref_h_grad = _backward(ref, ids)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    assert rel_err(h_grad, ref_h_grad) < TOL
    got, want = _grads(model), _grads(ref)

    # every Parameter outside the packed experts: same name, same gradient
    packed = {n for n, _ in model.named_parameters() if ".samoyeds_" in n}
    assert packed and set(got) - packed <= set(want), sorted(set(got) - packed - set(want))
    for name, g in got.items():
        if name not in packed:
            assert rel_err(g, want[name]) < TOL, name
    routers = [n for n in got if any(k in n for k in (".gate.weight", ".router.weight"))]
    assert routers, "the routers get gradients"
    # the packed values: the dense gradient at the kept positions, packed
    for name, mm in masks.items():
        mod = model.get_submodule(name)
        for proj, m in mm.items():
            g = want[f"{name}.{proj}"]
            pw = sm.pack(_to_pack(g, family, proj), FMT, mask=_to_pack(m, family, proj), glu=proj == "gate_up_proj")
            short = proj[: -len("_proj")]
            assert torch.equal(pw.meta, getattr(mod, f"samoyeds_{short}_meta")), "the same mask"
            assert rel_err(got[f"{name}.samoyeds_{short}_values"], pw.values) < TOL, (name, proj)
        if family == "gpt_oss":
            g = want[f"{name}.gate_up_proj_bias"]
            assert rel_err(got[f"{name}.samoyeds_gate_up_bias"], torch.cat([g[:, 0::2], g[:, 1::2]], 1)) < TOL

    # gradient checkpointing, both of torch's kinds: the reference's gradients in the same mode
    # (reentrant checkpointing changes the unpatched model's router and embedding gradients by
    # ~1e-4 too), and without reentry exactly those without checkpointing
    for reentrant in (False, True):
        grads = []
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            _checkpointing(m, {"use_reentrant": reentrant})
            loss_ckpt, _ = _backward(m, ids)
            _checkpointing(m, None)
            grads.append(_grads(m))
        assert loss_ckpt.item() == ref_loss.item()
        assert set(grads[0]) == set(got)
        for name, g in grads[0].items():
            if not reentrant:
                torch.testing.assert_close(g, got[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
            if name not in packed:
                assert rel_err(g, grads[1][name]) < TOL, (reentrant, name)

    # one optimizer step: every packed value moves, the padding and the masks do not
    before = {n: b.clone() for n, b in model.named_buffers() if ".samoyeds_" in n}
    values = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("_values")}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    for n, b in model.named_buffers():
        if n in before:
            assert torch.equal(b, before[n]), n
    for n, old in values.items():
        new = dict(model.named_parameters())[n].detach()
        assert torch.equal(new[old == 0], torch.zeros_like(new[old == 0])), f"{n}: padding moved"
        assert (new != old)[old != 0].float().mean() > 0.9, f"{n}: kept weights did not move"
    for name, mm in masks.items():
        mod = model.get_submodule(name)
        p = mod._samoyeds
        for proj, m in mm.items():
            short = proj[: -len("_proj")]
            rows = (2 * p.intermediate, p.hidden) if short == "gate_up" else (p.hidden, p.intermediate)
            arrays = [getattr(mod, f"samoyeds_{short}_{a}") for a in ("values", "meta", "idx")]
            dense = sm.unpack(sm.PackedWeight(arrays[0].detach(), *arrays[1:], p.fmt, (p.num_experts, *rows),
                                              glu=short == "gate_up"))
            mp = _to_pack(m, family, proj)
            assert not dense[~mp].any(), f"{name}.{proj}: a weight outside the mask"
            assert (dense[mp] != 0).all()


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("mode", [False, "gate"])
def test_config_save_preact_false_gives_the_same_gradients(family, mode):
    """samoyeds.config(save_preact=False): a patched model in training mode keeps no
    pre-activation and recomputes it in the backward, to the same gradients; "gate" keeps its
    gate half and recomputes the up half, to the same gradients too."""
    model, _, _ = _pair(family)
    ids = _ids()
    saved = []

    def run():
        n = [0]

        def pack(t):
            n[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = _backward(model, ids)
        saved.append(n[0])
        return loss

    loss = run()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    with sm.config(save_preact=mode):
        again = run()
    got = _grads(model)
    assert saved[1] < saved[0], saved   # the pre-activations were not kept
    assert torch.equal(loss, again)
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_values_are_parameters_masks_are_buffers_and_freezing():
    model = _model("gpt_oss", seed=3)
    keys = set(model.state_dict())
    sm.patch_model(model, FMT, progress=False)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    e = "model.layers.0.mlp.experts."
    for proj in ("gate_up", "down"):
        assert isinstance(params[f"{e}samoyeds_{proj}_values"], torch.nn.Parameter)
        assert params[f"{e}samoyeds_{proj}_values"].requires_grad, "trainable by default, like the dense weights"
        assert f"{e}samoyeds_{proj}_meta" in buffers and f"{e}samoyeds_{proj}_idx" in buffers
    assert params[f"{e}samoyeds_gate_up_bias"].requires_grad and params[f"{e}down_proj_bias"].requires_grad
    assert {k for k in model.state_dict() if ".experts." not in k} == {k for k in keys if ".experts." not in k}
    assert len(shf.experts_parameters(model)) == 3 * SHAPE.layers
    assert set(map(id, shf.experts_parameters(model))) <= set(map(id, model.parameters()))

    assert sm.freeze_experts(model) is model
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".experts." in n)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".experts." not in n)
    sm.freeze_experts(model, False)
    assert all(p.requires_grad for p in model.parameters())

    # requires_grad goes both ways through patch / unpatch
    sm.freeze_experts(model)
    sm.unpatch_model(model)
    assert not model.model.layers[0].mlp.experts.gate_up_proj.requires_grad
    sm.patch_model(model, FMT, progress=False)
    assert not any(p.requires_grad for p in shf.experts_parameters(model))
    with pytest.raises(ValueError, match="patch_model"):
        sm.freeze_experts(_model("mixtral"))


def test_inference_skips_autograd():
    """Eager inference (no grad mode, or nothing that requires grad) calls the op's body
    directly, even with trainable packed values; a graph goes through the op's autograd."""
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4))
    with torch.no_grad():
        assert moe_op(x, w) is torch_ops.moe_forward_eager
    with torch.inference_mode():
        assert moe_op(x, w) is torch_ops.moe_forward_eager
    assert moe_op(x.detach(), w.detach(), None) is torch_ops.moe_forward_eager
    from samoyeds.hf import experts as hf_experts
    assert moe_op(x.detach(), w) is hf_experts._eval_forward     # eval: the inference output (no pre-activation)
    assert moe_op(x, None, training=True) is hf_experts._train_forward   # train: keeps the pre-activation

    model = _model("qwen3_moe", seed=4)
    sm.patch_model(model, FMT, progress=False)
    ids = _ids()
    with torch.no_grad():
        a = model(ids).logits
    b = model(ids).logits
    assert not a.requires_grad and b.requires_grad and torch.equal(a, b)


@pytest.mark.parametrize("family", ["mixtral", "llama4"])
def test_lora_on_attention_with_frozen_packed_experts(family, tmp_path):
    peft = pytest.importorskip("peft")
    model, ref, _ = _pair(family, seed=6)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    pm = peft.get_peft_model(model, peft.LoraConfig(**cfg))
    torch.manual_seed(0)
    pr = peft.get_peft_model(ref, peft.LoraConfig(**cfg))
    assert not any(p.requires_grad for p in shf.experts_parameters(model)), "PEFT freezes the packed experts"
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    ids = _ids(seed=7)
    for m in (pm, pr):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    got, want = _grads(pm), _grads(pr)
    assert set(got) == trainable == set(want)
    for n in trainable:
        assert rel_err(got[n], want[n]) < TOL, n
    assert all(p.grad is None for p in shf.experts_parameters(model))

    # with gradient checkpointing (reentrant: the inputs must require grad)
    pm.zero_grad(set_to_none=True)
    _checkpointing(pm, {"use_reentrant": True})
    pm.enable_input_require_grads()
    pm(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for n in trainable:
        torch.testing.assert_close(pm.get_parameter(n).grad, got[n], rtol=1e-5, atol=1e-7)
    _checkpointing(pm, None)

    values = [p.detach().clone() for p in shf.experts_parameters(model)]
    history = sm.finetune(pm, [_ids(seed=s) for s in range(2)], steps=6, lr=1e-2)
    assert history[-1] < history[0], history
    assert all(torch.equal(a, b) for a, b in zip(values, shf.experts_parameters(model)))
    pm.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_sparsify_finetune_save_load(family, tmp_path):
    """sparsify_model -> finetune (the loss falls) -> save_pretrained -> from_pretrained gives
    the fine-tuned logits bit for bit, with trainable packed values."""
    model = build_model(family, Shape(), seed=8)
    gen = torch.Generator().manual_seed(9)
    data = [torch.randint(3, 128, (4, 16), generator=gen) for _ in range(4)]
    sm.sparsify_model(model, FMT, "activation", calibration=data[:2], progress=False)
    with torch.no_grad():
        before = model(data[0]).logits
    history = sm.finetune(model, data, steps=8, lr=3e-3, router_aux_loss=True, gradient_checkpointing=True)
    assert len(history) == 8 and history[-1] < history[0] - 0.05, history
    assert not model.training and not model.is_activation_checkpointing
    with torch.no_grad():
        after = model(data[0]).logits
    assert not torch.equal(before, after)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert shf.is_patched(loaded) and not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(data[0]).logits, after)
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in shf.experts_parameters(loaded))
    loaded.train()
    loaded(input_ids=data[1], labels=data[1]).loss.backward()
    assert all(p.grad is not None for p in shf.experts_parameters(loaded))


def test_finetune_arguments():
    model = build_model("olmoe", Shape(), seed=10)
    sm.patch_model(model, FMT, progress=False)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(11))
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no Parameter requires grad"):
        sm.finetune(model, [ids])
    sm.freeze_experts(model, False)   # the experts alone
    other = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with pytest.raises(ValueError, match="steps"):
        sm.finetune(model, iter([ids]))
    with pytest.raises(TypeError, match="batches"):
        sm.finetune(model, [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"^batches: empty"):
        sm.finetune(model, [])
    with pytest.raises(TypeError, match=r"^freeze: expected a bool"):
        sm.freeze_experts(model, "no")
    with pytest.raises(ValueError, match="router_aux_loss"):
        sm.finetune(build_model("llama4", Shape(), seed=10), [ids], router_aux_loss=True)
    seen = []
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    history = sm.finetune(model, [{"input_ids": ids, "attention_mask": mask}], steps=3, lr=1e-2,
                          callback=lambda step, loss: seen.append((step, loss)))
    assert [s for s, _ in seen] == [0, 1, 2] and [v for _, v in seen] == history
    assert all(torch.equal(p, other[n]) for n, p in model.named_parameters() if n in other)


def test_transformers_trainer_fine_tunes_a_patched_model(tmp_path):
    """transformers.Trainer takes a patched model (its quantizer says it trains) and updates
    the packed values with the rest."""
    model = build_model("mixtral", Shape(), seed=12)
    sm.patch_model(model, FMT, progress=False)
    gen = torch.Generator().manual_seed(13)
    rows = torch.randint(3, 128, (16, 16), generator=gen)
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8,
                                          learning_rate=3e-3, report_to=[], save_strategy="no", logging_steps=1,
                                          use_cpu=True, disable_tqdm=True)
    values = [p.detach().clone() for p in shf.experts_parameters(model)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert all(not torch.equal(a, b) for a, b in zip(values, shf.experts_parameters(model)))
    assert shf.is_patched(model)


def test_packed_shared_experts_train():
    """shared_experts=True: the SamoyedsMLP's packed values train like the routed experts'; the
    gradients match the unpatched model's (masked dense Linear weights) at the kept places."""
    model = _model("deepseek_v2", seed=14)
    sm.patch_model(model, FMT, progress=False, shared_experts=True)
    ref = sm.unpatch_model(copy.deepcopy(model))
    model.train(), ref.train()
    ids = _ids(seed=15)
    _, h = _backward(model, ids)
    _, h_ref = _backward(ref, ids)
    assert rel_err(h, h_ref) < TOL
    mlps = [m for m in model.modules() if isinstance(m, shf.SamoyedsMLP)]
    assert mlps and all(p.grad is not None for m in mlps for p in shf.experts_parameters(m))
    (name, mlp), = [(n, m) for n, m in model.named_modules() if isinstance(m, shf.SamoyedsMLP)]
    lin = ref.get_submodule(name)
    I = mlp.intermediate
    dense_g = torch.cat([lin.gate_proj.weight.grad, lin.up_proj.weight.grad])[None]
    keep = sm.unpack(mlp._packed("gate_up")) != 0
    pw = sm.pack(dense_g.contiguous(), FMT, mask=keep, glu=True)
    assert dense_g.shape[1] == 2 * I and rel_err(mlp.samoyeds_gate_up_values.grad, pw.values) < TOL
