"""Routers: one fused op.

The router of every patched block whose rule samoyeds knows (Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V2 greedy and group-limited greedy, DeepSeek-V3, GPT-OSS) gets a subclass of its
own class (``SamoyedsRouter<...>``), kept only where it gives the router's own outputs on a
probe of random tokens at patch time.  For inference on the GPU its forward is one
:func:`samoyeds.router` call (one or two launches: logits on tensor cores, softmax, group
limit, top-k and renormalisation by a segment of lanes per token) in place of the model's
GEMM (DeepSeek-V2's in fp32 after casting the hidden states), softmax, top-k and
elementwise launches; with autograd, under ``torch.compile``, on the CPU, or for tensors the
kernel does not take, the module's own forward.  ``patch_model(..., router=False)`` leaves
every router as it is.  The returned ``router_logits`` are the module's (same dtype); equal
scores pick the lower expert id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from torch import nn

from ..ops import router as router_op
from .experts import SUPPORTED_DTYPES, Target, blocks
from .swap import swapped_class

ROUTER_PREFIX = "SamoyedsRouter<"
ROUTER_NAMES = ("gate", "router")
SPEC_ATTR = "_samoyeds_router_spec"   # on a patched router: its RouterSpec


@dataclass(frozen=True)
class RouterSpec:
    """What a router computes, in :func:`samoyeds.router`'s terms."""
    k: int
    mode: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    renorm: bool = False
    scale: float = 1.0
    logits_fp32: bool = False   # logits in float32 (else in the hidden states' dtype)
    weights_fp32: bool = True   # routing weights in float32 (else in the logits' dtype)
    bias: bool = False          # the module's ``bias`` added to the logits
    choice_bias: bool = False   # the module's ``e_score_correction_bias`` (sigmoid_topk)


def router_spec(mod: nn.Module) -> Optional[RouterSpec]:
    """The rule of a router module samoyeds knows, from its class and attributes, else None
    (what it claims is checked against the module's own forward before it is used)."""
    w = getattr(mod, "weight", None)
    k = getattr(mod, "top_k", None)
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or not isinstance(k, int):
        return None
    name = type(mod).__name__
    if name == "DeepseekV2TopkRouter":
        method = getattr(mod, "topk_method", None)
        if method == "greedy":
            groups = (1, 1)
        elif method == "group_limited_greedy":
            groups = (int(mod.num_group), int(mod.topk_group))
        else:
            return None
        return RouterSpec(k, n_group=groups[0], topk_group=groups[1], scale=float(mod.routed_scaling_factor),
                          logits_fp32=True)
    if name == "DeepseekV3TopkRouter":
        cb = getattr(mod, "e_score_correction_bias", None)
        if not isinstance(cb, torch.Tensor):
            return None
        return RouterSpec(k, mode="sigmoid_topk", n_group=int(mod.num_group), topk_group=int(mod.topk_group),
                          renorm=bool(mod.norm_topk_prob), scale=float(mod.routed_scaling_factor), logits_fp32=True,
                          choice_bias=True)
    if name == "MixtralTopKRouter":
        return RouterSpec(k, renorm=True)
    if name in ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter"):
        return RouterSpec(k, renorm=bool(getattr(mod, "norm_topk_prob", False)), weights_fp32=False)
    if name == "GptOssTopKRouter":
        return RouterSpec(k, mode="topk_softmax", weights_fp32=False, bias=getattr(mod, "bias", None) is not None)
    return None


def router_run(mod: nn.Module, spec: RouterSpec, x: torch.Tensor) -> tuple:
    """``mod``'s outputs (logits, weights, ids) on ``x [T, H]`` by :func:`samoyeds.router`."""
    ld = "float32" if spec.logits_fp32 else str(x.dtype).replace("torch.", "")
    return router_op(x, mod.weight, spec.k, bias=mod.bias if spec.bias else None, mode=spec.mode,
                     n_group=spec.n_group, topk_group=spec.topk_group, renorm=spec.renorm, scale=spec.scale,
                     choice_bias=mod.e_score_correction_bias if spec.choice_bias else None,
                     logits_dtype=ld, weights_dtype="float32" if spec.weights_fp32 else ld)


def _router_fast(mod: nn.Module, hidden_states: torch.Tensor) -> Optional[tuple]:
    """The router's outputs by samoyeds.router, or None where its own forward runs."""
    spec = getattr(mod, SPEC_ATTR, None)
    w = getattr(mod, "weight", None)
    if (spec is None or not hidden_states.is_cuda or not isinstance(w, torch.Tensor)
            or hidden_states.dtype not in (torch.bfloat16, torch.float16) or w.dtype != hidden_states.dtype
            or w.device != hidden_states.device or torch.compiler.is_compiling()):
        return None
    b = getattr(mod, "bias", None) if spec.bias else None
    if torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad
                                    or (b is not None and b.requires_grad)):
        return None
    H = w.shape[1]
    if hidden_states.shape[-1] != H or H % 8 or not w.is_contiguous() or w.data_ptr() % 16:
        return None
    x = hidden_states.reshape(-1, H)
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) % 8) or x.data_ptr() % 16:
        return None
    cb = getattr(mod, "e_score_correction_bias", None) if spec.choice_bias else None
    for t in (b, cb):
        if t is not None and (t.dtype not in (torch.float32, x.dtype) or t.device != x.device
                              or not t.is_contiguous()):
            return None
    return router_run(mod, spec, x)


def _router_forward(self: nn.Module, hidden_states: torch.Tensor) -> Any:
    out = _router_fast(self, hidden_states)
    return out if out is not None else type(self)._samoyeds_base.forward(self, hidden_states)


def router_class(base: type) -> type:
    return swapped_class(ROUTER_PREFIX, base, {"forward": _router_forward, "_samoyeds_router": True},
                         "whose forward runs samoyeds.router for inference on the GPU.",
                         instance_attrs=(SPEC_ATTR,))


def _router_agrees(mod: nn.Module, spec: RouterSpec) -> bool:
    """Whether samoyeds.router with ``spec`` gives ``mod``'s own outputs on 37 random tokens
    (on the module's device: the kernel on the GPU, the C reference on the CPU)."""
    w = mod.weight
    if w.device.type == "meta" or w.dtype not in SUPPORTED_DTYPES:
        return False
    H = w.shape[1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, H, generator=g).to(device=w.device, dtype=w.dtype)
    try:
        with torch.no_grad():
            ref = type(mod).forward(mod, x)
            got = router_run(mod, spec, x)
    except (ValueError, TypeError, RuntimeError):
        return False
    if not isinstance(ref, tuple) or len(ref) != 3:
        return False
    for a, b in zip(got, ref):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
    rl, gl = ref[0].float(), got[0].float()
    tol = 1e-2 * rl.abs() + 1e-3 * float(rl.abs().max()) + 1e-6
    if not bool(((gl - rl).abs() <= tol).all()):
        return False
    # the same choice up to equal scores: the reference's logits at either set of ids
    pick_ref = rl.gather(1, ref[2]).sort(dim=1).values
    pick_got = rl.gather(1, got[2]).sort(dim=1).values
    if not bool(((pick_got - pick_ref).abs() <= 1e-2 * pick_ref.abs() + 1e-3 * float(rl.abs().max()) + 1e-6).all()):
        return False
    wr, wg = ref[1].float().sort(dim=1).values, got[1].float().sort(dim=1).values
    return bool(((wg - wr).abs() <= 1e-2 * wr.abs() + 1e-5).all())


def patch_all(model: nn.Module, targets: List[Target]) -> None:
    """Gives every router of the blocks owning ``targets`` whose rule samoyeds knows, and
    whose outputs it reproduces, its SamoyedsRouter subclass (patch_model, from_pretrained)."""
    for _, block in blocks(model, targets):
        for attr in ROUTER_NAMES:
            mod = block._modules.get(attr)
            if mod is None or getattr(type(mod), "_samoyeds_router", False):
                continue
            spec = router_spec(mod)
            if spec is not None and _router_agrees(mod, spec):
                mod.__dict__[SPEC_ATTR] = spec
                mod.__class__ = router_class(type(mod))
