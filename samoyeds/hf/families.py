"""Small random Hugging Face MoE causal LMs, one per supported model family.

Used by the demo CLI and the tests: a config of the family's real architecture
at a chosen size, built with random (seeded) weights, nothing downloaded.  The
shape arguments are the same for every family; each builder maps them onto its
config's field names (``num_local_experts`` / ``num_experts`` /
``n_routed_experts``, ``intermediate_size`` / ``moe_intermediate_size``, ...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

__all__ = ["FAMILIES", "Shape", "build_model", "make_config"]


@dataclass(frozen=True)
class Shape:
    """Model size.  ``intermediate`` is the per-expert I (gate_up ``[E, 2I, H]``)."""

    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    intermediate: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    max_positions: int = 256
    init_std: float = 0.02


def _common(s: Shape) -> Dict[str, Any]:
    return dict(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                max_position_embeddings=s.max_positions, initializer_range=s.init_std,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _mixtral(s: Shape) -> Dict[str, Any]:
    return dict(_common(s), head_dim=s.head_dim, intermediate_size=s.intermediate,
                num_local_experts=s.experts, num_experts_per_tok=s.top_k)


def _qwen2_moe(s: Shape) -> Dict[str, Any]:
    return dict(_common(s), intermediate_size=2 * s.intermediate, moe_intermediate_size=s.intermediate,
                shared_expert_intermediate_size=2 * s.intermediate, num_experts=s.experts,
                num_experts_per_tok=s.top_k)


def _qwen3_moe(s: Shape) -> Dict[str, Any]:
    return dict(_common(s), head_dim=s.head_dim, intermediate_size=2 * s.intermediate,
                moe_intermediate_size=s.intermediate, num_experts=s.experts, num_experts_per_tok=s.top_k)


def _olmoe(s: Shape) -> Dict[str, Any]:
    return dict(_common(s), intermediate_size=s.intermediate, num_experts=s.experts,
                num_experts_per_tok=s.top_k)


def _deepseek(s: Shape) -> Dict[str, Any]:
    # first_k_dense_replace=1: layer 0 keeps a dense MLP, as in the real models.  Multi-head
    # latent attention has one key/value head per query head (fewer breaks masked sdpa in
    # transformers 5.24: its repeat_kv groups them again).
    return dict(_common(s), num_key_value_heads=s.heads, intermediate_size=2 * s.intermediate,
                moe_intermediate_size=s.intermediate,
                n_routed_experts=s.experts, num_experts_per_tok=s.top_k, n_shared_experts=1,
                kv_lora_rank=2 * s.head_dim, q_lora_rank=None, qk_rope_head_dim=s.head_dim // 2,
                qk_nope_head_dim=s.head_dim // 2, v_head_dim=s.head_dim,
                first_k_dense_replace=1 if s.layers > 1 else 0, n_group=1, topk_group=1)


def _gpt_oss(s: Shape) -> Dict[str, Any]:
    # The default YaRN RoPE assumes 4096 original positions; a small model uses plain RoPE.
    return dict(_common(s), head_dim=s.head_dim, intermediate_size=s.intermediate,
                num_local_experts=s.experts, num_experts_per_tok=s.top_k, sliding_window=16,
                rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


def _phimoe(s: Shape) -> Dict[str, Any]:
    return dict(_common(s), intermediate_size=s.intermediate, num_local_experts=s.experts,
                num_experts_per_tok=s.top_k)


def _granitemoe(s: Shape) -> Dict[str, Any]:
    return dict(_common(s), intermediate_size=s.intermediate, num_local_experts=s.experts,
                num_experts_per_tok=s.top_k)


def _llama4(s: Shape) -> Dict[str, Any]:
    return dict(_common(s), head_dim=s.head_dim, intermediate_size=s.intermediate,
                intermediate_size_mlp=2 * s.intermediate, num_local_experts=s.experts,
                num_experts_per_tok=s.top_k)


@dataclass(frozen=True)
class Family:
    """A model family: its transformers config and causal-LM classes and its field mapping."""

    config_class: str
    model_class: str
    fields: Callable[[Shape], Dict[str, Any]]


#: Supported families by short name (the ``model_type`` of their configs).
FAMILIES: Dict[str, Family] = {
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", _mixtral),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", _qwen2_moe),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _qwen3_moe),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", _olmoe),
    "deepseek_v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM", _deepseek),
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", _deepseek),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM", _gpt_oss),
    "phimoe": Family("PhimoeConfig", "PhimoeForCausalLM", _phimoe),
    "granitemoe": Family("GraniteMoeConfig", "GraniteMoeForCausalLM", _granitemoe),
    "llama4": Family("Llama4TextConfig", "Llama4ForCausalLM", _llama4),
}


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def make_config(family: str, shape: Shape = Shape(), **overrides: Any) -> Any:
    """The transformers config of ``family`` at ``shape`` (``overrides`` set config fields)."""
    import transformers

    fam = _family(family)
    fields = fam.fields(shape)
    fields.update(overrides)
    return getattr(transformers, fam.config_class)(**fields)


def build_model(family: str, shape: Shape = Shape(), *, seed: int = 0, dtype: Any = None,
                device: Any = None, **overrides: Any) -> Any:
    """A random ``family`` causal LM at ``shape`` in eval mode (weights from ``seed``).

    ``dtype`` (a torch dtype, default float32) and ``device`` place the model.
    """
    import torch
    import transformers

    fam = _family(family)
    cfg = make_config(family, shape, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, fam.model_class)(cfg).eval()
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model
