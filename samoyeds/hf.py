"""Hugging Face ``transformers`` integration: a model's MoE experts in the Samoyeds
format, patched in place.

``patch_model(model)`` packs the ``gate_up_proj``/``down_proj`` weights of every
experts module into the Samoyeds format, replaces the dense Parameters by buffers
holding the packed arrays (the dense tensors are released), and selects the
``"samoyeds"`` experts implementation, registered in transformers'
``ExpertsInterface``.  Each experts call then runs ``torch.ops.samoyeds.moe_forward``
(one opaque node for ``torch.compile``) on the module's buffers.

Buffers of a patched experts module (``E`` experts, hidden ``H``, expert width ``I``):

* ``samoyeds_gate_up_values/_meta/_idx``: the ``[E, 2I, H]`` gate_up weight packed
  with ``glu=True`` (gate rows, then up rows; ``_idx`` is None for plain 2:4);
* ``samoyeds_down_values/_meta/_idx``: the ``[E, H, I]`` down weight;
* ``samoyeds_gate_up_bias``: ``[E, 2I]`` (gate, then up) for models with expert biases,
  else None; ``down_proj_bias`` stays the model's Parameter.

Layouts.  Most families store ``gate_up_proj [E, 2I, H]`` with the gate rows first.
GPT-OSS stores it transposed, ``[E, H, 2I]``, with gate and up columns interleaved
(gate 0, up 0, gate 1, ...), and ``down_proj`` as ``[E, I, H]``: its weights and
biases are transposed and de-interleaved at pack time, and its clamped SwiGLU
runs with the module's ``alpha``/``limit``.  Llama 4 stores transposed weights
without interleaving.

Llama 4's experts are not dispatched through ``ExpertsInterface``: its
``Llama4TextMoe`` scales the expert *inputs* by the sigmoid router score and runs
every expert on every token.  Its patched block gathers the scaled rows
``x[t] * score[t, k]`` of the top-k experts (``[T*K, H]``), runs them as ``T*K``
tokens with one expert each and routing weight 1, and sums the ``K`` rows of each
token: the same result without the dense all-experts matmul.

Shared experts, unpruned (the default).  The always-on MLP that DeepSeek-V2/V3, Qwen2-MoE
and Llama 4 blocks run beside their routed experts (``shared_experts`` / ``shared_expert``:
``down_proj(silu(gate_proj(x)) * up_proj(x))`` with bias-free ``nn.Linear``) keeps its dense
weights, its parameters and its state-dict names; its class becomes a subclass of its own
(``SamoyedsDense<...>``) whose forward, for inference on the GPU at up to
``SAMOYEDS_DENSE_DECODE_MAX_ROWS`` tokens (default 16; 0 turns it off), runs two
:func:`samoyeds.dense_decode` launches (gate, up and SiLU in one; down in the other, its
weights requested while the first ends) instead of five, under ``torch.compile`` as the op
``torch.ops.samoyeds.shared_mlp``; above that limit, in eager inference on the GPU, cuBLAS's
three matmuls with SiLU-times-up as one :func:`samoyeds.glu` pass; otherwise (autograd, the
CPU, ``torch.compile`` above the limit) the module's own forward.
:func:`unpatch_model` gives the module its class back.

Routers.  The router of every patched block whose rule samoyeds knows (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V2 greedy and group-limited greedy, DeepSeek-V3, GPT-OSS) gets a subclass
of its own class too (``SamoyedsRouter<...>``), kept only where it gives the router's own
outputs on a probe of random tokens at patch time.  For inference on the GPU its forward is
one :func:`samoyeds.router` call (one or two launches: logits on tensor cores, softmax,
group limit, top-k and renormalisation by a segment of lanes per token) in place of the model's GEMM
(DeepSeek-V2's in fp32 after casting the hidden states), softmax, top-k and elementwise
launches; with autograd, under ``torch.compile``, on the CPU, for tensors the kernel does
not take, or with ``SAMOYEDS_ROUTER=0``, the module's own forward.  The returned
``router_logits`` are the module's (same dtype); equal scores pick the lower expert id.

Shared experts, packed (opt-in, ``patch_model(..., shared_experts=True)``).  The always-on MLP that
DeepSeek-V2/V3, Qwen2-MoE and Llama 4 blocks run beside their routed experts
(``shared_experts`` / ``shared_expert``: ``down_proj(silu(gate_proj(x)) * up_proj(x))``
with bias-free ``nn.Linear``) is replaced by a :class:`SamoyedsMLP` holding it in the
same format: one expert that every token is routed to with weight 1, run by the same op
(SwiGLU fused).  It changes the model more than packing the routed experts does (every
token passes through it), so it is off by default.

The op is inference only: a backward through a patched model raises.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Union

import torch
from torch import nn

from . import torch_ops
from .format import SparseFormat
from .ops import router as _router_op, ssmm as _ssmm
from .packed import PackedDims, PackedWeight, mask as _magnitude_mask, pack, unpack

__all__ = [
    "IMPLEMENTATION", "SamoyedsMLP", "UnsupportedModelError", "experts_forward", "experts_weight_nbytes",
    "is_patched", "patch_model", "register", "to_dense", "unpatch_model",
]

#: The name registered in transformers' ExpertsInterface.
IMPLEMENTATION = "samoyeds"

#: A mask function for :func:`patch_model`: ``(experts module name, "gate_up_proj" or
#: "down_proj", weight [E, R, C] in packing layout, format) -> bool mask [E, R, C]``.
MaskFn = Callable[[str, str, torch.Tensor, SparseFormat], torch.Tensor]

_PROJS = ("gate_up", "down")
_ARRAYS = ("values", "meta", "idx")
_PREVIOUS_ATTR = "_samoyeds_previous_experts_implementation"
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class UnsupportedModelError(ValueError):
    """The model (or one of its experts modules) has a layout samoyeds cannot run."""


@dataclass(frozen=True)
class ExpertsPatch:
    """What :func:`patch_model` did to one experts module (kept as ``module._samoyeds``).

    ``transposed``: the model stores ``[E, in, out]`` (``x @ W``) rather than
    ``[E, out, in]``; ``interleaved``: gate and up outputs alternate in gate_up.
    """

    fmt: SparseFormat
    num_experts: int
    hidden: int
    intermediate: int
    act: str
    alpha: float
    limit: float
    transposed: bool
    interleaved: bool
    bias: bool
    requires_grad: bool
    previous_implementation: Optional[str] = None

    @property
    def act_id(self) -> int:
        return torch_ops.act_id(self.act)

    @property
    def n(self) -> int:
        return self.fmt.c_args()[0]

    @property
    def m(self) -> int:
        return self.fmt.c_args()[1]

    @property
    def v(self) -> int:
        return self.fmt.c_args()[2]


@dataclass
class _Target:
    name: str                       # experts module name in model.named_modules()
    experts: nn.Module
    block: Optional[nn.Module]      # Llama4TextMoe owning the experts, else None
    layout: Optional[ExpertsPatch] = None


# --- registration -------------------------------------------------------------------------------

def register() -> None:
    """Registers ``"samoyeds"`` in ``transformers.integrations.moe.ExpertsInterface``.

    Call it before ``from_pretrained(..., experts_implementation="samoyeds")``
    (transformers validates the name when a model is built).  Idempotent;
    :func:`patch_model` calls it.
    """
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"samoyeds"`` experts implementation (transformers' ExpertsInterface contract).

    Args:
        self: a patched experts module.
        hidden_states: ``[T, H]`` (fp32/bf16/fp16 on the CPU; bf16/fp16 on CUDA).
        top_k_index: ``[T, K]`` int64 expert ids; ids ``>= E`` (expert-parallel
            placeholders) contribute nothing.
        top_k_weights: ``[T, K]`` routing weights (fp32 or the model's dtype).
    Returns:
        ``[T, H]`` in hidden_states' dtype.
    """
    if getattr(self, "_samoyeds", None) is None:
        raise RuntimeError(
            f"{type(self).__name__} runs experts_implementation={IMPLEMENTATION!r} but holds dense weights; "
            "call samoyeds.patch_model(model) to pack them first")
    return _run_experts(self, hidden_states, top_k_index, top_k_weights)


def _moe_op(x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The MoE forward to call on ``x``: eager inference skips the dispatcher (host time
    per call is what decode pays); compiled graphs and anything that may need a backward
    go through the op."""
    direct = not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad)
    return torch_ops.moe_forward_eager if direct else torch.ops.samoyeds.moe_forward


def _run_experts(mod: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
    p = mod._samoyeds
    H, I = p.hidden, p.intermediate
    down_bias = mod.down_proj_bias if p.bias else None
    return _moe_op(x)(
        x, top_k_index, top_k_weights,
        mod.samoyeds_gate_up_values, mod.samoyeds_gate_up_meta, mod.samoyeds_gate_up_idx, 2 * I, H,
        mod.samoyeds_down_values, mod.samoyeds_down_meta, mod.samoyeds_down_idx, H, I,
        p.n, p.m, p.v, p.act_id, mod.samoyeds_gate_up_bias, down_bias, p.alpha, p.limit)


# --- Llama 4 --------------------------------------------------------------------------------------

_LLAMA4_CLASSES: Dict[type, type] = {}


def _llama4_moe_class() -> Optional[type]:
    try:
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    except ImportError:
        return None
    return Llama4TextMoe


def _llama4_forward(self: nn.Module, hidden_states: torch.Tensor):
    """Llama4TextMoe.forward with the routed experts in the Samoyeds format.

    The router's dense ``[T, E]`` scores are sigmoid(top-k logit) on the chosen
    experts and 0 elsewhere; every expert input is scaled by its score.  Here
    the ``T*K`` scaled rows of the chosen experts run as single-expert tokens
    with weight 1 and each token's ``K`` outputs are summed.
    """
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    marked = _block_start(self, hidden_states)   # the shared expert beside the routed ones
    try:
        router_scores, router_logits = self.router(hidden_states)
        top_k_index = torch.topk(router_logits, self.router.top_k, dim=1).indices   # the router's own choice
        scores = router_scores.gather(1, top_k_index)                                 # [T, K]
        T, K = top_k_index.shape
        routed_in = (hidden_states[:, None, :] * scores[:, :, None]).reshape(T * K, self.hidden_dim)
        ones = torch.ones(T * K, 1, dtype=torch.float32, device=hidden_states.device)
        routed_out = _run_experts(self.experts, routed_in, top_k_index.reshape(T * K, 1), ones)
        out = self.shared_expert(hidden_states)
    finally:
        _block_end(marked)
    out.add_(routed_out.view(T, K, -1).sum(dim=1))
    return out, router_logits


def _patched_llama4_class(base: type) -> type:
    cls = _LLAMA4_CLASSES.get(base)
    if cls is None:
        cls = type(f"Samoyeds{base.__name__}", (base,), {
            "forward": _llama4_forward, "__module__": __name__, "_samoyeds_base": base,
            "__doc__": f"{base.__name__} whose routed experts run in the Samoyeds format."})
        _LLAMA4_CLASSES[base] = cls
    return cls


def __getattr__(name: str) -> Any:
    # Pickled patched Llama 4 blocks and unpruned shared MLPs refer to their class by this
    # module's attribute.
    if name == "SamoyedsLlama4TextMoe":
        base = _llama4_moe_class()
        if base is not None:
            return _patched_llama4_class(base)
    for prefix, make in ((_DENSE_PREFIX, _dense_shared_class), (_ROUTER_PREFIX, _router_class),
                         (_BLOCK_PREFIX, _block_class)):
        if name.startswith(prefix) and name.endswith(">"):
            base = _class_by_name(name, prefix)
            if base is not None:
                return make(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- finding and checking experts modules ---------------------------------------------------------

def _is_decorated(mod: nn.Module) -> bool:
    """True for an experts module built by transformers' @use_experts_implementation."""
    return (hasattr(type(mod).forward, "__wrapped__")
            and all(hasattr(mod, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated")))


def _find_experts(model: nn.Module) -> List[_Target]:
    llama4 = _llama4_moe_class()
    targets: List[_Target] = []
    claimed = set()
    for name, mod in model.named_modules():
        if llama4 is not None and isinstance(mod, llama4):
            targets.append(_Target(f"{name}.experts" if name else "experts", mod.experts, mod))
            claimed.add(id(mod.experts))
        elif _is_decorated(mod):
            targets.append(_Target(name, mod, None))
            claimed.add(id(mod))
    for name, mod in model.named_modules():
        if id(mod) in claimed:
            continue
        w = mod._parameters.get("gate_up_proj")
        if w is not None and w.dim() == 3:
            raise UnsupportedModelError(
                f"{type(model).__name__}: experts module {name!r} ({type(mod).__name__}) is not supported: "
                "it is not dispatched through transformers' ExpertsInterface (@use_experts_implementation) "
                "and samoyeds has no patch for its MoE block")
    return targets


def _is_silu(fn: Any) -> bool:
    if isinstance(fn, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return isinstance(fn, SiLUActivation)


def _layout(t: _Target, model: nn.Module, fmt: SparseFormat, allow_meta: bool = False) -> ExpertsPatch:
    """The layout of one experts module; ``allow_meta``: its weights may be on the meta
    device (a model built without storage, whose packed weights come from a file)."""
    mod = t.experts

    def fail(reason: str) -> None:
        raise UnsupportedModelError(f"{type(model).__name__}: experts module {t.name!r} ({type(mod).__name__}) "
                                    f"is not supported: {reason}")

    alpha, limit = 1.702, 7.0
    if t.block is not None:
        transposed, interleaved, bias, act = True, False, False, "swiglu"
        if not _is_silu(getattr(mod, "act_fn", None)):
            fail(f"its activation {type(getattr(mod, 'act_fn', None)).__name__} is not SiLU; the fused gate is SwiGLU")
    else:
        if not mod.has_gate:
            fail("it has no gate (up_proj only); samoyeds fuses a gated activation (SwiGLU or GPT-OSS's) "
                 "into the gate_up matmul")
        if getattr(mod, "has_post_expert_norm", False):
            fail("it applies a norm after each expert (has_post_expert_norm), which samoyeds does not fuse")
        from transformers.integrations.moe import _default_apply_gate

        gate_fn = getattr(type(mod), "_apply_gate", None)
        if gate_fn is _default_apply_gate:
            act = "swiglu"
            if not _is_silu(getattr(mod, "act_fn", None)):
                fail(f"its activation {type(getattr(mod, 'act_fn', None)).__name__} is not SiLU; samoyeds fuses "
                     "SwiGLU (silu(gate) * up)")
        elif getattr(gate_fn, "__qualname__", "") == "GptOssExperts._apply_gate":
            act, alpha, limit = "gptoss", float(mod.alpha), float(mod.limit)
        else:
            fail(f"its gate function {getattr(gate_fn, '__qualname__', gate_fn)!r} is neither SwiGLU nor "
                 "GPT-OSS's clamped SwiGLU")
        transposed, interleaved, bias = bool(mod.is_transposed), not mod.is_concatenated, bool(mod.has_bias)

    gu, dn = mod._parameters.get("gate_up_proj"), mod._parameters.get("down_proj")
    if gu is None or dn is None:
        fail("expected Parameters gate_up_proj and down_proj")
    if gu.dim() != 3 or dn.dim() != 3:
        fail(f"expected 3-d gate_up_proj and down_proj, got shapes {tuple(gu.shape)} and {tuple(dn.shape)}")
    for w in (gu, dn):
        if w.dtype not in _SUPPORTED_DTYPES:
            fail(f"its expert weights are {w.dtype}; samoyeds packs float32, bfloat16 and float16")
        if w.device.type == "meta" and not allow_meta:
            fail("its expert weights are on the meta device (not loaded)")
    E = gu.shape[0]
    H, I2 = (gu.shape[1], gu.shape[2]) if transposed else (gu.shape[2], gu.shape[1])
    I = I2 // 2
    want_down = (E, I, H) if transposed else (E, H, I)
    if I2 % 2 or tuple(dn.shape) != want_down:
        fail(f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)} do not form a gated MLP "
             f"(expected down_proj {want_down})")
    try:
        PackedDims.of(fmt, E, 2 * I, H, True)
        PackedDims.of(fmt, E, H, I, False)
    except ValueError as e:
        fail(f"format {fmt.name} does not fit hidden size {H} and expert width {I}: {e}")
    if bias:
        gb, db = mod._parameters.get("gate_up_proj_bias"), mod._parameters.get("down_proj_bias")
        if gb is None or db is None or tuple(gb.shape) != (E, 2 * I) or tuple(db.shape) != (E, H):
            fail(f"expected biases gate_up_proj_bias [{E}, {2 * I}] and down_proj_bias [{E}, {H}]")
    previous = getattr(getattr(mod, "config", None), "_experts_implementation", None)
    return ExpertsPatch(fmt, E, H, I, act, alpha, limit, transposed, interleaved, bias,
                        bool(gu.requires_grad), None if previous == IMPLEMENTATION else previous)


# --- layout transforms between the model's Parameters and the packing layout --------------------

def _split_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved (gate 0, up 0, gate 1, ...) along dim -> all gates, then all ups."""
    idx = torch.arange(t.shape[dim], device=t.device)
    return torch.cat([t.index_select(dim, idx[0::2]), t.index_select(dim, idx[1::2])], dim=dim)


def _merge_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`_split_gate_up`."""
    half = t.shape[dim] // 2
    gate, up = t.narrow(dim, 0, half), t.narrow(dim, half, half)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _to_pack(w: torch.Tensor, p: ExpertsPatch, proj: str) -> torch.Tensor:
    """A model Parameter (or a mask shaped like it) -> ``[E, R, C]`` with R the output rows."""
    w = w.detach()
    if p.transposed:
        w = w.transpose(1, 2)
    if proj == "gate_up" and p.interleaved:
        w = _split_gate_up(w, 1)
    return w.contiguous()


def _from_pack(w: torch.Tensor, p: ExpertsPatch, proj: str) -> torch.Tensor:
    if proj == "gate_up" and p.interleaved:
        w = _merge_gate_up(w, 1)
    if p.transposed:
        w = w.transpose(1, 2)
    return w.contiguous()


# --- shared experts -------------------------------------------------------------------------------

_SHARED_NAMES = ("shared_experts", "shared_expert")
_MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


class SamoyedsMLP(nn.Module):
    """A block's shared-experts MLP (``down(silu(gate(x)) * up(x))``) in the Samoyeds
    format: one expert that every token is routed to with weight 1, run by
    ``torch.ops.samoyeds.moe_forward`` with the SwiGLU fused (eager inference on the GPU
    skips the routing: two ``ssmm`` calls on x's rows as they lie).  Made by
    :func:`patch_model` (``shared_experts=True``); :func:`unpatch_model` puts the
    original module back with its (masked) dense weights.

    Buffers: ``samoyeds_gate_up_values/_meta/_idx`` (``[1, 2I, H]``, gate rows then up
    rows, packed with ``glu=True``) and ``samoyeds_down_values/_meta/_idx`` (``[1, H, I]``).
    """

    def __init__(self, fmt: SparseFormat, hidden: int, intermediate: int, gate_up: PackedWeight,
                 down: PackedWeight, original: nn.Module):
        super().__init__()
        self.fmt, self.hidden, self.intermediate = fmt, hidden, intermediate
        for proj, pw in (("gate_up", gate_up), ("down", down)):
            for a in _ARRAYS:
                self.register_buffer(f"samoyeds_{proj}_{a}", getattr(pw, a))
        # the module it replaces, without its weights (not a submodule: no state, no parameters)
        self.__dict__["_original"] = original

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, intermediate={self.intermediate}, fmt={self.fmt.name}"

    def _packed(self, proj: str) -> PackedWeight:
        """The buffers of ``proj`` as a PackedWeight, made again only when they were replaced
        (``.to()``, ``load_state_dict``)."""
        arrays = tuple(getattr(self, f"samoyeds_{proj}_{a}") for a in _ARRAYS)
        cache = self.__dict__.setdefault("_packed_cache", {})
        got = cache.get(proj)
        if got is None or any(a is not b for a, b in zip(got[0], arrays)):
            shape = (1, 2 * self.intermediate, self.hidden) if proj == "gate_up" else (1, self.hidden, self.intermediate)
            got = cache[proj] = (arrays, PackedWeight(*arrays, self.fmt, shape, glu=proj == "gate_up"))
        return got[1]

    def _offsets(self, T: int, device: torch.device) -> torch.Tensor:
        """``[0, T]`` as int32 on ``device``, made there (no copy from the host) and kept per T
        and stream (a call on another stream never reads it before it is written); while a
        CUDA graph is being captured, made afresh and not kept (a tensor made in a capture
        holds its values only once the graph has run)."""
        if torch.cuda.is_current_stream_capturing():
            return torch.arange(2, dtype=torch.int32, device=device) * T
        cache = self.__dict__.setdefault("_offsets_cache", {})
        key = (device, T, torch.cuda.current_stream(device).cuda_stream)
        got = cache.get(key)
        if got is None:
            if len(cache) >= 64:
                cache.clear()
            got = cache[key] = torch.arange(2, dtype=torch.int32, device=device) * T
        return got

    def _eager(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Eager inference on the GPU: two matmuls on x's rows as they lie (no routing, no
        combine; on Hopper the rows come by TMA), the SwiGLU fused into the first; else None."""
        x2 = x.reshape(-1, self.hidden)
        if not (x2.is_cuda and _moe_op(x2) is torch_ops.moe_forward_eager):
            return None
        x2 = x2.contiguous()
        offsets = self._offsets(x2.shape[0], x2.device)
        y = _ssmm(x2, self._packed("gate_up"), offsets, None, act="swiglu", check=False)
        return _ssmm(y, self._packed("down"), offsets, None, check=False).reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _shared_on_side(self, x)
        if y is None:
            y = self._eager(x)
        if y is not None:
            return y
        shape = x.shape
        x2 = x.reshape(-1, self.hidden)
        T, H, I = x2.shape[0], self.hidden, self.intermediate
        # compiled graphs, autograd and the CPU: the op, one expert that every token is routed to
        index = torch.zeros((T, 1), dtype=torch.int64, device=x2.device)
        weight = torch.ones((T, 1), dtype=torch.float32, device=x2.device)
        n, m, v = self.fmt.c_args()
        y = _moe_op(x2)(x2, index, weight,
                        self.samoyeds_gate_up_values, self.samoyeds_gate_up_meta, self.samoyeds_gate_up_idx, 2 * I, H,
                        self.samoyeds_down_values, self.samoyeds_down_meta, self.samoyeds_down_idx, H, I,
                        n, m, v, torch_ops.act_id("swiglu"))
        return y.reshape(shape)


@dataclass
class _SharedTarget:
    name: str               # the shared MLP's name in model.named_modules()
    parent: nn.Module       # the MoE block holding it
    attr: str               # its attribute name there
    mlp: nn.Module


def _blocks(model: nn.Module, targets: List[_Target]) -> Iterable[tuple]:
    """(name, module) of each MoE block owning ``targets``' experts, once each."""
    seen = set()
    for t in targets:
        bname = t.name.rsplit(".", 1)[0] if "." in t.name else ""
        block = t.block if t.block is not None else (model.get_submodule(bname) if bname else model)
        if id(block) not in seen:
            seen.add(id(block))
            yield bname, block


def _find_shared(model: nn.Module, targets: List[_Target]) -> List[_SharedTarget]:
    """The shared-experts modules of the MoE blocks that own ``targets``' experts."""
    found: List[_SharedTarget] = []
    for bname, block in _blocks(model, targets):
        for attr in _SHARED_NAMES:
            mod = block._modules.get(attr)
            if mod is not None:
                found.append(_SharedTarget(f"{bname}.{attr}" if bname else attr, block, attr, mod))
    return found


def _shared_dims(st: _SharedTarget, model: nn.Module, fmt: SparseFormat) -> tuple:
    """(H, I) of a shared MLP samoyeds can pack, else UnsupportedModelError."""
    mod = st.mlp

    def fail(reason: str) -> None:
        raise UnsupportedModelError(f"{type(model).__name__}: shared experts {st.name!r} ({type(mod).__name__}) "
                                    f"are not supported: {reason}")

    if isinstance(mod, SamoyedsMLP):
        fail("they are packed already")
    lin = [mod._modules.get(k) for k in _MLP_PROJS]
    if not all(isinstance(m, nn.Linear) for m in lin):
        fail("expected nn.Linear gate_proj, up_proj and down_proj")
    if any(m.bias is not None for m in lin):
        fail("their projections have biases; samoyeds packs bias-free shared experts")
    act = getattr(mod, "act_fn", getattr(mod, "activation_fn", None))  # (Llama 4: activation_fn)
    if not _is_silu(act):
        fail(f"their activation {type(act).__name__} is not SiLU; the fused gate is SwiGLU")
    gate, up, down = (m.weight for m in lin)
    I, H = gate.shape
    if tuple(up.shape) != (I, H) or tuple(down.shape) != (H, I):
        fail(f"gate_proj {tuple(gate.shape)}, up_proj {tuple(up.shape)} and down_proj {tuple(down.shape)} "
             "do not form a gated MLP")
    for w in (gate, up, down):
        if w.dtype not in _SUPPORTED_DTYPES:
            fail(f"their weights are {w.dtype}; samoyeds packs float32, bfloat16 and float16")
        if w.device.type == "meta":
            fail("their weights are on the meta device (not loaded)")
    try:
        PackedDims.of(fmt, 1, 2 * I, H, True)
        PackedDims.of(fmt, 1, H, I, False)
    except ValueError as e:
        fail(f"format {fmt.name} does not fit hidden size {H} and width {I}: {e}")
    return H, I


# --- unpruned shared experts: the dense decode path --------------------------------------------

_DENSE_SHARED_CLASSES: Dict[type, type] = {}
_DENSE_PREFIX = "SamoyedsDense<"


def _env_int(name: str, default: int) -> int:
    import os

    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


def _dense_decode_max_rows() -> int:
    return _env_int("SAMOYEDS_DENSE_DECODE_MAX_ROWS", 16)


def _mlp_weights(mod: nn.Module) -> Optional[List[torch.Tensor]]:
    """The gate, up and down weights of an MLP of three bias-free ``nn.Linear``, else None."""
    lin = [mod._modules.get(k) for k in _MLP_PROJS]
    if not all(type(m) is nn.Linear and m.bias is None for m in lin):
        return None
    return [m.weight for m in lin]


def _dense_shared_fast(mod: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The shared MLP's output on the GPU in inference: up to the row limit two dense_decode
    launches (torch.ops.samoyeds.shared_mlp under torch.compile), above it cuBLAS's matmuls
    with SiLU and the product in one samoyeds.glu pass (under torch.compile: None, inductor
    fuses them itself); else None, where the module's own forward runs: off the GPU, with
    autograd, and for modules the kernels do not take (the op itself falls back to torch
    for weights it cannot read as they lie: dtype, device, alignment)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    ws = _mlp_weights(mod)  # (again per call: a projection may have been replaced since)
    if ws is None or (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws))):
        return None
    H = ws[0].shape[1]
    if x.shape[-1] != H:
        return None
    rows = _dense_decode_max_rows()
    small = x.numel() <= rows * H
    if torch.compiler.is_compiling():
        return torch.ops.samoyeds.shared_mlp(x, *ws) if small else None
    return torch_ops.shared_mlp_eager(x, *ws, decode_rows=rows)


def _dense_shared_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = _shared_on_side(self, x)
    if y is None:
        y = _dense_shared_fast(self, x)
    return y if y is not None else type(self)._samoyeds_base.forward(self, x)


def _swapped_class(cache: Dict[type, type], prefix: str, base: type, forward: Callable, flag: str,
                   doc: str) -> type:
    """The subclass of ``base`` with ``forward`` that a patched module's class becomes (one per
    base, kept in ``cache``); ``flag`` and ``_samoyeds_swapped`` are set on it, ``_samoyeds_base``
    names the base."""
    cls = cache.get(base)
    if cls is None:
        # the name says where the base class lives: pickles find the class through this
        # module's __getattr__ in a fresh process
        name = f"{prefix}{base.__module__.replace('.', ':')}:{base.__qualname__.replace('.', ':')}>"
        cls = type(name, (base,), {"forward": forward, "__module__": __name__, "__qualname__": name,
                                   "_samoyeds_base": base, "_samoyeds_swapped": True, flag: True,
                                   "__doc__": f"{base.__name__} {doc}"})
        cache[base] = cls
    return cls


def _dense_shared_class(base: type) -> type:
    return _swapped_class(_DENSE_SHARED_CLASSES, _DENSE_PREFIX, base, _dense_shared_forward,
                          "_samoyeds_dense_shared", "whose forward runs samoyeds.dense_decode at decode sizes "
                          "and samoyeds.glu above, on the GPU.")


def _class_by_name(name: str, prefix: str) -> Optional[type]:
    """The base class a ``SamoyedsDense<...>`` / ``SamoyedsRouter<...>`` / ``SamoyedsBlock<...>``
    name stands for, or None."""
    import importlib

    parts = name[len(prefix):-1].split(":")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj if isinstance(obj, type) else None
    return None


def _dense_shared_ok(mod: nn.Module) -> bool:
    """A gated SiLU MLP of bias-free nn.Linear projections, not patched yet."""
    if getattr(type(mod), "_samoyeds_dense_shared", False) or isinstance(mod, SamoyedsMLP):
        return False
    ws = _mlp_weights(mod)
    if ws is None:
        return False
    act = getattr(mod, "act_fn", getattr(mod, "activation_fn", None))
    g, u, d = ws
    return _is_silu(act) and g.shape == u.shape and tuple(d.shape) == (g.shape[1], g.shape[0])


def _dense_shared_patch_all(model: nn.Module, targets: List[_Target]) -> None:
    """Gives every unpruned shared MLP of the blocks owning ``targets`` that the dense decode
    path takes its SamoyedsDense subclass (patch_model, from_pretrained)."""
    for st in _find_shared(model, targets):
        if _dense_shared_ok(st.mlp):
            st.mlp.__class__ = _dense_shared_class(type(st.mlp))


# --- shared experts beside the routed ones: a second stream ---------------------------------------
#
# A block's shared MLP reads only the block's input, so on the GPU its kernels need not wait for
# the router, the routing and the routed experts, nor they for it.  A patched block whose shared
# MLP samoyeds runs (SamoyedsDense, SamoyedsMLP) becomes a SamoyedsBlock subclass: its forward
# marks the current stream where it starts, then runs the block's own forward; when that calls
# the shared MLP on the block's input (the same rows, unchanged), the MLP's kernels go to a
# second stream that waits only for the mark, and the current stream waits for them before it
# goes on.  Streams, events and marks are the calling thread's own.  The routed path's launches
# come first, so a block started on an idle GPU is not held behind the shared MLP; on a busy GPU
# the two overlap.  The kernels and rows are the same as on one stream (bit-identical).  Below
# SAMOYEDS_SHARED_STREAM_MIN_ROWS token rows (default 4096) everything stays on one stream: there
# a block's launches take the host about as long as its kernels take the GPU, and the ordering
# costs the host more than the overlap saves.

_BLOCK_CLASSES: Dict[type, type] = {}
_BLOCK_PREFIX = "SamoyedsBlock<"
_SIDE = threading.local()   # per thread: the second streams and events, and the marks of blocks running


def _marks() -> Dict[int, tuple]:
    """This thread's marks of blocks whose forward is running: {id(shared MLP): mark}."""
    return _SIDE.__dict__.setdefault("marks", {})


def _side(device: torch.device) -> tuple:
    """This thread's second stream of ``device`` and the two events that order it against the
    current stream (made once; an event is recorded again by each call, and a wait takes the
    record made before it, so one pair serves every block the thread runs in turn)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    per = _SIDE.__dict__.setdefault("by_device", {})
    got = per.get(idx)
    if got is None:
        got = per[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Event(), torch.cuda.Event())
    return got


def _input_key(x: torch.Tensor) -> tuple:
    """What identifies a block's input when its shared MLP is called on it, or on a view of
    it with the same rows: where its elements lie, how many, their dtype and its version
    (inference tensors have none)."""
    return (x.data_ptr(), x.numel(), x.shape[-1] if x.ndim else 0, x.dtype, x.is_contiguous(),
            None if x.is_inference() else x._version)


def _block_shared(block: nn.Module) -> Optional[nn.Module]:
    """The block's shared MLP where samoyeds runs it (SamoyedsDense, SamoyedsMLP), else None."""
    for attr in _SHARED_NAMES:
        mod = block._modules.get(attr)
        if mod is not None and (getattr(type(mod), "_samoyeds_dense_shared", False) or isinstance(mod, SamoyedsMLP)):
            return mod
    return None


def _block_start(block: nn.Module, x: Any) -> Optional[tuple]:
    """Marks the current stream at the block's start for its shared MLP: (the MLP, the
    mark), or None where the MLP stays on the current stream: off the GPU, with autograd,
    under torch.compile or a CUDA-graph capture, below SAMOYEDS_SHARED_STREAM_MIN_ROWS rows,
    with ``SAMOYEDS_SHARED_STREAM=0``."""
    if (torch.compiler.is_compiling() or not isinstance(x, torch.Tensor) or not x.is_cuda
            or x.dtype not in (torch.bfloat16, torch.float16) or x.ndim == 0):
        return None
    rows = x.numel() // max(1, x.shape[-1])
    if (rows < _env_int("SAMOYEDS_SHARED_STREAM_MIN_ROWS", 4096) or _env_int("SAMOYEDS_SHARED_STREAM", 1) == 0
            or torch.cuda.is_current_stream_capturing()):
        return None
    mod = _block_shared(block)
    if mod is None or (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in mod.parameters()))):
        return None
    main = torch.cuda.current_stream(x.device)
    side, start, _ = _side(x.device)
    start.record(main)
    stash = (_input_key(x), main)
    _marks()[id(mod)] = stash
    return mod, stash


def _shared_on_side(mod: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The shared MLP's output on ``x`` from the second stream, which waits for the mark of
    the block's start, once the current stream has waited for it; None where the block did
    not mark its start for this call or ``x`` is not the block's input (the MLP then runs on
    the current stream as it would without the block)."""
    if torch.compiler.is_compiling():
        return None
    marks = _SIDE.__dict__.get("marks")
    got = marks.pop(id(mod), None) if marks else None
    if got is None or not isinstance(x, torch.Tensor) or _input_key(x) != got[0]:
        return None
    main = got[1]
    side, start, done = _side(x.device)
    side.wait_event(start)
    run = mod._eager if isinstance(mod, SamoyedsMLP) else (lambda x: _dense_shared_fast(mod, x))
    if x.device.index == torch.cuda.current_device():
        torch.cuda.set_stream(side)   # (the lighter switch; it also makes the stream's device current)
        try:
            y = run(x)
        finally:
            torch.cuda.set_stream(main)
    else:   # another device than the current one, which stays current
        with torch.cuda.stream(side):
            y = run(x)
    if y is None:   # nothing launched
        return None
    done.record(side)
    main.wait_event(done)
    x.record_stream(side)   # x's memory is not reused before the second stream has read it
    y.record_stream(main)   # y is read on the current stream
    return y


def _block_end(marked: Optional[tuple]) -> None:
    """Drops the mark of a block's start that its shared MLP did not take."""
    if marked is not None:
        marks = _marks()
        if marks.get(id(marked[0])) is marked[1]:
            del marks[id(marked[0])]


def _block_forward(self: nn.Module, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    marked = _block_start(self, hidden_states)
    try:
        return type(self)._samoyeds_base.forward(self, hidden_states, *args, **kwargs)
    finally:
        _block_end(marked)


def _block_class(base: type) -> type:
    return _swapped_class(_BLOCK_CLASSES, _BLOCK_PREFIX, base, _block_forward, "_samoyeds_block",
                          "whose shared experts run beside its routed experts, on a second stream.")


def _block_patch_all(model: nn.Module, targets: List[_Target]) -> None:
    """Gives every block owning ``targets`` whose shared MLP samoyeds runs, and whose class
    is its own, its SamoyedsBlock subclass (Llama 4's, a samoyeds subclass already, marks
    its start in its own forward)."""
    for _, block in _blocks(model, targets):
        if not hasattr(type(block), "_samoyeds_base") and _block_shared(block) is not None:
            block.__class__ = _block_class(type(block))


# --- routers: one fused op ------------------------------------------------------------------------

_ROUTER_CLASSES: Dict[type, type] = {}
_ROUTER_PREFIX = "SamoyedsRouter<"
_ROUTER_NAMES = ("gate", "router")


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


def _router_spec(mod: nn.Module) -> Optional[RouterSpec]:
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


def _router_on() -> bool:
    return _env_int("SAMOYEDS_ROUTER", 1) != 0


def _router_run(mod: nn.Module, spec: RouterSpec, x: torch.Tensor) -> tuple:
    ld = "float32" if spec.logits_fp32 else str(x.dtype).replace("torch.", "")
    return _router_op(x, mod.weight, spec.k, bias=mod.bias if spec.bias else None, mode=spec.mode,
                   n_group=spec.n_group, topk_group=spec.topk_group, renorm=spec.renorm, scale=spec.scale,
                   choice_bias=mod.e_score_correction_bias if spec.choice_bias else None,
                   logits_dtype=ld, weights_dtype="float32" if spec.weights_fp32 else ld)


def _router_fast(mod: nn.Module, hidden_states: torch.Tensor) -> Optional[tuple]:
    """The router's outputs by samoyeds.router, or None where its own forward runs."""
    spec = getattr(mod, "_samoyeds_router_spec", None)
    w = getattr(mod, "weight", None)
    if (spec is None or not hidden_states.is_cuda or not isinstance(w, torch.Tensor)
            or hidden_states.dtype not in (torch.bfloat16, torch.float16) or w.dtype != hidden_states.dtype
            or w.device != hidden_states.device or torch.compiler.is_compiling() or not _router_on()):
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
    return _router_run(mod, spec, x)


def _router_forward(self: nn.Module, hidden_states: torch.Tensor) -> Any:
    out = _router_fast(self, hidden_states)
    return out if out is not None else type(self)._samoyeds_base.forward(self, hidden_states)


def _router_class(base: type) -> type:
    return _swapped_class(_ROUTER_CLASSES, _ROUTER_PREFIX, base, _router_forward, "_samoyeds_router",
                          "whose forward runs samoyeds.router for inference on the GPU.")


def _router_agrees(mod: nn.Module, spec: RouterSpec) -> bool:
    """Whether samoyeds.router with ``spec`` gives ``mod``'s own outputs on 37 random tokens
    (on the module's device: the kernel on the GPU, the C reference on the CPU)."""
    w = mod.weight
    if w.device.type == "meta" or w.dtype not in _SUPPORTED_DTYPES:
        return False
    H = w.shape[1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, H, generator=g).to(device=w.device, dtype=w.dtype)
    try:
        with torch.no_grad():
            ref = type(mod).forward(mod, x)
            got = _router_run(mod, spec, x)
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


def _router_patch_all(model: nn.Module, targets: List[_Target]) -> None:
    """Gives every router of the blocks owning ``targets`` whose rule samoyeds knows, and
    whose outputs it reproduces, its SamoyedsRouter subclass (patch_model, from_pretrained)."""
    for _, block in _blocks(model, targets):
        for attr in _ROUTER_NAMES:
            mod = block._modules.get(attr)
            if mod is None or getattr(type(mod), "_samoyeds_router", False):
                continue
            spec = _router_spec(mod)
            if spec is not None and _router_agrees(mod, spec):
                mod._samoyeds_router_spec = spec
                mod.__class__ = _router_class(type(mod))


def _unswap_all(model: nn.Module) -> None:
    """Gives every block, unpruned shared MLP and router that patch_model gave a samoyeds
    subclass (_swapped_class) its own class back."""
    for mod in model.modules():
        if getattr(type(mod), "_samoyeds_swapped", False):
            mod.__class__ = type(mod)._samoyeds_base
            mod.__dict__.pop("_samoyeds_router_spec", None)


def _shared_weights(mod: nn.Module) -> Dict[str, torch.Tensor]:
    """A shared MLP's weights in packing layout: gate_up [1, 2I, H], down [1, H, I]."""
    return {"gate_up": torch.cat([mod.gate_proj.weight.detach(), mod.up_proj.weight.detach()], 0)[None].contiguous(),
            "down": mod.down_proj.weight.detach()[None].contiguous()}


def _shared_mask(st: _SharedTarget, proj: str, w: torch.Tensor, fmt: SparseFormat, method: Union[str, MaskFn],
                 given: Optional[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    if given:
        if proj == "gate_up":
            m = torch.cat([given["gate_proj"], given["up_proj"]], 0)[None]
        else:
            m = given["down_proj"][None]
        return m.to(device=w.device).contiguous()
    return _method_mask(st.name, proj, w, fmt, method)


def _patch_shared(st: _SharedTarget, fmt: SparseFormat, dims: tuple, method: Union[str, MaskFn],
                  given: Optional[Mapping[str, torch.Tensor]]) -> None:
    H, I = dims
    mod = st.mlp
    ws = _shared_weights(mod)
    packed = {proj: pack(w, fmt, mask=_shared_mask(st, proj, w, fmt, method, given), glu=proj == "gate_up")
              for proj, w in ws.items()}
    del ws
    requires_grad = bool(mod.gate_proj.weight.requires_grad)
    for k in _MLP_PROJS:
        delattr(mod, k)
    mod.__dict__["_samoyeds_requires_grad"] = requires_grad
    setattr(st.parent, st.attr, SamoyedsMLP(fmt, H, I, packed["gate_up"], packed["down"], mod))


def _unpatch_shared(parent: nn.Module, attr: str) -> None:
    sm_mod: SamoyedsMLP = parent._modules[attr]
    I = sm_mod.intermediate
    dense = {proj: unpack(sm_mod._packed(proj))[0] for proj in _PROJS}
    original = sm_mod._original
    rg = original.__dict__.pop("_samoyeds_requires_grad", False)
    for k, w in (("gate_proj", dense["gate_up"][:I]), ("up_proj", dense["gate_up"][I:]), ("down_proj", dense["down"])):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        lin.weight = nn.Parameter(w.contiguous(), requires_grad=rg)
        setattr(original, k, lin)
    setattr(parent, attr, original)


def _packed_shared(model: nn.Module) -> List[tuple]:
    """(name, parent, attr) of every SamoyedsMLP in ``model``."""
    out = []
    for name, mod in model.named_modules():
        for attr, child in mod._modules.items():
            if isinstance(child, SamoyedsMLP):
                out.append((f"{name}.{attr}" if name else attr, mod, attr))
    return out


# --- patching -------------------------------------------------------------------------------------

def _method_mask(name: str, proj: str, w: torch.Tensor, fmt: SparseFormat, method: Union[str, MaskFn]) -> torch.Tensor:
    """The mask of ``w`` (packing layout) by a mask function, or by magnitude."""
    if callable(method):
        key = f"{proj}_proj"
        m = method(name, key, w, fmt)
        if tuple(m.shape) != tuple(w.shape):
            raise ValueError(f"method({name!r}, {key!r}, ...): expected a mask of shape {tuple(w.shape)}, "
                             f"got {tuple(m.shape)}")
        return m.contiguous()
    return _magnitude_mask(w, fmt)


def _mask_for(t: _Target, p: ExpertsPatch, proj: str, w: torch.Tensor, method: Union[str, MaskFn],
              given: Optional[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    key = f"{proj}_proj"
    if given is not None and key in given:
        return _to_pack(given[key].to(device=w.device), p, proj)
    return _method_mask(t.name, proj, w, p.fmt, method)


def _patch_one(t: _Target, method: Union[str, MaskFn], given: Optional[Mapping[str, torch.Tensor]]) -> None:
    """Packs one experts module; it changes only once both weights are packed."""
    mod, p = t.experts, t.layout
    packed = {}
    for proj in _PROJS:
        w = _to_pack(mod._parameters[f"{proj}_proj"], p, proj)
        packed[proj] = pack(w, p.fmt, mask=_mask_for(t, p, proj, w, method, given), glu=proj == "gate_up")
        del w
    gate_up_bias = None
    if p.bias:
        b = mod._parameters["gate_up_proj_bias"].detach()
        gate_up_bias = (_split_gate_up(b, 1) if p.interleaved else b).contiguous()
        delattr(mod, "gate_up_proj_bias")
    for proj in _PROJS:
        delattr(mod, f"{proj}_proj")
        for a in _ARRAYS:
            mod.register_buffer(f"samoyeds_{proj}_{a}", getattr(packed[proj], a))
    mod.register_buffer("samoyeds_gate_up_bias", gate_up_bias)
    mod._samoyeds = p
    if t.block is not None:
        t.block.__class__ = _patched_llama4_class(type(t.block))


def _unpatch_one(mod: nn.Module) -> None:
    p: ExpertsPatch = mod._samoyeds
    shapes = {"gate_up": (p.num_experts, 2 * p.intermediate, p.hidden),
              "down": (p.num_experts, p.hidden, p.intermediate)}
    for proj in _PROJS:
        arrays = [getattr(mod, f"samoyeds_{proj}_{a}") for a in _ARRAYS]
        dense = unpack(PackedWeight(*arrays, p.fmt, shapes[proj], glu=proj == "gate_up"))
        for a in _ARRAYS:
            delattr(mod, f"samoyeds_{proj}_{a}")
        setattr(mod, f"{proj}_proj", nn.Parameter(_from_pack(dense, p, proj), requires_grad=p.requires_grad))
    b = mod.samoyeds_gate_up_bias
    delattr(mod, "samoyeds_gate_up_bias")
    if p.bias:
        b = _merge_gate_up(b, 1) if p.interleaved else b
        mod.gate_up_proj_bias = nn.Parameter(b.contiguous(), requires_grad=p.requires_grad)
    del mod._samoyeds


def _progress(items: List[_Target], enabled: bool, desc: str) -> Iterable[_Target]:
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="layer")


def _set_implementation(model: nn.Module, modules: List[nn.Module], impl: Any,
                        fallback: Optional[List[Optional[str]]] = None) -> None:
    """Selects ``impl`` (a name, a per-subconfig dict, or None for transformers' default)
    through ``model.set_experts_implementation``, then makes sure every module of
    ``modules`` (decorated experts) reads ``"samoyeds"`` exactly when it is patched:
    a sub-model transformers does not recognise as switchable, or a bare module
    passed as ``model``, keeps its config otherwise.  ``fallback[i]`` is what an
    unpatched ``modules[i]`` gets then (None: ``"eager"``)."""
    if not modules:
        return
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    for i, mod in enumerate(modules):
        cfg = getattr(mod, "config", None)
        if cfg is None:
            continue
        patched = getattr(mod, "_samoyeds", None) is not None
        now = cfg._experts_implementation
        if patched and now != IMPLEMENTATION:
            cfg._experts_implementation_internal = IMPLEMENTATION
        elif not patched and now == IMPLEMENTATION:
            cfg._experts_implementation_internal = (fallback[i] if fallback else None) or "eager"


def patch_model(model: nn.Module, fmt: Union[str, SparseFormat, tuple] = "samoyeds-1:2:128",
                method: Union[str, MaskFn] = "magnitude", progress: bool = True, *,
                masks: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None,
                shared_experts: bool = False) -> nn.Module:
    """Packs every MoE experts module of a transformers model into ``fmt``, in place.

    Args:
        model: a transformers ``PreTrainedModel`` (Mixtral, Qwen2-MoE, Qwen3-MoE,
            OLMoE, DeepSeek-V2/V3, GPT-OSS, Phi-MoE, Granite-MoE, Llama 4, or any
            model whose experts use ``@use_experts_implementation`` with a SwiGLU
            or GPT-OSS gate).  Expert weights fp32/bf16/fp16, on the CPU or CUDA
            (packing runs where the weights are).
        fmt: the sparse format (preset name, ``"n:m:v"`` or a ``SparseFormat``).
        method: how to choose the kept weights: ``"magnitude"`` (largest ``|w|``),
            or a callable ``(module_name, "gate_up_proj" | "down_proj", w, fmt) ->
            bool mask`` where ``w`` is ``[E, R, C]`` in packing layout (output rows,
            gate rows before up rows).
        progress: show a tqdm bar over the MoE layers.
        masks: precomputed bool masks, ``{experts module name: {"gate_up_proj": m,
            "down_proj": m}}``, each shaped like the module's Parameter; they take
            precedence over ``method``.  With ``shared_experts``, also ``{shared MLP name:
            {"gate_proj": m, "up_proj": m, "down_proj": m}}`` shaped like its Linear weights.
        shared_experts: also pack each MoE block's shared experts (the always-on MLP of
            DeepSeek-V2/V3, Qwen2-MoE, Llama 4 blocks) into a :class:`SamoyedsMLP`; every
            token passes through them, so this changes the model more than the routed
            experts' packing does.  A ``method`` callable gets ``"gate_up_proj"`` (``[1, 2I,
            H]``, gate rows then up rows) and ``"down_proj"`` (``[1, H, I]``) for them.
            Without it, shared experts that are a gated SiLU MLP of bias-free ``nn.Linear``
            keep their dense weights and run :func:`samoyeds.dense_decode` at decode sizes
            on the GPU (their class becomes a ``SamoyedsDense<...>`` subclass; see the
            module's notes).
    Returns:
        ``model``, with ``gate_up_proj``/``down_proj`` (and GPT-OSS's
        ``gate_up_proj_bias``) replaced by ``samoyeds_*`` buffers and the experts
        implementation set to ``"samoyeds"``; with ``shared_experts``, each shared MLP
        replaced by a :class:`SamoyedsMLP`.
    Raises:
        UnsupportedModelError: an experts module has a layout samoyeds cannot run
            (checked for every module before anything changes).
        NotImplementedError: ``method`` names another sparsifier (calibrated ones run
            through :func:`samoyeds.sparsify_model`).
        ValueError: a given or computed mask does not fit the format; the modules
            packed before the failing one get dense Parameters back (masked).
    """
    fmt = SparseFormat.parse(fmt)
    if isinstance(method, str):
        if method != "magnitude":
            raise NotImplementedError(
                f"method={method!r}: patch_model builds only 'magnitude' masks; the calibrated methods "
                "('activation', 'sparsegpt') run through samoyeds.sparsify_model(model, fmt, method, "
                "calibration=...), or pass a mask function (name, proj, w, fmt) -> mask or masks=...")
    elif not callable(method):
        raise TypeError(f"method: expected 'magnitude' or a callable, got {type(method).__name__}")
    register()
    targets = _find_experts(model)
    if not targets:
        raise UnsupportedModelError(f"{type(model).__name__}: no Mixture-of-Experts experts module found")
    done = [t.name for t in targets if getattr(t.experts, "_samoyeds", None) is not None]
    if done:
        raise ValueError(f"{type(model).__name__} is already patched ({done[0]!r}, ...); "
                         "call samoyeds.unpatch_model(model) first")
    shared = _find_shared(model, targets) if shared_experts else []
    if shared_experts and not shared:
        raise UnsupportedModelError(f"{type(model).__name__}: shared_experts=True, but its MoE blocks have no "
                                    f"shared experts (a child named {' or '.join(_SHARED_NAMES)})")
    masks = dict(masks or {})
    unknown = sorted(set(masks) - {t.name for t in targets} - {st.name for st in shared})
    if unknown:
        raise ValueError(f"masks: no experts module named {unknown}; expected names among "
                         f"{[t.name for t in targets] + [st.name for st in shared]}")
    shared_dims = {st.name: _shared_dims(st, model, fmt) for st in shared}
    for st in shared:
        given = masks.get(st.name, {})
        for key, m in given.items():
            lin = st.mlp._modules.get(key)
            if key not in _MLP_PROJS or lin is None:
                raise ValueError(f"masks[{st.name!r}]: expected keys 'gate_proj', 'up_proj' and 'down_proj', got {key!r}")
            if tuple(m.shape) != tuple(lin.weight.shape):
                raise ValueError(f"masks[{st.name!r}][{key!r}]: expected shape {tuple(lin.weight.shape)} (the "
                                 f"Linear weight's), got {tuple(m.shape)}")
        if given and set(given) != set(_MLP_PROJS):
            raise ValueError(f"masks[{st.name!r}]: expected all of 'gate_proj', 'up_proj' and 'down_proj', "
                             f"got {sorted(given)}")
    for t in targets:
        for key, m in masks.get(t.name, {}).items():
            param = t.experts._parameters.get(key)
            if key not in ("gate_up_proj", "down_proj") or param is None:
                raise ValueError(f"masks[{t.name!r}]: expected keys 'gate_up_proj' and 'down_proj', got {key!r}")
            if tuple(m.shape) != tuple(param.shape):
                raise ValueError(f"masks[{t.name!r}][{key!r}]: expected shape {tuple(param.shape)} (the "
                                 f"Parameter's), got {tuple(m.shape)}")
    for t in targets:
        t.layout = _layout(t, model, fmt)

    previous = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else None
    if isinstance(previous, dict):
        previous = {k: (None if v == IMPLEMENTATION else v) for k, v in previous.items()}
    done: List[_Target] = []
    done_shared: List[_SharedTarget] = []
    failing = ""  # the module being packed, for the note on failure
    with torch.no_grad():
        try:
            for t in _progress(targets, progress, f"samoyeds: packing experts ({fmt.name})"):
                failing = t.name
                _patch_one(t, method, masks.get(t.name))
                done.append(t)
            for st in shared:
                failing = st.name
                _patch_shared(st, fmt, shared_dims[st.name], method, masks.get(st.name))
                done_shared.append(st)
        except Exception as e:
            for d in done:   # back to dense, so that the model stays runnable as before
                _unpatch_one(d.experts)
                if d.block is not None:
                    d.block.__class__ = type(d.block)._samoyeds_base
            for d in done_shared:
                _unpatch_shared(d.parent, d.attr)
            if (done or done_shared) and hasattr(e, "add_note"):
                e.add_note(f"samoyeds.patch_model failed at {failing!r}; the {len(done) + len(done_shared)} "
                           "module(s) packed before it were unpacked and now hold their masked dense weights")
            raise
    if not shared_experts:
        _dense_shared_patch_all(model, targets)
    _router_patch_all(model, targets)
    _block_patch_all(model, targets)
    setattr(model, _PREVIOUS_ATTR, previous)
    _set_implementation(model, [t.experts for t in targets if t.block is None], IMPLEMENTATION)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undoes :func:`patch_model`: every patched experts module gets dense Parameters
    again, in the model's own layout, holding the masked weights (exactly
    ``w * mask``), and the previous experts implementation is restored; every
    :class:`SamoyedsMLP` gives way to the module it replaced, with dense ``nn.Linear``
    projections holding its masked weights, and unpruned shared experts get their own
    class back.  Returns ``model``."""
    targets = [t for t in _find_experts(model) if getattr(t.experts, "_samoyeds", None) is not None]
    shared = _packed_shared(model)
    if not targets and not shared:
        raise ValueError(f"{type(model).__name__} has no experts module patched by samoyeds")
    decorated = [t.experts for t in targets if t.block is None]
    fallback = [m._samoyeds.previous_implementation for m in decorated]
    with torch.no_grad():
        for t in targets:
            _unpatch_one(t.experts)
            if t.block is not None:
                t.block.__class__ = type(t.block)._samoyeds_base
        for _, parent, attr in shared:
            _unpatch_shared(parent, attr)
        _unswap_all(model)
    previous = getattr(model, _PREVIOUS_ATTR, None)
    if hasattr(model, _PREVIOUS_ATTR):
        delattr(model, _PREVIOUS_ATTR)
    _set_implementation(model, decorated, previous, fallback)
    return model


#: Alias of :func:`unpatch_model`: the model back with dense (masked) expert weights.
to_dense = unpatch_model


def is_patched(model: nn.Module) -> bool:
    """True when some experts module (or shared-experts MLP) of ``model`` holds samoyeds-packed weights."""
    return any(getattr(m, "_samoyeds", None) is not None or isinstance(m, SamoyedsMLP) for m in model.modules())


def experts_weight_nbytes(model: nn.Module, shared_experts: bool = False) -> int:
    """Bytes held by the expert weight matrices (gate_up and down; biases excluded):
    the dense Parameters, or the packed values, metadata and row indices.  With
    ``shared_experts``, the MoE blocks' shared-experts MLPs too (their dense ``nn.Linear``
    weights, or a :class:`SamoyedsMLP`'s packed buffers)."""
    packed_names = [f"samoyeds_{proj}_{a}" for proj in _PROJS for a in _ARRAYS]
    held = []
    targets = _find_experts(model)
    for t in targets:
        mod = t.experts
        names = packed_names if getattr(mod, "_samoyeds", None) is not None else ["gate_up_proj", "down_proj"]
        held += [getattr(mod, n, None) for n in names]
    for st in _find_shared(model, targets) if shared_experts else []:
        if isinstance(st.mlp, SamoyedsMLP):
            held += [getattr(st.mlp, n) for n in packed_names]
        else:
            held += [getattr(st.mlp._modules.get(k), "weight", None) for k in _MLP_PROJS]
    return sum(x.numel() * x.element_size() for x in held if x is not None)
