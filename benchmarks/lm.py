"""Causal LMs of real MoE models, built from their published configs with random
weights (nothing is downloaded), layer by layer on the target device.

The model is first built on the meta device (no memory), then materialised one
decoder layer at a time, each followed by an optional hook: with the hook
``samoyeds.patch_model(layer)`` the dense experts of a layer exist only until
that layer is packed, so a model whose dense weights exceed the GPU's memory
(Mixtral-8x7B: 93 GB in bf16) can still be built in its packed form.

Weights: matrices ~ N(0, initializer_range), norm weights 1, biases 0; rotary
embeddings are rebuilt on the device (their buffers are computed, not loaded).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

# Fields of the models' published config.json (Hugging Face Hub), as transformers config kwargs.
REAL: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "olmoe-1b-7b": ("OlmoeConfig", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=1, topk_group=1,
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "mixtral-8x7b": ("MixtralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)),
}

# --tiny: the same architectures at toy sizes (CPU smoke runs)
_TINY = {
    "qwen3-30b-a3b": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2),
    "olmoe-1b-7b": dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2),
    "deepseek-v2-lite": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                             n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=8,
                             qk_nope_head_dim=8, v_head_dim=16),
    "mixtral-8x7b": dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
}


def config(name: str, tiny: bool = False, layers: Optional[int] = None, **overrides: Any) -> Any:
    """The transformers config of ``name`` (a key of REAL), with ``layers`` decoder
    layers (default: the real depth) and sdpa attention."""
    import transformers

    if name not in REAL:
        raise ValueError(f"model: expected one of {sorted(REAL)}, got {name!r}")
    cls, fields = REAL[name]
    fields = dict(fields)
    if tiny:
        fields.update(_TINY[name], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    fields.update(overrides)
    fields.setdefault("initializer_range", 0.02)
    cfg = getattr(transformers, cls)(**fields)
    cfg._attn_implementation = "sdpa"
    return cfg


def real_layers(name: str) -> int:
    return REAL[name][1]["num_hidden_layers"]


def meta_model(cfg: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``cfg`` on the meta device (parameters in ``dtype``, no memory)."""
    import transformers

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def layer_bytes(cfg: Any, dtype: torch.dtype) -> Tuple[int, List[int], int]:
    """(bytes outside the decoder layers, bytes of each layer, parameter count) of the
    dense model of ``cfg``, measured on the meta device."""
    model = meta_model(cfg, dtype)
    layers = [param_bytes(layer) for layer in model.model.layers]
    total = param_bytes(model)
    return total - sum(layers), layers, sum(p.numel() for p in model.parameters())


def fit_depth(cfg: Any, dtype: torch.dtype, budget_bytes: float) -> int:
    """The most decoder layers of ``cfg`` whose dense weights fit in ``budget_bytes``."""
    fixed, layers, _ = layer_bytes(cfg, dtype)
    used, depth = fixed, 0
    for b in layers:
        if used + b > budget_bytes:
            break
        used += b
        depth += 1
    return depth


def _init(module: nn.Module, std: float, gen: torch.Generator) -> None:
    with torch.no_grad():
        for mod in module.modules():
            is_norm = "norm" in type(mod).__name__.lower()
            for pname, p in mod.named_parameters(recurse=False):
                if is_norm and pname == "weight":
                    p.fill_(1.0)
                elif p.dim() >= 2:
                    p.normal_(0.0, std, generator=gen)
                else:
                    p.zero_()


def _rebuild_rotary(model: nn.Module, cfg: Any, device: str) -> None:
    """Rotary embeddings hold computed (not loaded) buffers: build them anew on the device."""
    for name, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], type(mod)(config=cfg).to(device))


def materialize(model: nn.Module, device: str, *, seed: int = 0,
                on_layer: Optional[Callable[[int, nn.Module], None]] = None) -> nn.Module:
    """Allocates a meta ``model`` on ``device`` with random weights, one decoder layer
    at a time; ``on_layer(i, layer)`` runs right after layer ``i`` exists (e.g. to
    pack its experts before the next layer is allocated)."""
    cfg = model.config
    std = float(getattr(cfg, "initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = model.model.layers
    model.model.layers = nn.ModuleList()
    try:
        model.to_empty(device=device)
        _init(model, std, gen)
        _rebuild_rotary(model, cfg, device)
    finally:
        model.model.layers = layers
    for i, layer in enumerate(layers):
        layer.to_empty(device=device)
        _init(layer, std, gen)
        if on_layer is not None:
            on_layer(i, layer)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"materialize: still on the meta device: {left[:5]}")
    return model


def build(name: str, device: str, dtype: torch.dtype, *, tiny: bool = False, layers: Optional[int] = None,
          seed: int = 0, on_layer: Optional[Callable[[int, nn.Module], None]] = None, **overrides: Any) -> nn.Module:
    """``name``'s causal LM with ``layers`` decoder layers on ``device`` (see materialize)."""
    cfg = config(name, tiny=tiny, layers=layers, **overrides)
    return materialize(meta_model(cfg, dtype), device, seed=seed, on_layer=on_layer)


def set_experts(model: nn.Module, impl: str) -> None:
    """Selects transformers' experts implementation of a dense model (e.g. "grouped_mm")."""
    model.set_experts_implementation(impl)


def moe_blocks(model: nn.Module) -> List[nn.Module]:
    """The MoE blocks: modules that hold an ``experts`` module (the experts themselves excluded)."""
    return [m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]


def zero_moe_forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward of a MoE block that costs nothing (the benchmarks' no_moe bound): zeros,
    one memset; router, experts, shared experts (and under EP their all-reduce) skipped."""
    return torch.zeros_like(hidden_states)
